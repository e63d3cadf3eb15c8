"""Where rapidlite keeps what it builds once and reuses: ``$RAPIDLITE_CACHE``, else ``$XDG_CACHE_HOME/rapidlite``,
else ``~/.cache/rapidlite`` (embedded demo data, sample indices of read-only data, Inductor's kernels)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from rapidlite.errors import RapidliteError

COMPLETE = "COMPLETE"  # written last into a directory build_once made: the directory is whole


def cache_root() -> str:
    return os.environ.get("RAPIDLITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rapidlite"
    )


class CacheError(RapidliteError):
    """The cache directory cannot be made or written."""


def make_cache_dir(path: str | os.PathLike) -> Path:
    """``path`` (under the cache) made if missing, or one line naming it and ``RAPIDLITE_CACHE``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise CacheError(
            f"cannot write the cache directory {path} ({e.strerror or type(e).__name__}): set RAPIDLITE_CACHE to a "
            "directory you can write to"
        ) from None
    return path


def cache_scratch(parent: Path) -> Path:
    """A new scratch directory in ``parent`` (made if missing), or one line as ``make_cache_dir`` says."""
    make_cache_dir(parent)
    try:
        return Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    except OSError as e:
        raise CacheError(
            f"cannot write the cache directory {parent} ({e.strerror or type(e).__name__}): set RAPIDLITE_CACHE to "
            "a directory you can write to"
        ) from None


def build_once(final: str | os.PathLike, build: Callable[[Path], None], key: str = "ok\n") -> Path:
    """``final``, built once: ``build(scratch)`` fills a scratch directory beside it, which is marked complete
    (the marker holds ``key``, what the build depends on) and put in place by one atomic rename. Safe when several
    ranks build at once (the first rename wins and the others' results are as good); an incomplete directory left
    by a crash, or one built for another ``key``, is built again."""
    final = Path(final)
    if _built(final, key):
        return final
    scratch = cache_scratch(final.parent)
    try:
        build(scratch)
        (scratch / COMPLETE).write_text(key)
        if final.exists() and not _built(final, key):  # an earlier attempt that did not finish, or another key
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(scratch, final)
        except OSError:  # a concurrent builder's rename came first
            pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def _built(final: Path, key: str) -> bool:
    try:
        return (final / COMPLETE).read_text() == key
    except OSError:
        return False
