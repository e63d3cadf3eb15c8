"""Which checkpoint a run loads, and which ``--keep-last`` deletes.

Loading takes ``latest``'s checkpoint if it verifies (``rapidlite.checkpoint.integrity``). A checkpoint that
does not verify is named in one warning line and the newest older one that does is loaded; none: a one-line
error. ``latest`` missing, unreadable, or behind a complete newer checkpoint (one whose manifest was written after
``latest``: a save killed between the rename and ``latest``) gives way to the newest checkpoint that verifies. A
checkpoint without a manifest (an earlier version's) loads unverified, said once. ``--keep-last N``
(``prune_checkpoints``) deletes older checkpoints after a save, never the one just saved.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from rapidlite.checkpoint.integrity import verify_checkpoint
from rapidlite.checkpoint.layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    STATE_FILE,
    _all_gather,
    _iterations,
    _rank,
    _read_latest,
    _world,
    checkpoint_name,
)
from rapidlite.errors import CheckpointError
from rapidlite.observe.logging import LOGGER_NAME


def check_loadable(load_dir: str | os.PathLike) -> None:
    """That ``--load DIR`` holds something to resume (``latest`` or an ``iter_N`` directory); cheap, nothing is
    verified or read (``select_checkpoint`` does that when loading)."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"--load {load_dir}: directory not found")
    if _iterations(load_dir):
        return
    iteration, problem = _read_latest(load_dir)
    if iteration is not None:
        raise CheckpointError(
            f"--load {load_dir}: '{LATEST_FILE}' names iteration {iteration}, but its checkpoint directory "
            f"{checkpoint_name(iteration)} is missing (and there is no other)"
        )
    raise CheckpointError(
        f"--load {load_dir}: {problem} and no iter_* checkpoint, so nothing to resume "
        "(point --load at a --save directory of an earlier run, or at a Hugging Face model directory for a "
        "fine-tuning script that loads it with from_pretrained(args.load))"
    )


def _completed_at(path: Path) -> float:
    """When checkpoint ``path`` was completed: its manifest's time (``state.pt``'s for a checkpoint without one)."""
    for name in (MANIFEST_FILE, STATE_FILE):
        with contextlib.suppress(OSError):
            return (path / name).stat().st_mtime
    return 0.0


def select_checkpoint(load_dir: str | os.PathLike) -> tuple[int, Path]:
    """``(iteration, directory)`` of the checkpoint to resume from ``load_dir`` (a collective: every rank
    verifies its share of the files and the ranks agree).

    That is ``latest``'s if it verifies. Else, newest first, the first that verifies, with one warning line
    naming what was wrong and what is loaded instead: ``latest`` missing or corrupt, a checkpoint that does not
    verify, or ``latest`` behind a complete newer checkpoint written after it (a save killed before it could
    update ``latest``; a newer checkpoint older than ``latest`` is from a run that went back, and ignored).
    None verifies: a one-line ``CheckpointError``."""
    load_dir = Path(load_dir)
    check_loadable(load_dir)
    latest, latest_problem = _read_latest(load_dir)
    latest_time = 0.0
    if latest is not None:
        with contextlib.suppress(OSError):
            latest_time = (load_dir / LATEST_FILE).stat().st_mtime
    rank, world = _rank(), _world()
    damaged: list[tuple[str, str]] = []
    chosen: int | None = None
    for iteration in _iterations(load_dir):
        path = load_dir / checkpoint_name(iteration)
        if latest is not None and iteration > latest and not _completed_at(path) > latest_time:
            continue  # from before 'latest' was written: a run resumed from an older checkpoint went on
        problems = _all_gather(verify_checkpoint(path, rank, world))
        problem = next((p for p in problems if p), None)
        if problem is None:
            chosen = iteration
            break
        damaged.append((path.name, problem))
    if chosen is None:
        what = "; ".join(f"{name}: {problem}" for name, problem in damaged) or f"'{LATEST_FILE}' names none"
        raise CheckpointError(f"--load {load_dir}: no checkpoint verifies ({what}); nothing to resume from")
    path = load_dir / checkpoint_name(chosen)
    notes = []
    if latest is None:
        notes.append(latest_problem)
    elif chosen > latest:
        notes.append(f"'{LATEST_FILE}' names iteration {latest} but {path.name} was completed after it")
    elif chosen < latest and not any(name == checkpoint_name(latest) for name, _ in damaged):
        notes.append(f"'{LATEST_FILE}' names {checkpoint_name(latest)}, which is missing")
    if damaged:
        first, problem = damaged[0]
        more = f" (and {len(damaged) - 1} newer than it)" if len(damaged) > 1 else ""
        notes.append(f"checkpoint {first} is damaged: {problem}{more}")
    log = logging.getLogger(LOGGER_NAME)
    if notes and rank == 0:
        log.warning(f"--load {load_dir}: {'; '.join(notes)}: loading {path.name} instead")
    if not (path / MANIFEST_FILE).is_file() and rank == 0:
        log.warning(f"--load {load_dir}: {path.name} has no {MANIFEST_FILE} (an earlier version wrote it): unverified")
    return chosen, path


def prune_checkpoints(save_dir: str | os.PathLike, keep_last: int, saved: int) -> list[Path]:
    """``--keep-last N`` after ``iter_<saved>`` was written: delete the checkpoints older than it beyond the newest
    ``N`` (counting it), on rank 0. Newer ones (a run resumed from an older checkpoint) are left alone, and the
    one just saved is always kept, so the newest good checkpoint never goes. Returns the deleted directories."""
    if _rank() != 0 or keep_last < 1:
        return []
    save_dir = Path(save_dir)
    older = [i for i in _iterations(save_dir) if i < saved]  # newest first
    deleted = []
    for iteration in older[keep_last - 1 :]:
        path = save_dir / checkpoint_name(iteration)
        doomed = save_dir / f".tmp_prune_{path.name}"  # renamed first: never a half-deleted iter_N
        try:
            path.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted
