"""Logger, timers, throughput, and ``metrics.jsonl`` (which feeds the trackers)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rapidlite.observe.progress import bars_open, write_above

LOGGER_NAME = "rapidlite"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record is logged: a notebook or a test harness that replaces
    it after the logger was set up still gets the log (and a closed earlier stream is never written to)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not bars_open():
            super().emit(record)
            return
        try:
            write_above(self.format(record), self.stream)  # above the progress bar, which is redrawn below
        except Exception:
            self.handleError(record)


def setup_logger(rank: int = 0, log_file: str | None = None) -> logging.Logger:
    """Rank 0 logs to the console at INFO, other ranks only warnings, so N ranks do not print N copies.
    ``log_file``: this rank also writes its INFO log there (``--per-rank-logs``)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.propagate = False
    console = next((h for h in logger.handlers if getattr(h, "rapidlite", "") == "console"), None)
    if console is None:
        console = _StdoutHandler()
        console.rapidlite = "console"
        logger.addHandler(console)
    console.setFormatter(
        logging.Formatter("[rapidlite] %(message)s" if rank == 0 else f"[rapidlite rank {rank}] %(message)s")
    )
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for handler in [h for h in logger.handlers if getattr(h, "rapidlite", "") == "file"]:
        logger.removeHandler(handler)
        handler.close()
    if log_file is not None:
        file_handler = _RankLog(log_file)
        file_handler.rapidlite = "file"
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        file_handler.setLevel(logging.INFO)
        logger.addHandler(file_handler)
    logger.setLevel(logging.INFO)
    return logger


class _RankLog(logging.FileHandler):
    """``--per-rank-logs``' file, made with its first record (its directories too): a run refused before it
    logs leaves nothing; ``discard_rank_log`` removes what a refused run made."""

    def __init__(self, path: str) -> None:
        self.existed = os.path.exists(path)
        # The directories this run would make (logs/, and the --save directory itself): removed again if empty.
        self.made = [d for d in (Path(path).parent, Path(path).parent.parent) if not d.exists()]
        super().__init__(path, delay=True)

    def _open(self):  # noqa: ANN202 - logging's own signature
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def discard_rank_log() -> None:
    """A refused run (exit 2): its rank log and the directories made for it go (an earlier run's log stays)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if isinstance(h, _RankLog)]:
        logger.removeHandler(handler)
        handler.close()
        if not handler.existed and os.path.exists(handler.baseFilename):
            os.remove(handler.baseFilename)
        for directory in handler.made:
            with contextlib.suppress(OSError):  # not empty (another rank's log, a checkpoint): it stays
                directory.rmdir()


class Timer:
    def __init__(self) -> None:
        self.elapsed_s = 0.0
        self._start: float | None = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        dt = time.perf_counter() - self._start
        self.elapsed_s += dt
        self._start = None
        return dt

    def elapsed(self, reset: bool = True) -> float:
        value = self.elapsed_s
        if reset:
            self.elapsed_s = 0.0
        return value


class Timers:
    """Named wall-clock timers, Megatron style: ``timers("forward-backward").start()``."""

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        return self._timers.setdefault(name, Timer())

    def names(self) -> list[str]:
        return list(self._timers)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory on CUDA; elsewhere the peak of this process's own memory (``process_memory``), which
    is what a CPU plan predicts."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return process_memory()["peak"]


def process_memory() -> dict[str, int]:
    """This process's memory in bytes (Linux: ``/proc/self/status``): ``own`` is what it holds now and ``peak``
    its high-water mark, both without the libraries' file-backed pages; ``files`` is those pages now.

    File-backed pages are the libraries' code and data mapped from disk. They belong to the page cache: every
    process mapping them shares them, the kernel takes them back under memory pressure, and how many a process
    holds depends on what the cache held when it mapped them (a forked rank held about 128 MiB right after the
    install, 52-80 MiB where the files had been partly evicted). Anonymous and shared-memory pages (tensors, the
    heap, the interpreter's objects) are what fills a machine, so ``own`` counts those. The kernel keeps a
    high-water mark of the whole resident set only (``VmHWM``); ``peak`` subtracts the file-backed pages mapped
    now, which after a run's first step are the ones mapped at its peak (a process maps its code as it first runs
    it, and keeps it). ``getrusage``'s ``ru_maxrss`` is the fallback elsewhere: it carries the launching
    process's resident size over ``fork`` and ``exec``, which is why Linux reads its own."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if len(fields) < 4:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = rss if sys.platform == "darwin" else rss * 1024
        return {"own": rss, "peak": rss, "files": 0}
    own = fields["RssAnon"] + fields["RssShmem"]
    # Held as a running maximum, this process's own: a page of code mapped later would lower the difference.
    _own_peak[os.getpid()] = peak = max(_own_peak.get(os.getpid(), 0), own, fields["VmHWM"] - fields["RssFile"])
    return {"own": own, "peak": peak, "files": fields["RssFile"]}


_own_peak: dict[int, int] = {}  # by process: a forked child starts from its own high-water mark, not its parent's


def _json_safe(value: Any) -> Any:
    """Valid JSON for a record: NaN and inf (which ``json`` writes as bare NaN/Infinity) become null."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if getattr(value, "shape", None) in ((), (1,)) and hasattr(value, "item"):  # torch/numpy scalars
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


class MetricsWriter:
    """Appends records to ``DIR/metrics.jsonl``, the record of truth, then hands each to the run's trackers
    (``trackers``: a started ``rapidlite.observe.trackers.Trackers``, which ``close`` finishes). Rank 0 only.

    The file is opened with the first record: a run refused before it has one (at its first step, say) leaves no
    empty ``metrics.jsonl`` in a new --save directory, which would make the corrected command "another run's"
    directory (TensorBoard's writer waits for the first record the same way)."""

    def __init__(
        self,
        save_dir: str | None,
        trackers: Any = None,
        run_id: str | None = None,
        before_first: Callable[[], None] | None = None,
    ) -> None:
        self._file = None
        self.run_id = run_id  # on every record: two runs' lines in one file stay apart
        self.trackers = trackers
        self._save_dir = save_dir
        self._before_first = before_first  # --overwrite's removal of the earlier run: at the first record

    def _open(self) -> None:
        if self._before_first is not None:
            self._before_first, before = None, self._before_first
            before()
        if self._save_dir is not None:
            Path(self._save_dir).mkdir(parents=True, exist_ok=True)
            # Unbuffered: a record is written whole or, when the write fails, cut away (see _append).
            self._file = open(Path(self._save_dir) / "metrics.jsonl", "ab", buffering=0)
        self._save_dir = None

    def write(self, record: dict[str, Any], tb_prefix: str = "train") -> None:
        """``tb_prefix``: the trackers' name for the record's kind (``train/loss``, ``validation/accuracy``)."""
        self._open()
        if self._file is not None:
            line = _json_safe({**record, "run_id": self.run_id} if self.run_id else record)
            self._append((json.dumps(line, allow_nan=False) + "\n").encode())
        if self.trackers:
            self.trackers.log(record, tb_prefix)

    def _append(self, data: bytes) -> None:
        """One whole line at the end of ``metrics.jsonl``; a write the file system refuses (a full disk) cuts the
        file back to its last complete line and stops the run in one line (a reader never sees half a record)."""
        from rapidlite.errors import OutputError

        fd = self._file.fileno()
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # a raw write may take only part of the line
                view = view[self._file.write(view) :]
        except OSError as e:
            os.ftruncate(fd, end)
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            reason = "the disk is full (no space left on device)" if full else (e.strerror or type(e).__name__)
            path = self._file.name
            self._file.close()
            self._file = None
            raise OutputError(
                f"{path}: cannot write a metrics record: {reason}; the file ends at its last complete record "
                f"(free space in {os.path.dirname(path) or '.'}, then resume with --load)"
            ) from None

    def close(self) -> None:
        """Close ``metrics.jsonl`` (idempotent); nothing opens after the end. The trackers stay open: the monitor
        stores the finished run's files with them, then finishes them."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._save_dir = None


def format_record(record: dict[str, Any]) -> str:
    parts = []
    for key, value in record.items():
        if value is None:
            continue
        if isinstance(value, float):
            text = f"{value:.4e}" if key in ("lr", "loss_scale") or abs(value) < 1e-3 else f"{value:.4f}"
            if key.endswith("_per_s"):
                text = f"{value:.1f}"
        else:
            text = str(value)
        parts.append(f"{key}: {text}")
    return " | ".join(parts)
