"""One command from 1 to N ranks: re-execute under ``torch.distributed.run`` (torchrun) when needed.

``rapidlite ... --nproc-per-node N`` (or ``python my_trainer.py ... --nproc-per-node N``) in a process that
no launcher started re-runs the same command as N workers through torchrun's elastic agent, in this
process: ``--max-restarts`` restarts the worker group after a failure, ``--nnodes``/``--node-rank``/
``--master-addr``/``--master-port`` (or the ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``
variables of Megatron-style scripts) span nodes. A process that a launcher already started (torchrun,
Slurm ``srun`` with the torch variables, a Kubernetes PyTorchJob: ``WORLD_SIZE`` is set) just joins.

Workers do not print their failures; they record them (``distributed.report_worker_error``) and the
launcher prints the first one: one line for a user error, the failing rank's traceback for a bug.

``launch_or_join`` is the one place that decides, from the resolved settings: the ``rapidlite`` command calls
it once after resolving, and a user's ``python my_trainer.py`` calls it through ``launch_script_or_join``
when its ``RapidliteEngine()`` parses the flags. A worker never decides again: it joins.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from rapidlite.environ import env_int
from rapidlite.resolve import nproc_per_node, num_nodes, target_world_size


def needs_launch(args: Any) -> bool:
    return not env_int("WORLD_SIZE", 0) and target_world_size(args) > 1


def torchrun_args(args: Any) -> list[str]:
    nnodes = num_nodes(args)
    out = [
        f"--nproc-per-node={nproc_per_node(args)}",
        f"--nnodes={nnodes}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=0.2",  # a failed worker is noticed (and its peers stopped) within a fraction of a second
    ]
    master_addr = args.master_addr or os.environ.get("MASTER_ADDR")
    master_port = args.master_port or env_int("MASTER_PORT", 0)
    if nnodes == 1 and not master_addr:
        return [*out, "--standalone"]  # a private rendezvous on a free local port
    node_rank = args.node_rank if args.node_rank is not None else env_int("NODE_RANK", 0)
    return [*out, f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port or 29500}"]


def _quiet_agent() -> None:
    """torchrun's agent logs every start and stop at INFO/WARNING; the workers' own output is the record."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _threads_per_worker(nproc: int) -> None:
    # torchrun would set 1 thread per worker and warn; on CPUs the cores are shared out instead.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max((os.cpu_count() or 1) // nproc, 1))


def _report(failure: Any) -> tuple[str, int]:
    """The text and exit code for one worker's failure record."""
    data = failure.error_file_data or {}
    extra = data.get("rapidlite", {})
    message = data.get("message", {})
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    if extra.get("user_error"):
        return f"rapidlite: error: {text}", 2
    callstack = message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""
    rank = extra.get("rank", failure.local_rank)
    if callstack:
        return f"rapidlite: error: rank {rank} failed: {text}\n{callstack.rstrip()}", 1
    if failure.exitcode < 0:
        return (
            f"rapidlite: error: rank {rank} was killed by signal {failure.signal_name()} "
            f"(exit code {failure.exitcode})",
            1,
        )
    return f"rapidlite: error: rank {rank} exited with code {failure.exitcode}", failure.exitcode or 1


def _first_failure(error: Any) -> Any:
    """The worker that failed first: rapidlite's records carry nanosecond times; others fall back on torch's."""
    failures = list(error.failures.values())
    recorded = [f for f in failures if (f.error_file_data or {}).get("rapidlite")]
    if recorded:
        return min(recorded, key=lambda f: f.error_file_data["rapidlite"]["time_ns"])
    with_file = [f for f in failures if f.error_file_data and f.error_file_data.get("message")]
    return min(with_file or failures, key=lambda f: f.timestamp)


def launch(args: Any, entry: str, argv: list[str], module: bool) -> int:
    """Run ``entry argv`` (a module with ``module``, else a script path) as a torchrun worker group; return
    the exit code to end with. Prints the first failure as described in the module docstring."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launch_args = torchrun_args(args)
    _threads_per_worker(nproc_per_node(args))
    _quiet_agent()
    parsed = get_args_parser().parse_args([*launch_args, *(["-m"] if module else []), entry, *argv])
    try:
        run(parsed)
    except ChildFailedError as e:
        text, code = _report(_first_failure(e))
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
        return code
    return 0


def launch_or_join(config: Any, entry: str, argv: list[str], module: bool) -> int | None:
    """The launch decision. None: this process runs the training (it is a launched worker, or the job is one
    process). Otherwise this process was the launcher: it ran ``entry argv`` as the workers (``launch``) and
    the result is the exit code the process must end with."""
    if not needs_launch(config):
        return None
    return launch(config, entry, argv, module=module)


def launch_script_or_join(config: Any) -> None:
    """``python my_trainer.py ... --nproc-per-node N``: the script becomes the launcher of its own workers and
    this process ends here with their exit code (``sys.exit``); in a worker, or on one process, it returns and
    the script runs."""
    code = launch_or_join(config, sys.argv[0], sys.argv[1:], module=False)
    if code is not None:
        sys.exit(code)
