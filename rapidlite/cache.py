"""Where rapidlite keeps what it builds once and reuses: ``$RAPIDLITE_CACHE``, else ``$XDG_CACHE_HOME/rapidlite``,
else ``~/.cache/rapidlite`` (embedded demo data, sample indices of read-only data, Inductor's kernels)."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("RAPIDLITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rapidlite"
    )
