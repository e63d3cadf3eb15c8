"""The standard streams at a process's end: ``os._exit`` (a launched worker's, a forked one's, the command's own
fast exit, the save watchdog's) skips the interpreter's flush, so what was printed is flushed first."""

from __future__ import annotations

import sys


def flush_std_streams() -> None:
    """Flush stdout and stderr, ignoring a closed or broken stream."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
