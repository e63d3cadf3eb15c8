"""That a checkpoint is whole: its manifest (each file's size and CRC-32), its verification before loading, and
the one-line failure of a write the file system refused (a full disk).

A checkpoint is written under ``.tmp_iter_N`` and renamed when every rank has finished and the manifest is
complete; a failed write removes ``.tmp_iter_N`` and says why in one line (``_fail_save``). Loading verifies
before reading: every rank checks the sizes and the CRC-32 of its share of the files (``verify_checkpoint``;
``rapidlite.checkpoint.selection`` falls back to an older checkpoint that verifies).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

from rapidlite.checkpoint.layout import (
    DEEPSPEED_TAG,
    LATEST_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    STATE_FILE,
    _barrier,
    _rank,
    is_deepspeed_checkpoint,
)
from rapidlite.errors import CheckpointError

_CHUNK = 4 << 20


# The rank in the names of the files a rank writes: DCP's __R_N.distcp, rng_rankR.pt, DeepSpeed's zero_pp_rank_R_.
_RANK_IN_NAME = re.compile(r"^(?:__|rng_rank|zero_pp_rank_)(\d+)")


def _crc32(path: Path) -> int:
    # CRC-32 runs at about 2.5 GB/s per core (BLAKE2b at 0.6): enough to catch flipped bytes, scribbles and
    # truncation, which is what a manifest is for (not tampering).
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _checkpoint_files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory but its manifest, as sorted paths relative to it."""
    names = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return sorted(n for n in names if n != MANIFEST_FILE)


def _writer_rank(name: str, world: int) -> int:
    """The rank that wrote ``name`` (0 for the files no rank's number names): the one that hashes it."""
    found = _RANK_IN_NAME.match(name.rsplit("/", 1)[-1])
    return int(found.group(1)) % world if found else 0


def _hash_own_files(directory: Path, rank: int, world: int) -> dict[str, dict[str, int]]:
    return {
        name: {"size": (directory / name).stat().st_size, "crc32": _crc32(directory / name)}
        for name in _checkpoint_files(directory)
        if _writer_rank(name, world) == rank
    }


def _write_manifest(directory: Path, iteration: int, files: dict[str, dict[str, int]]) -> None:
    manifest = {"format": 1, "iteration": iteration, "checksum": "crc32", "files": dict(sorted(files.items()))}
    with open(directory / MANIFEST_FILE, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with checkpoint directory ``path`` (a missing file, a size or checksum that differs from its
    manifest's), or None. Sizes are checked on every rank; checksums of rank ``rank``'s share of the files
    (every ``world``-th), so the ranks together read each file once. Without a manifest only the files every
    checkpoint has are looked for."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        required = [STATE_FILE, DEEPSPEED_TAG if is_deepspeed_checkpoint(path) else METADATA_FILE]
        missing = [name for name in required if not (path / name).exists()]
        return f"{missing[0]} is missing" if missing else None
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {str(name): (int(e["size"]), int(e["crc32"])) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return f"its {MANIFEST_FILE} is unreadable"
    names = sorted(expected)
    for name in names:
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != expected[name][0]:
            return f"{name} has {size} bytes, {expected[name][0]} when saved"
    for name in names[rank::world]:
        try:
            if _crc32(path / name) != expected[name][1]:
                return f"{name} fails its checksum"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
    return None


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: its causes, and each rank's exception inside DCP's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException  # here: the package costs a launcher 0.8 s

    found: list[BaseException] = []
    stack: list[Any] = [error]
    while stack:
        e = stack.pop()
        if isinstance(e, tuple) and e and isinstance(e[0], BaseException):  # DCP's (exception, traceback)
            e = e[0]
        if not isinstance(e, BaseException) or any(e is seen for seen in found):
            continue
        found.append(e)
        if isinstance(e, CheckpointException):
            stack.extend(e.failures.values())
        stack.extend([e.__cause__, e.__context__])
    return found


DISK_FULL = "the disk is full (no space left on device)"


def _write_failure(error: BaseException, directory: Path) -> str | None:
    """Why writing into ``directory`` failed, in a few words, when the cause is the file system's (a full disk,
    a quota, permissions); None for anything else, which is a bug and keeps its traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    causes = _causes(error)
    os_errors = [e for e in causes if isinstance(e, OSError)]
    no_space = any(e.errno in (errno.ENOSPC, errno.EDQUOT) for e in os_errors) or any(
        "No space left" in str(e) for e in causes if not isinstance(e, CheckpointException)
    )
    if not no_space:
        # torch.save's C++ writer reports a full disk as "basic_ios::clear: iostream error", without its errno;
        # the partial files are still there, so the disk is still (nearly) full when this looks.
        with contextlib.suppress(OSError):
            no_space = shutil.disk_usage(directory).free < _CHUNK
    if no_space:
        return DISK_FULL
    if os_errors:
        e = os_errors[0]
        return f"{e.strerror or type(e).__name__}" + (f": {e.filename}" if e.filename else "")
    return None


def _fail_save(
    save_dir: Path, tmp: Path, iteration: int, reasons: list[str | None], local: BaseException | None
) -> None:
    """Every rank: remove the partial checkpoint, then raise the first rank's reason in one line."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    reason = first_failure(reasons)
    if local is not None and _write_failure(local, save_dir) is None:  # not the file system's doing: a bug
        if isinstance(local, Exception):
            raise local
        raise RuntimeError(str(local)) from local  # DCP's CheckpointException, which `except Exception` misses
    raise save_failed(save_dir, iteration, reason)


def first_failure(reasons: list[str | None]) -> str:
    """The lowest failed rank's reason (``reasons`` by rank), naming the rank when there are several."""
    rank, reason = next((rank, r) for rank, r in enumerate(reasons) if r)
    return f"rank {rank}: {reason}" if len(reasons) > 1 else reason


def save_failed(save_dir: Path, iteration: int, reason: str) -> CheckpointError:
    """The one line of a failed save, once its partial checkpoint is removed: why, and where ``latest`` points."""
    latest = save_dir / LATEST_FILE
    kept = f"'latest' still points at iteration {latest.read_text().strip()}" if latest.is_file() else "no 'latest'"
    fix = f"free space in {save_dir}" if DISK_FULL in reason else "fix that"
    return CheckpointError(
        f"--save {save_dir}: cannot write the checkpoint of iteration {iteration}: {reason}; the partial checkpoint "
        f"was removed and {kept} ({fix}, then resume with --load {save_dir})"
    )


def _first_line(e: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:  # its text is every rank's traceback
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
