"""The rendezvous of a multi-node run from Slurm's variables, for ``srun rapidlite ...`` (torch-free).

A task that ``srun`` started has ``SLURM_STEP_ID`` (the batch script itself has the job's variables but no
step: run there, rapidlite is one node's launcher). One task per node, each a launcher of its node's
workers: NNODES is the step's node count, NODE_RANK the task's node index, MASTER_ADDR the first host of
the step's node list and MASTER_PORT ``20000 + job id mod 10000``, the same on every node without any
exchange. A single-node step derives none of them: its launcher keeps a private rendezvous on a free port.
Variables set in the environment win, each on its own. ``srun`` with several tasks per node is refused: each
task would launch a node's workers under the same NODE_RANK (unless the tasks carry the torch variables,
``WORLD_SIZE`` and ``RANK``: then each is a worker and joins).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from rapidlite.errors import ConfigError

PORT_BASE, PORT_SPAN = 20000, 10000


def expand_hostlist(hostlist: str) -> list[str]:
    """``node[01-03,07],gpu-a[1-2]`` -> node01 node02 node03 node07 gpu-a1 gpu-a2, as Slurm expands it
    (``scontrol show hostnames``): ranges keep their zero padding, several bracket groups in one name multiply."""
    hosts: list[str] = []
    for name in _split_outside_brackets(hostlist, hostlist):
        parts = re.split(r"\[([^\[\]]*)\]", name)  # text, group, text, group, ..., text
        if any(c in part for part in parts for c in "[]"):
            raise ConfigError(f"Slurm node list {hostlist!r}: unbalanced brackets in {name!r}")
        choices = [[text] if i % 2 == 0 else _expand_group(text, hostlist) for i, text in enumerate(parts)]
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    return hosts


def _split_outside_brackets(text: str, hostlist: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(f"Slurm node list {hostlist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigError(f"Slurm node list {hostlist!r}: unbalanced brackets")
    return [item for item in [*items, current] if item]


def _expand_group(group: str, hostlist: str) -> list[str]:
    out = []
    for item in group.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ConfigError(f"Slurm node list {hostlist!r}: {item!r} is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ConfigError(f"Slurm node list {hostlist!r}: the range {item!r} runs backwards")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    return next((environ[n] for n in names if environ.get(n)), None)


def _integer(environ: Mapping[str, str], *names: str) -> int | None:
    value = _first(environ, *names)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        name = next(n for n in names if environ.get(n))
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def rendezvous(environ: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK, those of them that an ``srun`` task implies and ``environ``
    lacks ({} outside an srun step, on a single node, and in a process whose launcher set ``WORLD_SIZE``: it
    joins)."""
    if not environ.get("SLURM_STEP_ID") or not environ.get("SLURM_JOB_ID") or environ.get("WORLD_SIZE"):
        return {}
    nodes = _integer(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    if nodes == 1:
        return {}
    tasks = _integer(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks is not None and tasks != nodes and not environ.get("NODE_RANK"):
        raise ConfigError(
            f"srun started {tasks} tasks on {nodes} nodes: rapidlite starts the workers of its node itself, "
            "so run one task per node (srun --ntasks-per-node=1; --nproc-per-node sets the workers per node)"
        )
    derived = {
        "NNODES": str(nodes),
        "NODE_RANK": str(_integer(environ, "SLURM_NODEID") or 0),
        "MASTER_PORT": str(PORT_BASE + (_integer(environ, "SLURM_JOB_ID") or 0) % PORT_SPAN),
    }
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    hosts = expand_hostlist(nodelist) if nodelist else []
    if hosts:
        derived["MASTER_ADDR"] = hosts[0]
    return {name: value for name, value in derived.items() if not environ.get(name)}
