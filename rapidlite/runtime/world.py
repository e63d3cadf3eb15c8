"""How many processes a run has: nodes x processes per node, or the launcher's WORLD_SIZE inside a worker."""

from __future__ import annotations

from rapidlite.config.runtime import ParallelConfig
from rapidlite.runtime.environ import env_int, launch_int


def _default_nproc_per_node() -> int:
    import torch  # only when the flag is not given: --help and flag errors stay fast

    return max(torch.cuda.device_count(), 1)


def num_nodes(cfg: ParallelConfig) -> int:
    return cfg.nnodes or launch_int("NNODES", 1)


def nproc_per_node(cfg: ParallelConfig) -> int:
    return cfg.nproc_per_node or _default_nproc_per_node()


def target_world_size(cfg: ParallelConfig) -> int:
    """Processes of the whole job: the launcher's WORLD_SIZE inside a worker, else nodes x processes."""
    return env_int("WORLD_SIZE", 0) or num_nodes(cfg) * nproc_per_node(cfg)
