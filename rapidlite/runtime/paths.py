"""Directories a run writes to, checked before anything is written (``--save``, ``--tensorboard-dir``,
``rapidlite-preprocess --output-prefix``)."""

from __future__ import annotations

import os

from rapidlite.errors import ConfigError


def check_writable_dir(flag: str, path: str, purpose: str, given: str | None = None) -> None:
    """One line unless ``path`` is, or can be made as, a directory this process can write: not a file, and no
    file or unwritable directory on the way to it. ``given``: the flag's value when ``path`` is derived from it
    (the directory of ``rapidlite-preprocess --output-prefix``)."""
    shown = path if given is None else given
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        what = "" if given is None else f"{path} "
        raise ConfigError(f"{flag} {shown}: {what}is a file, not a directory; pass a directory for {purpose}")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {shown}: {existing} is a file, so no directory can be made under it; pass another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {shown}: {existing} is not writable; pass a directory you can write to")
