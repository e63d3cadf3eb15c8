"""Where a checkpoint's files are: the directory names, the ``latest`` pointer, the ``iter_N`` directories.

Layout of ``--save DIR``::

    DIR/latest                 the iteration of the newest complete checkpoint, e.g. "200"
    DIR/iter_0000200/
        .metadata, __*_*.distcp   DCP: every rank writes its shards of ``model.<name>`` and
                                  ``optim.<name>.<state>`` tensors; the metadata goes last
        state.pt               trainer position, LR schedule, loss scaler, skipped steps (rank 0)
        config.yaml            the run's settings, loadable with --config (rank 0; rapidlite.config.files)
        rng_rank<R>.pt         each rank's RNG states
        manifest.json          every file above: its size and CRC-32 (each rank hashes the files it wrote)
    DIR/iter_0000200/deepspeed/   instead of the DCP files under --deepspeed: DeepSpeed's own checkpoint
                                  (``engine.save_checkpoint``; ZeRO partitions of the optimizer state)
    DIR/hf/                    final model (+ tokenizer) in Hugging Face format, gathered on rank 0
    DIR/metrics.jsonl          one JSON object per logged iteration and per evaluation

``latest`` is replaced through a temporary file and ``os.replace``, so it always names a complete checkpoint or
the one before it. The process-group helpers here let the sibling modules run with or without one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rapidlite.errors import CheckpointError
from rapidlite.observe.trackers.tensorboard import DIR_UNDER_SAVE as TB_DIR

STATE_FILE = "state.pt"


LATEST_FILE = "latest"


METADATA_FILE = ".metadata"


MANIFEST_FILE = "manifest.json"


MODEL, OPTIM = "model.", "optim."


DEEPSPEED_TAG = "deepspeed"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a collective; ``[obj]`` on one process)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _write_latest(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f".{LATEST_FILE}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, save_dir / LATEST_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_latest(load_dir: Path) -> tuple[int | None, str | None]:
    """``(iteration, None)``, or ``(None, what is wrong with 'latest')``."""
    latest = load_dir / LATEST_FILE
    if not latest.is_file():
        return None, f"no '{LATEST_FILE}' file"
    try:
        text = latest.read_text(errors="replace").strip()
    except OSError as e:
        return None, f"'{LATEST_FILE}' cannot be read ({e.strerror})"
    if not text.isdigit():
        return None, f"'{LATEST_FILE}' is corrupt (holds {text[:40]!r}, expected an iteration number)"
    return int(text), None


def latest_iteration(load_dir: str | os.PathLike) -> int:
    """The iteration ``DIR/latest`` names, as written (``select_checkpoint`` is what loading uses)."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"--load {load_dir}: directory not found")
    iteration, problem = _read_latest(load_dir)
    if iteration is None:
        raise CheckpointError(f"--load {load_dir}: {problem}")
    return iteration


def _iterations(directory: Path) -> list[int]:
    """The iterations of the ``iter_N`` checkpoint directories in ``directory``, newest first."""
    found = (re.fullmatch(r"iter_(\d+)", p.name) for p in directory.glob("iter_*") if p.is_dir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def checkpoint_path(load_dir: str | os.PathLike) -> Path:
    """The directory ``DIR/latest`` points at, unverified (``select_checkpoint`` verifies and falls back)."""
    return Path(load_dir) / checkpoint_name(latest_iteration(load_dir))


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / DEEPSPEED_TAG).is_dir()


def is_pretrained_model_dir(load_dir: str | os.PathLike) -> bool:
    """A directory holding a Hugging Face model (``config.json``) and no rapidlite checkpoint: what
    Rapidformer's page passes as ``--load`` to load with ``from_pretrained(args.load)``."""
    load_dir = Path(load_dir)
    return (
        (load_dir / "config.json").is_file()
        and not (load_dir / LATEST_FILE).exists()
        and not any(load_dir.glob("iter_*"))
    )


def clear_run(save_dir: str | os.PathLike) -> str:
    """Remove a run's checkpoints, tracker, export, metrics, their curves and the TensorBoard events that
    ``--report-to tensorboard`` writes under it from ``save_dir`` (``--overwrite``); other files stay. Returns what
    was removed, for the log."""
    save_dir = Path(save_dir)
    removed = []
    for path in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        name = path.name
        if name.startswith(("iter_", ".tmp_")) or name in (LATEST_FILE, "hf", "metrics.jsonl", "curves.png", TB_DIR):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(name)
    _fsync_dir(save_dir)
    return ", ".join(removed) or "nothing"
