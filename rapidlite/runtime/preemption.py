"""Stopping on a scheduler's signal without losing work.

SIGTERM (what Slurm and Kubernetes send before they kill a job) and SIGUSR1 (Slurm's ``--signal``) only set a
flag while a trainer's loop runs (``StopSignals``). At the end of each optimizer step the ranks agree on it (one
all-reduce of an int, only when distributed), so every rank stops after the same iteration; the trainer saves a
checkpoint (with ``--save``), logs one line and the process ends with ``EXIT_CODE``.

``EXIT_CODE`` is 143, 128 + SIGTERM: what a shell, Kubernetes and Slurm already report for a process ended by
SIGTERM, so a scheduler's policy for "terminated from outside, run it again" applies unchanged (Kubeflow's
``ExitCode`` restart policy retries 128-255; a Slurm batch script requeues on it). Exit 0 would be wrong: Slurm
would mark the job COMPLETED and a Kubernetes Job would count it as succeeded, ending the run half-way. One code
for both signals, so a script tests one number; it also means "resume with the same command" when the process
died of the signal before the loop began (nothing new to save then).
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the launcher imports this module: flag errors and --help stay free of torch
    import torch

EXIT_CODE = 143
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised to end a process that has no process group after it stopped on a signal (exit code 143)."""

    def __init__(self) -> None:
        super().__init__(EXIT_CODE)


class StopSignals:
    """Flag-only handlers for SIGTERM and SIGUSR1 while installed; ``agreed`` is the signal any rank received."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; elsewhere the defaults stay
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def agreed(self, device: torch.device) -> int:
        """The signal number any rank of the job received (0: none), the same on every rank (a collective)."""
        return max_over_ranks(self.received, device)


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of ``value`` over every rank of the job (all of them: tensor and pipeline ranks too), the
    same on every rank; ``value`` itself without a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    # int32 is supported by NCCL reductions, unlike bool.
    flag = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_preempted() -> NoReturn:
    """End the process with ``EXIT_CODE``: through the clean teardown when a process group is up (a worker, or
    ZeRO on one process), else by raising ``Preempted`` (``rapidlite --task``/``--user-script`` and
    ``python script.py`` all end with its code)."""
    from rapidlite.runtime.distributed import shutdown

    shutdown(EXIT_CODE)
    raise Preempted()


class Watch:
    """``RapidliteEngine.preemption()``'s handle for a loop of one's own: ``stop()`` at the end of each step (every
    rank calls it: a collective) says whether any rank received SIGTERM or SIGUSR1; ``signum`` is that signal."""

    def __init__(self, device: torch.device) -> None:
        self.signals, self.device, self.signum = StopSignals(), device, 0

    def stop(self) -> bool:
        self.signum = self.signals.agreed(self.device)
        return bool(self.signum)
