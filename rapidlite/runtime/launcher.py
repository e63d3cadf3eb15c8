"""One command from 1 to N ranks: re-execute under ``torch.distributed.run`` (torchrun) when needed.

``rapidlite ... --nproc-per-node N`` (or ``python my_trainer.py ... --nproc-per-node N``) in a process that
no launcher started re-runs the same command as N workers (a script's as ``rapidlite --user-script`` runs it)
through torchrun's elastic agent, in this process: ``--max-restarts`` restarts the worker group after a
failure, ``--nnodes``/``--node-rank``/``--master-addr``/``--master-port`` (or the ``NNODES``/``NODE_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` variables of Megatron-style scripts) span nodes; in a task of a multi-node
``srun`` step the unset ones follow from Slurm's variables (``rapidlite.runtime.slurm``). A process that a launcher
already started (torchrun, Slurm ``srun`` with the torch variables, a Kubernetes PyTorchJob: ``WORLD_SIZE`` is
set) just joins.

Workers do not print their failures; they record them (``distributed.report_worker_error``) and the
launcher prints the first one: one line for a user error, the failing rank's traceback for a bug, one line
naming the rank and the signal for a rank killed by one (an out-of-memory kill), not its peers' "Connection
reset". SIGTERM and SIGUSR1 to the launcher are passed on to the workers, which stop after a step, save and
exit with ``preemption.EXIT_CODE`` (143); the launcher ends with it, without a restart or a traceback.

``launch_or_join`` is the one place that decides, from the resolved settings: the ``rapidlite`` command calls
it once after resolving, and a user's ``python my_trainer.py`` calls it through ``launch_script_or_join``
when its ``RapidliteEngine()`` parses the flags. A worker never decides again: it joins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rapidlite.config.runtime import ParallelConfig
from rapidlite.runtime import forked_workers
from rapidlite.runtime.environ import env_int, launch_int, launch_value
from rapidlite.runtime.preemption import EXIT_CODE, SIGNALS, signal_name
from rapidlite.runtime.world import nproc_per_node, num_nodes, target_world_size


def needs_launch(cfg: ParallelConfig) -> bool:
    return not env_int("WORLD_SIZE", 0) and target_world_size(cfg) > 1


def torchrun_args(cfg: ParallelConfig) -> list[str]:
    nnodes = num_nodes(cfg)
    out = [
        f"--nproc-per-node={nproc_per_node(cfg)}",
        f"--nnodes={nnodes}",
        f"--max-restarts={cfg.max_restarts}",
        "--monitor-interval=0.2",  # a failed worker is noticed (and its peers stopped) within a fraction of a second
    ]
    master_addr = cfg.master_addr or launch_value("MASTER_ADDR")
    master_port = cfg.master_port or launch_int("MASTER_PORT", 0)
    if nnodes == 1 and not master_addr:
        # A private rendezvous on a free port of the loopback address: torchrun would give the workers this host's
        # name to connect to, which may resolve to nothing (a container without network, some laptops and nodes).
        return [*out, "--standalone", "--local-addr=127.0.0.1"]
    node_rank = cfg.node_rank if cfg.node_rank is not None else launch_int("NODE_RANK", 0)
    return [*out, f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port or 29500}"]


def _quiet_agent() -> None:
    """torchrun's agent logs every start and stop at INFO/WARNING; the workers' own output is the record."""
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _threads_per_worker(nproc: int) -> None:
    # torchrun would set 1 thread per worker and warn; on CPUs the cores are shared out instead.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max((os.cpu_count() or 1) // nproc, 1))


class _Supervisor:
    """What rapidlite's launcher adds to torchrun's agent, which has no hook for either:

    - SIGTERM and SIGUSR1 (a scheduler's preemption, Slurm's ``--signal``) are passed on to the workers, which
      stop together after a step, save and exit with ``preemption.EXIT_CODE``; that is not a failure to restart
      under ``--max-restarts``, nor one to print a traceback for;
    - the ranks found dead at the first look after a failure, before the agent stops the others: a rank killed
      by a signal (SIGKILL: an out-of-memory kill) is the cause, not the healthy ranks' "Connection reset";
    - ranks that have not stopped ``grace`` seconds after a preemption signal (the process group's timeout: a
      rank stuck in a collective, or in a step that never ends) are killed, and the launcher still ends with
      ``preemption.EXIT_CODE``, so the scheduler requeues the job from its last complete checkpoint.
    """

    def __init__(self, grace: float = float("inf")) -> None:
        self.signal = 0  # the first preemption signal this launcher received
        self.signalled_at = 0.0
        self.grace = grace
        self.agent: Any = None
        self.first_deaths: dict[int, int] = {}  # global rank -> exit code, at the first look that found any
        self.stuck: list[int] = []  # the ranks killed for not stopping within the grace

    # ------------------------------------------------------------ signals
    def handle(self, signum: int, frame: Any) -> None:
        if not self.signal:
            self.signal, self.signalled_at = signum, time.monotonic()
        self.forward(signum)

    def end_stuck(self, worker_group: Any) -> None:
        """Kill the ranks still running ``grace`` seconds after the signal (once)."""
        if not self.signal or self.stuck or time.monotonic() - self.signalled_at < self.grace:
            return
        pcontext = getattr(self.agent, "_pcontext", None)
        handlers = getattr(pcontext, "subprocess_handlers", {}) if pcontext is not None else {}
        running = [(local, h) for local, h in handlers.items() if h.proc.poll() is None]
        self.stuck = sorted(worker_group.workers[local].global_rank for local, _ in running)
        for _, handler in running:
            try:
                os.killpg(handler.proc.pid, signal.SIGKILL)  # the worker and its data-loader processes
            except ProcessLookupError:
                pass

    def forward(self, signum: int) -> None:
        pcontext = getattr(self.agent, "_pcontext", None)
        for pid in pcontext.pids().values() if pcontext is not None else ():
            try:
                os.kill(pid, signum)  # the worker only: its data-loader processes keep serving the last step
            except ProcessLookupError:
                pass

    def stopped_on_purpose(self, failures: dict[int, Any]) -> bool:
        """The workers ended because of a preemption signal (to the launcher, or to them directly)."""
        return bool(self.signal) or all(f.exitcode == EXIT_CODE for f in failures.values())

    # ------------------------------------------------------------ the agent
    def note_deaths(self, pcontext: Any, worker_group: Any) -> None:
        if self.first_deaths or pcontext is None:
            return
        for local_rank, handler in getattr(pcontext, "subprocess_handlers", {}).items():
            code = handler.proc.poll()  # the agent's own poll reads the same cached code afterwards
            if code:
                self.first_deaths[worker_group.workers[local_rank].global_rank] = code

    def agent_class(self) -> type:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        supervisor = self

        class Agent(LocalElasticAgent):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                supervisor.agent = self

            def _start_workers(self, worker_group: Any) -> Any:
                supervisor.first_deaths = {}
                started = super()._start_workers(worker_group)
                if supervisor.signal:  # arrived between two attempts: this one stops at once
                    supervisor.forward(supervisor.signal)
                return started

            def _monitor_workers(self, worker_group: Any) -> Any:
                supervisor.end_stuck(worker_group)
                supervisor.note_deaths(self._pcontext, worker_group)
                result = super()._monitor_workers(worker_group)
                if result.is_failed() and supervisor.stopped_on_purpose(result.failures):
                    self._remaining_restarts = 0  # a preempted job is resumed by its scheduler, not restarted
                return result

        return Agent

    # ------------------------------------------------------------ the report
    def report(self, error: Any) -> tuple[str | None, int]:
        """The line to print (None: rank 0 has said it) and the exit code, for the group's failure."""
        failures = error.failures
        if self.stuck:
            ranks = ", ".join(str(rank) for rank in self.stuck)
            return (
                f"rapidlite: {signal_name(self.signal)}: rank{'s' if len(self.stuck) > 1 else ''} {ranks} had not "
                f"stopped {self.grace:g} s after it (stuck in a collective or in a step; --distributed-timeout-"
                f"minutes); killed without saving, the last complete checkpoint is kept (exit code {EXIT_CODE})"
            ), EXIT_CODE
        if self.stopped_on_purpose(failures):
            if all(f.exitcode == EXIT_CODE for f in failures.values()):
                return None, EXIT_CODE  # every rank stopped after the same step; rank 0 logged where it saved
            killed = [f for f in failures.values() if f.exitcode < 0 and -f.exitcode in SIGNALS]
            if killed:
                name = signal_name(-killed[0].exitcode)
                return f"rapidlite: {name} before the training loop began: nothing to save (exit code {EXIT_CODE})", (
                    EXIT_CODE
                )
        text, code = self._cause(error)
        if self.signal:  # a rank failed while the group stopped (a collective's timeout): still a preemption
            cause = text.splitlines()[0].removeprefix("rapidlite: error: ")
            return (
                f"rapidlite: {signal_name(self.signal)}: not every rank stopped cleanly ({cause}); the last complete "
                f"checkpoint is kept (exit code {EXIT_CODE})"
            ), EXIT_CODE
        return text, code

    def _cause(self, error: Any) -> tuple[str, int]:
        """The first rank killed by a signal, else the first failure recorded."""
        signalled = {rank: code for rank, code in self.first_deaths.items() if code < 0}
        if signalled:
            rank = min(signalled)
            number = -signalled[rank]
            return (
                f"rapidlite: error: rank {rank} was killed by {signal_name(number)}, the first rank to end "
                f"(an out-of-memory kill looks like this); the other ranks were stopped",
                128 + number,
            )
        return _report(_first_failure(error))


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
        return f"rapidlite: error: rank {rank} was killed by {signal_name(-failure.exitcode)}", 128 - failure.exitcode
    return f"rapidlite: error: rank {rank} exited with code {failure.exitcode}", failure.exitcode or 1


def _first_failure(error: Any) -> Any:
    """The worker that failed first: rapidlite's records carry nanosecond times; others fall back on torch's."""
    failures = list(error.failures.values())
    recorded = [f for f in failures if (f.error_file_data or {}).get("rapidlite")]
    if recorded:
        return min(recorded, key=lambda f: f.error_file_data["rapidlite"]["time_ns"])
    with_file = [f for f in failures if f.error_file_data and f.error_file_data.get("message")]
    return min(with_file or failures, key=lambda f: f.timestamp)


AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default minus SIGTERM, which the supervisor handles


@contextlib.contextmanager
def _supervised(supervisor: _Supervisor, fork: bool) -> Iterator[None]:
    """torchrun's agent with the supervisor's hooks, and SIGTERM/SIGUSR1 handled by it (the agent would turn
    SIGTERM into a traceback after killing the workers 30 s later, and SIGUSR1 would end the launcher alone);
    with ``fork``, its workers forked from this process (``forked_workers``) instead of started anew."""
    import torch.distributed.elastic.multiprocessing.api as processes_api
    import torch.distributed.launcher.api as launcher_api

    agent_class = launcher_api.LocalElasticAgent
    handler_factory = processes_api.get_subprocess_handler
    if fork:
        processes_api.get_subprocess_handler = forked_workers.handler_factory()
    handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    previous = {sig: signal.signal(sig, supervisor.handle) for sig in SIGNALS}
    launcher_api.LocalElasticAgent = supervisor.agent_class()
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = agent_class
        processes_api.get_subprocess_handler = handler_factory
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if handled is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled


def launch(
    cfg: ParallelConfig, entry: str, argv: list[str], module: bool, warm: Callable[[], None] | None = None
) -> int:
    """Run ``entry argv`` (a module with ``module``, else a script path) as a torchrun worker group; return
    the exit code to end with. Prints the first failure as described in the module docstring; workers that
    stopped on SIGTERM/SIGUSR1 end it with ``preemption.EXIT_CODE``. Workers that are forked
    (``--start-method``) find imported what ``warm`` imports (the command line's: the engine, the task)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launch_args = torchrun_args(cfg)
    _threads_per_worker(nproc_per_node(cfg))
    _quiet_agent()
    fork = forked_workers.fork_workers(cfg.start_method)
    if fork:
        forked_workers.warm_imports()
        if warm is not None:
            warm()
    parsed = get_args_parser().parse_args([*launch_args, *(["-m"] if module else []), entry, *argv])
    parsed.signals_to_handle = AGENT_SIGNALS  # torch >= 2.7 passes this to the agent's environment
    supervisor = _Supervisor(grace=cfg.distributed_timeout_minutes * 60)
    try:
        with _supervised(supervisor, fork):
            run(parsed)
    except ChildFailedError as e:
        text, code = supervisor.report(e)
        sys.stdout.flush()
        if text is not None:
            print(text, file=sys.stderr, flush=True)
        return code
    return 0


def launch_or_join(
    cfg: ParallelConfig, entry: str, argv: list[str], module: bool, warm: Callable[[], None] | None = None
) -> int | None:
    """The launch decision. None: this process runs the training (it is a launched worker, or the job is one
    process). Otherwise this process was the launcher: it ran ``entry argv`` as the workers (``launch``) and
    the result is the exit code the process must end with."""
    if not needs_launch(cfg):
        return None
    return launch(cfg, entry, argv, module=module, warm=warm)


def launch_script_or_join(cfg: ParallelConfig) -> None:
    """``python my_trainer.py ... --nproc-per-node N``: the script becomes the launcher of its own workers and
    this process ends here with their exit code (``sys.exit``); in a worker, or on one process, it returns and
    the script runs.

    The workers run the script as ``rapidlite --user-script`` does (``cli.run_user_script``), which catches its
    ``sys.exit(code)``: run as ``python my_trainer.py``, a worker ends through the engine's exit handler
    (``distributed.shutdown``), which cannot see that code and ended with 0."""
    code = launch_or_join(cfg, "rapidlite", ["--user-script", sys.argv[0], *sys.argv[1:]], module=True)
    if code is not None:
        sys.exit(code)
