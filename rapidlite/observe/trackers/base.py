"""The tracker interface behind ``metrics.jsonl``, and the group that feeds the trackers a run reports to.

``metrics.jsonl`` is the record of truth: ``MetricsWriter`` (``rapidlite.observe.logging``) appends each record
there first, then hands it to the ``Trackers`` of the run. A tracker is started once with the resolved settings
(and, when the run resumes a checkpoint, the id its run had), logs each record's finite numbers against the
iteration, may store files (``curves.png``, ``metrics.jsonl``), and is finished with the process's exit code.
Only the main process tracks. A tracker that cannot start is one line (``TrackingError``, exit 2: the user asked
for it); one that fails later is a warning, never a crashed run.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from rapidlite.config.runtime import LoggingConfig
from rapidlite.errors import ConfigError, first_line

STEP = "iteration"  # every tracker charts a record against it (a resumed run logs its iterations again)


class TrackingError(ConfigError):
    """A tracker that cannot start (not installed, not logged in, unreachable, refused)."""


class Tracker(ABC):
    """One tracker's run. A subclass names itself (``name``: its ``--report-to`` name) and implements ``start``,
    ``log`` and ``finish``; ``log_file`` is for trackers that store files. ``id``: its run's id once started (a
    checkpoint keeps it as ``<name>_run_id``, so the resumed run continues the same run); None where the tracker
    has no run to continue (TensorBoard appends to its directory)."""

    name: ClassVar[str]

    def __init__(self, cfg: LoggingConfig) -> None:
        self.cfg = cfg
        self.id: str | None = None

    @abstractmethod
    def start(self, settings: Mapping[str, Any], resume_id: str | None) -> str:
        """Open the run; ``settings``: every resolved setting as plain values; ``resume_id``: the run a resumed
        checkpoint kept (None: a new run). Returns one line for the log (where the run is). Raises
        ``TrackingError`` when the tracker cannot start."""

    @abstractmethod
    def log(self, record: Mapping[str, Any], prefix: str) -> None:
        """One metrics record (``numbers(record, prefix)``: its finite numbers as ``prefix/name``) at its
        iteration."""

    def log_file(self, path: str) -> None:  # noqa: B027 - a tracker without file storage keeps nothing
        """Store the file at ``path`` with the run (the default: trackers that keep only numbers ignore it)."""

    def log_table(self, name: str, rows: list[Mapping[str, Any]], step: int) -> None:  # noqa: B027
        """A table of ``rows`` (one dict each, the same keys) at ``step`` (the default: trackers without tables
        keep nothing; the run directory has the rows as JSON lines)."""

    @abstractmethod
    def finish(self, exit_code: int, preempted: bool) -> None:
        """End the run with the process's outcome (``preempted``: stopped by SIGTERM/SIGUSR1, exit code 143)."""


def numbers(record: Mapping[str, Any], prefix: str) -> dict[str, float | int]:
    """A record's finite numbers (not the iteration, not booleans) under ``prefix/name``."""
    return {
        f"{prefix}/{key}": value
        for key, value in record.items()
        if key != STEP and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


class Trackers:
    """The trackers a run reports to, fed in order; a failure after the start is one warning per tracker (and a
    count at the end), never the run's end."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers = list(trackers)
        self._failures: dict[str, int] = {}
        self._logger = logging.getLogger("rapidlite")

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def start(self, settings: Mapping[str, Any], resume_ids: Mapping[str, str]) -> None:
        """Start each tracker (a ``TrackingError`` ends the run before training: the user asked for it), logging
        where its run is."""
        for tracker in self.trackers:
            self._logger.info(tracker.start(settings, resume_ids.get(tracker.name)))

    def ids(self) -> dict[str, str]:
        """``<name>_run_id`` of each started tracker that has a run to continue (what a checkpoint keeps)."""
        return {f"{t.name}_run_id": t.id for t in self.trackers if t.id is not None}

    def log(self, record: Mapping[str, Any], prefix: str) -> None:
        for tracker in self.trackers:
            self._shielded(tracker, "log a record", tracker.log, record, prefix)

    def log_file(self, path: str) -> None:
        for tracker in self.trackers:
            self._shielded(tracker, f"store {path}", tracker.log_file, path)

    def log_table(self, name: str, rows: list[Mapping[str, Any]], step: int) -> None:
        for tracker in self.trackers:
            self._shielded(tracker, f"log the table {name}", tracker.log_table, name, rows, step)

    def finish(self, exit_code: int = 0, preempted: bool = False) -> None:
        """Finish every tracker once (idempotent)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            self._shielded(tracker, "finish its run", tracker.finish, exit_code, preempted)
            failed = self._failures.get(tracker.name, 0)
            if failed > 1:
                self._logger.warning(
                    f"{tracker.name}: {failed} calls failed in this run (metrics.jsonl has every record)"
                )

    def _shielded(self, tracker: Tracker, what: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as e:  # a tracker's trouble (a network, a full quota) is not the run's
            count = self._failures[tracker.name] = self._failures.get(tracker.name, 0) + 1
            if count == 1:
                self._logger.warning(
                    f"{tracker.name}: could not {what} ({first_line(e)}); training goes on, metrics.jsonl has every "
                    "record"
                )
