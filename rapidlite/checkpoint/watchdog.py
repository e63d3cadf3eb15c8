"""A rank that fails inside a backend's checkpoint write must not leave the others waiting for it.

DeepSpeed's ``save_checkpoint`` runs collectives of its own between its file writes. A rank whose write raises
(a full disk) leaves them and goes on to the save's error exchange, while the others still wait in DeepSpeed's:
the collectives no longer pair up and every rank waits until the process group times out (10 minutes by
default), then ends with a traceback. So each rank records its failure as a file in the checkpoint's
temporary directory (``failed_rank<R>``, holding its one-line reason; the shared file system every rank writes
the checkpoint to), and a watchdog thread on every rank, running for the duration of the save, ends a rank
still inside the save ``grace_seconds`` after a failure was recorded: the partial checkpoint removed, one line
naming the failed rank and its reason, exit code 2 (as any failed save). Only a recorded failure starts the
clock: a slow healthy save is never ended. When the collectives do pair up, the save's own one-line error
ends it first and the watchdog stops with the save.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

from rapidlite.checkpoint.integrity import _write_failure, save_failed
from rapidlite.errors import RapidliteError
from rapidlite.runtime.streams import flush_std_streams

MARKER = "failed_rank"
POLL_SECONDS = 1.0
GRACE_SECONDS = 60.0


def record_failure(tmp: Path, rank: int, reason: str) -> None:
    """Leave ``tmp/failed_rank<R>`` holding ``reason``. On a full disk the text may not fit: the empty file (an
    inode, no data block) still says that the rank failed."""
    with contextlib.suppress(OSError), open(tmp / f"{MARKER}{rank}", "w") as f:
        f.write(reason)


def recorded_failure(tmp: Path) -> tuple[int, str] | None:
    """The lowest rank that recorded a failure in ``tmp``, and its reason; None when none did."""
    found = sorted((int(m.group(1)), p) for p in tmp.glob(f"{MARKER}*") if (m := re.fullmatch(r"\D+(\d+)", p.name)))
    if not found:
        return None
    rank, path = found[0]
    try:
        reason = path.read_text().strip()
    except OSError:
        reason = ""
    return rank, reason or "its checkpoint write failed"


def grace_seconds() -> float:
    """How long the ranks may take to end the save together once a failure is recorded: 60 s, or half the
    process group's timeout (``--distributed-timeout-minutes``) when that is shorter, so the watchdog acts before
    the process group's own timeout turns the hang into a traceback."""
    from rapidlite.runtime.distributed import collective_timeout

    timeout = collective_timeout()
    return GRACE_SECONDS if timeout is None else min(GRACE_SECONDS, timeout.total_seconds() / 2)


def _end_rank(error: BaseException) -> None:
    """End this process from the watchdog thread: recorded for the launcher (under torchrun) or printed, then
    ``os._exit``, since the main thread is blocked in a collective that will not return."""
    from rapidlite.runtime.distributed import report_worker_error

    code = report_worker_error(error)
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):  # no torchrun agent to print it (srun's own tasks)
        sys.stdout.flush()
        if isinstance(error, RapidliteError):
            print(f"rapidlite: error: {error}", file=sys.stderr, flush=True)
        else:
            traceback.print_exception(error)
    flush_std_streams()
    os._exit(code)


class SaveWatchdog:
    """The watchdog of one save (the module docstring): ``with SaveWatchdog(...) as watchdog:`` around the save,
    ``watchdog.record(error, reason)`` where this rank's write failed. Does nothing on one rank."""

    def __init__(self, save_dir: Path, tmp: Path, iteration: int, rank: int, world: int) -> None:
        self.save_dir, self.tmp, self.iteration, self.rank, self.world = save_dir, tmp, iteration, rank, world
        self.local: BaseException | None = None  # this rank's own failure, a bug's traceback kept for the launcher
        self._done = threading.Event()

    def record(self, error: BaseException, reason: str) -> None:
        self.local = error
        if self.world > 1:
            record_failure(self.tmp, self.rank, reason)

    def __enter__(self) -> SaveWatchdog:
        if self.world > 1:
            threading.Thread(target=self._watch, name="rapidlite-save-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        grace, failed, seen = grace_seconds(), None, 0.0
        while not self._done.wait(POLL_SECONDS):
            if failed is None:  # kept once seen: rank 0 may remove the directory before the others give up
                failed = recorded_failure(self.tmp) if self.tmp.is_dir() else None
                seen = time.monotonic()
            # Another rank waits a little longer, so the failed rank's own record is the one the launcher prints.
            wait = grace if failed is None or failed[0] == self.rank else grace + 2 * POLL_SECONDS
            if failed is None or time.monotonic() - seen < wait or self._done.is_set():
                continue
            shutil.rmtree(self.tmp, ignore_errors=True)
            rank, reason = failed
            if rank == self.rank and self.local is not None and _write_failure(self.local, self.save_dir) is None:
                _end_rank(self.local)  # not the file system's doing: a bug, with its traceback
            reason = f"rank {rank}: {reason}; the ranks still inside the save were stopped {grace:.0f} s later"
            _end_rank(save_failed(self.save_dir, self.iteration, reason))
