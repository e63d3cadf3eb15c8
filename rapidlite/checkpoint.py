"""Checkpoints: atomic save, resume from ``latest``, Hugging Face export.

Layout of ``--save DIR``::

    DIR/latest                 the iteration of the newest complete checkpoint, e.g. "200"
    DIR/iter_0000200/
        model.safetensors      weights (shared/tied tensors stored once)
        state.pt               optimizer, scheduler, loss scaler, RNG states, data position
    DIR/hf/                    final model (+ tokenizer) in Hugging Face format
    DIR/metrics.jsonl          one JSON object per logged iteration and per evaluation

A checkpoint is written under a hidden temporary name and renamed when complete; only then is
``latest`` replaced (itself through a temporary file and ``os.replace``). A crash mid-save leaves
``latest`` pointing at the previous good checkpoint. Loading uses safetensors and
``torch.load(weights_only=True)``: nothing is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from rapidlite.errors import CheckpointError

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
LATEST_FILE = "latest"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: keep it as a tensor.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_latest(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f".{LATEST_FILE}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST_FILE)


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


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model: torch.nn.Module, state: dict[str, Any]) -> Path:
    """Write ``DIR/iter_N`` atomically and point ``DIR/latest`` at it. ``state`` holds everything but the
    weights (optimizer, scheduler, scaler, RNG, data position), as tensors and plain containers."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in save_dir.glob(".tmp_iter_*"):  # left by an earlier crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    final = save_dir / checkpoint_name(iteration)
    tmp = save_dir / f".tmp_{final.name}_{os.getpid()}"
    tmp.mkdir()
    try:
        save_model(model, str(tmp / MODEL_FILE))
        torch.save(state, tmp / STATE_FILE)
        _fsync_dir(tmp)
        if final.exists():  # saving the same iteration again (e.g. final save after an interval save)
            old = save_dir / f".tmp_old_{final.name}_{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_latest(save_dir, iteration)
    return final


def latest_iteration(load_dir: str | os.PathLike) -> int:
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"--load {load_dir}: directory not found")
    latest = load_dir / LATEST_FILE
    if not latest.is_file():
        raise CheckpointError(
            f"--load {load_dir}: no '{LATEST_FILE}' file, so no complete checkpoint to resume "
            "(point --load at a --save directory of an earlier run)"
        )
    text = latest.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"--load {load_dir}: '{LATEST_FILE}' is corrupt (holds {text[:40]!r}, expected an iteration number)"
        )
    return int(text)


def load_checkpoint(
    load_dir: str | os.PathLike, model: torch.nn.Module, weights_only: bool = False
) -> tuple[int, dict[str, Any] | None]:
    """Load the weights of ``latest`` into ``model``; return (iteration, state) — state None if weights_only."""
    iteration = latest_iteration(load_dir)
    path = Path(load_dir) / checkpoint_name(iteration)
    model_file, state_file = path / MODEL_FILE, path / STATE_FILE
    for f in (model_file,) if weights_only else (model_file, state_file):
        if not f.is_file():
            raise CheckpointError(f"--load {load_dir}: checkpoint file {f} is missing")
    try:
        missing, unexpected = load_model(model, str(model_file), strict=False)
    except Exception as e:  # safetensors raises plain errors for truncated or mismatched files
        raise CheckpointError(f"--load {load_dir}: cannot read {model_file} ({_first_line(e)})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"--load {load_dir}: {model_file} does not match the model (missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); is it the same "
            "architecture?"
        )
    if weights_only:
        return iteration, None
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"--load {load_dir}: cannot read {state_file} ({_first_line(e)})") from None
    return iteration, state


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path | None:
    """Save a Hugging Face model (and tokenizer) with ``save_pretrained`` in safetensors, atomically.
    Returns None for models that are not Hugging Face models."""
    if not hasattr(model, "save_pretrained"):
        return None
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp_{out_dir.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    old = out_dir.with_name(f".tmp_old_{out_dir.name}_{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
