"""What a launcher tells a process through its environment (torchrun, Slurm, Kubernetes, Megatron-style
scripts' ``NNODES``/``NODE_RANK``), read in one torch-free place."""

from __future__ import annotations

import os

from rapidlite.errors import ConfigError


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
