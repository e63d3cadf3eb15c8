"""What a launcher tells a process through its environment (torchrun, Slurm, Kubernetes, Megatron-style
scripts' ``NNODES``/``NODE_RANK``), read in one torch-free place."""

from __future__ import annotations

import os

from rapidlite.errors import ConfigError


def _as_int(name: str, value: str | None, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def env_int(name: str, default: int) -> int:
    return _as_int(name, os.environ.get(name), default)


def env_switch(name: str) -> bool:
    """A switch set in the environment (``RAPIDLITE_NO_PROGRESS=1``): on unless unset, empty, 0, false or no."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def launch_value(name: str) -> str | None:
    """``MASTER_ADDR``, ``MASTER_PORT``, ``NNODES`` or ``NODE_RANK``: the environment's value, else the one an
    ``srun`` task implies (``rapidlite.runtime.slurm``), else None."""
    from rapidlite.runtime.slurm import rendezvous

    return os.environ.get(name) or rendezvous(os.environ).get(name)


def launch_int(name: str, default: int) -> int:
    return _as_int(name, launch_value(name), default)
