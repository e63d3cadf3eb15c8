"""Progress bars (tqdm) for training, evaluation and data preparation, on the main process's terminal only.

A bar is drawn when the process is allowed to (the main process, no ``--no-progress``, no ``RAPIDLITE_NO_PROGRESS``
in the environment) and standard error is an interactive terminal. Anywhere else (a log file, a pipe, a batch
job, the other ranks) nothing is drawn and the log lines are the record, unchanged. While a bar is open, the
console log handler writes through ``tqdm.write`` (``rapidlite.observe.logging``), so log lines appear above the bar
instead of tearing it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from rapidlite.runtime.environ import env_switch

ENV_VAR = "RAPIDLITE_NO_PROGRESS"


def progress_allowed(enabled: bool = True) -> bool:
    """Whether bars may be drawn: ``enabled`` (main process, no ``--no-progress``), no ``RAPIDLITE_NO_PROGRESS``
    and standard error on a terminal."""
    if not enabled or env_switch(ENV_VAR):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


_open_bars: set[Bar] = set()


class Bar(tqdm):
    """A tqdm bar that the console log handler knows is open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _open_bars.add(self)

    def close(self) -> None:
        _open_bars.discard(self)
        super().close()


def bars_open() -> bool:
    """Whether a bar is on the terminal now (log lines must then be written above it)."""
    return bool(_open_bars)


def close_bars() -> None:
    """Close every open bar (before an error line, so it starts on a line of its own)."""
    for bar in list(_open_bars):
        bar.close()


def write_above(line: str, file: Any) -> None:
    """Write one line to ``file`` without tearing the open bars."""
    tqdm.write(line, file=file)
    file.flush()


def progress_bar(
    total: int | None,
    *,
    desc: str | None = None,
    initial: int = 0,
    unit: str = "it",
    leave: bool = True,
    enabled: bool = True,
    bytes_: bool = False,
) -> Bar | None:
    """A bar with rate and ETA when ``progress_allowed(enabled)``, else None. ``bytes_``: ``total`` and the
    updates count bytes (shown as kB/MB/GB and B/s)."""
    if not progress_allowed(enabled):
        return None
    scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if bytes_ else {"unit": unit}
    return Bar(total=total, initial=initial, desc=desc, leave=leave, dynamic_ncols=True, file=sys.stderr, **scale)


@contextlib.contextmanager
def hf_datasets_progress(enabled: bool) -> Iterator[None]:
    """Hugging Face ``datasets``' own bars (reading files, ``map``) follow rapidlite's rule inside the block: hidden
    unless ``progress_allowed(enabled)`` (and unless the user turned them off in ``datasets``); the library's
    setting is restored after."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    if not progress_allowed(enabled):
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def hf_transformers_progress(enabled: bool) -> Iterator[None]:
    """The same for ``transformers``' bars (loading weights) when the process has imported it (never imported
    here: a script that does not use it does not pay for it)."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress_allowed(enabled):
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
