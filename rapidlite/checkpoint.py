"""Checkpoints: sharded save with ``torch.distributed.checkpoint`` (DCP), atomic, resumable under any layout.

Layout of ``--save DIR``::

    DIR/latest                 the iteration of the newest complete checkpoint, e.g. "200"
    DIR/iter_0000200/
        .metadata, __*_*.distcp   DCP: every rank writes its shards of ``model.<name>`` and
                                  ``optim.<name>.<state>`` tensors; the metadata goes last
        state.pt               trainer position, LR schedule, loss scaler, skipped steps (rank 0)
        config.yaml            the run's settings, loadable with --config (rank 0; rapidlite.config_file)
        rng_rank<R>.pt         each rank's RNG states
        manifest.json          every file above: its size and CRC-32 (each rank hashes the files it wrote)
    DIR/iter_0000200/deepspeed/   instead of the DCP files under --deepspeed: DeepSpeed's own checkpoint
                                  (``engine.save_checkpoint``; ZeRO partitions of the optimizer state)
    DIR/hf/                    final model (+ tokenizer) in Hugging Face format, gathered on rank 0
    DIR/metrics.jsonl          one JSON object per logged iteration and per evaluation

Tensors are keyed by parameter name, not by rank, so a checkpoint saved by 2 ranks under ZeRO-3 loads on 1
rank without ZeRO and the reverse: DCP reads each rank's slice of every tensor from whichever files hold
it. Only tensors go through DCP; optimizer hyperparameters come from the resumed run's flags.

A checkpoint is written under ``.tmp_iter_N`` and renamed when every rank has finished and the manifest is
complete; only then is ``latest`` replaced (through a temporary file and ``os.replace``). A crash mid-save
leaves ``latest`` at the previous good checkpoint; a failed write (a full disk) removes ``.tmp_iter_N`` and
says why in one line.

Loading verifies before reading (``select_checkpoint``): every rank checks the sizes and the CRC-32 of its
share of the files. A checkpoint that does not verify is named in one warning line and the newest older one
that does is loaded; none: a one-line error. ``latest`` missing, unreadable, or behind a complete newer
checkpoint (one whose manifest was written after ``latest``: a save killed between the rename and ``latest``)
gives way to the newest checkpoint that verifies. A checkpoint without a manifest (an earlier version's)
loads unverified, said once. ``--keep-last N`` (``prune_checkpoints``) deletes older checkpoints after a
save, never the one just saved.

A DeepSpeed checkpoint resumes under DeepSpeed (same layout); its weights (consolidated by DeepSpeed's
``zero_to_fp32``) also load without DeepSpeed, and a DCP checkpoint's weights load under DeepSpeed:
across backends the optimizer state does not carry over (``--no-load-optim``).

Loading a DCP checkpoint unpickles nothing but tensors and plain containers: ``torch.load(weights_only=True)``
for the side files and a restricted unpickler for DCP's metadata. DeepSpeed's files are read by DeepSpeed,
which unpickles them in full: load only DeepSpeed checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rapidlite.errors import CheckpointError
from rapidlite.logging import LOGGER_NAME

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


@contextlib.contextmanager
def _one_process_is_fine():
    # DCP warns on every call without a process group, which is how one process runs here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


# ------------------------------------------------------------------------------------------ RNG
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


# ------------------------------------------------------------------------------ tensor state dicts
def _zero1_local(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer over this rank's share of the parameters, for ZeRO-1's sharded optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def _materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (zeros, step 1) with a step at lr 0, so loading has shapes to fill."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params or all(p in optimizer.state for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _optimizer_tensors(model: torch.nn.Module, optimizer: Any, materialize: bool) -> dict[str, Any]:
    """``{name: {state_key: tensor}}`` for the parameters whose state lives on this rank."""
    local = _zero1_local(optimizer)
    if local is None:
        return get_optimizer_state_dict(model, optimizer)["state"]
    if materialize:
        _materialize_state(local)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in local.state.items()}


def _flatten(model_sd: dict[str, Any], optim_state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    flat = {MODEL + k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    for name, state in (optim_state or {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{OPTIM}{name}.{key}"] = value
    return flat


def _trainable_only(model: torch.nn.Module) -> bool:
    """A LoRA model's checkpoint holds its trainable tensors only (the adapters and the modules trained in full):
    the frozen base is what the run loads again from its pretrained weights, so a checkpoint of a 7B base is
    megabytes."""
    from rapidlite.models.lora import trainable_only

    return trainable_only(model)


def _sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


def model_tensors(model: torch.nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors: its state dict (``full``: gathered whole into host memory, a collective),
    or a LoRA model's trainable parameters. An unsharded LoRA model is read directly: torch's state-dict helpers
    cannot walk bitsandbytes' 8-bit layers, whose state dict names attributes the layers do not have."""
    trainable = _trainable_only(model)
    if trainable and not _sharded(model):
        return {n: p.detach().cpu() if full else p.detach() for n, p in model.named_parameters() if p.requires_grad}
    options = StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=trainable)
    tensors = get_model_state_dict(model, options=options)
    if trainable:  # a frozen weight tied to another (a language-model head) escapes ignore_frozen_params
        names = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        tensors = {k: v for k, v in tensors.items() if k in names}
    return tensors


def _set_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], full: bool = False) -> None:
    trainable = _trainable_only(model)
    if trainable and not _sharded(model):
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)
        return
    set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=full, strict=not trainable))


# -------------------------------------------------------------------------------------- manifest
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


# ---------------------------------------------------------------------------------------- saving
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


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: its causes, and each rank's exception inside DCP's CheckpointException."""
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


def _write_failure(error: BaseException, directory: Path) -> str | None:
    """Why writing into ``directory`` failed, in a few words, when the cause is the file system's (a full disk,
    a quota, permissions); None for anything else, which is a bug and keeps its traceback."""
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
        return "the disk is full (no space left on device)"
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
    reason = next(r for r in reasons if r)
    if local is not None and _write_failure(local, save_dir) is None:  # not the file system's doing: a bug
        if isinstance(local, Exception):
            raise local
        raise RuntimeError(str(local)) from local  # DCP's CheckpointException, which `except Exception` misses
    latest = save_dir / LATEST_FILE
    kept = f"'latest' still points at iteration {latest.read_text().strip()}" if latest.is_file() else "no 'latest'"
    raise CheckpointError(
        f"--save {save_dir}: cannot write the checkpoint of iteration {iteration}: {reason}; the partial checkpoint "
        f"was removed and {kept} (free space in {save_dir}, then resume with --load {save_dir})"
    )


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Any | None,
    state: dict[str, Any],
    write_tensors: Callable[[Path], None] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Write ``DIR/iter_N`` atomically from every rank, with its manifest, and point ``DIR/latest`` at it (a
    collective).

    ``state`` holds what is not a tensor of the model or optimizer (trainer position, scheduler, scaler):
    rank 0 writes it, and the text ``files`` (name → text, e.g. the run's ``config.yaml``), which the manifest
    covers as every other file. ``optimizer`` None saves the weights only. ``write_tensors(directory)`` writes the
    model and optimizer in a backend's own format instead of DCP's (DeepSpeed's ``save_checkpoint``).
    A write that fails for the file system's reason (a full disk) raises a one-line ``CheckpointError`` on
    every rank, with the partial checkpoint removed and ``latest`` unchanged."""
    save_dir = Path(save_dir)
    final = save_dir / checkpoint_name(iteration)
    tmp = save_dir / f".tmp_{final.name}"
    rank, world = _rank(), _world()
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for stale in save_dir.glob(".tmp_*"):  # left by an earlier crash mid-save
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        tmp.mkdir()
    _barrier()
    failure: BaseException | None = None
    try:
        if write_tensors is not None:
            write_tensors(tmp)
        else:
            tensors = _flatten(
                model_tensors(model),
                _optimizer_tensors(model, optimizer, False) if optimizer else None,
            )
            with _one_process_is_fine():
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            torch.save(state, tmp / STATE_FILE)
            for name, text in (files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        failure = e
    _barrier()  # every rank's files are complete
    files: dict[str, dict[str, int]] = {}
    if failure is None:
        try:
            files = _hash_own_files(tmp, rank, world)
        except OSError as e:
            failure = e
    reason = None if failure is None else _write_failure(failure, save_dir) or _first_line(failure)
    reports = _all_gather((reason, files))
    if any(r for r, _ in reports):
        _fail_save(save_dir, tmp, iteration, [r for r, _ in reports], failure)
    failure, reason = None, None
    if rank == 0:
        try:
            _write_manifest(tmp, iteration, {k: v for _, part in reports for k, v in part.items()})
            _fsync_dir(tmp)
        except OSError as e:
            failure, reason = e, _write_failure(e, save_dir) or _first_line(e)
    reasons = _all_gather(reason)
    if any(reasons):
        _fail_save(save_dir, tmp, iteration, reasons, failure)
    if rank == 0:
        if final.exists():  # saving the same iteration again (e.g. a final save after an interval save)
            old = save_dir / f".tmp_old_{final.name}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(save_dir)
        try:
            _write_latest(save_dir, iteration)
        except OSError as e:
            reason = _write_failure(e, save_dir) or _first_line(e)
    reasons = _all_gather(reason)
    if any(reasons):
        # The checkpoint itself is complete and verified: a resume finds it although 'latest' lags behind.
        raise CheckpointError(
            f"--save {save_dir}: cannot update '{LATEST_FILE}' after writing {final.name}: "
            f"{next(r for r in reasons if r)} ({final.name} is complete: --load {save_dir} resumes from it)"
        )
    return final


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


# --------------------------------------------------------------------------------------- loading
# What DCP's metadata pickle may name: its own dataclasses and the torch types they hold.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            # Only the classes the module defines, not what it imports (dataclass, field, ...).
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with its metadata read through an unpickler that only builds DCP's own metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / METADATA_FILE
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def clear_run(save_dir: str | os.PathLike) -> str:
    """Remove a run's checkpoints, tracker, export, metrics and their curves from ``save_dir`` (``--overwrite``);
    other files stay. Returns what was removed, for the log."""
    save_dir = Path(save_dir)
    removed = []
    for path in sorted(save_dir.iterdir()) if save_dir.is_dir() else []:
        name = path.name
        if name.startswith(("iter_", ".tmp_")) or name in (LATEST_FILE, "hf", "metrics.jsonl", "curves.png"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(name)
    _fsync_dir(save_dir)
    return ", ".join(removed) or "nothing"


def is_pretrained_model_dir(load_dir: str | os.PathLike) -> bool:
    """A directory holding a Hugging Face model (``config.json``) and no rapidlite checkpoint: what
    Rapidformer's page passes as ``--load`` to load with ``from_pretrained(args.load)``."""
    load_dir = Path(load_dir)
    return (
        (load_dir / "config.json").is_file()
        and not (load_dir / LATEST_FILE).exists()
        and not any(load_dir.glob("iter_*"))
    )


def latest_iteration(load_dir: str | os.PathLike) -> int:
    """The iteration ``DIR/latest`` names, as written (``select_checkpoint`` is what loading uses)."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"--load {load_dir}: directory not found")
    iteration, problem = _read_latest(load_dir)
    if iteration is None:
        raise CheckpointError(f"--load {load_dir}: {problem}")
    return iteration


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


def _iterations(directory: Path) -> list[int]:
    """The iterations of the ``iter_N`` checkpoint directories in ``directory``, newest first."""
    found = (re.fullmatch(r"iter_(\d+)", p.name) for p in directory.glob("iter_*") if p.is_dir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


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


def _dcp_load(target: dict[str, torch.Tensor], path: Path, load_dir: Any) -> None:
    try:
        with _one_process_is_fine():
            dcp.load(target, storage_reader=SafeFileSystemReader(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"--load {load_dir}: cannot read the checkpoint in {path} ({_first_line(e)})") from None


def _checkpoint_metadata(path: Path) -> dict[str, Any]:
    return dict(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def check_shapes(load_dir: Any, own: dict[str, Any], saved: dict[str, Any]) -> None:
    """The first tensor of ``own`` whose shape in ``saved`` (tensors or DCP's metadata) differs, named in one
    line."""
    for name, tensor in own.items():
        entry = saved.get(name)
        shape = entry.shape if isinstance(entry, torch.Tensor) else getattr(entry, "size", None)
        if shape is not None and tuple(shape) != tuple(tensor.shape):
            if name.startswith(MODEL):
                name = name[len(MODEL) :]
            elif name.startswith(OPTIM):
                name = f"(optimizer state) {name[len(OPTIM) :]}"
            raise CheckpointError(
                f"--load {load_dir}: parameter {name} has shape {tuple(shape)} in the checkpoint but "
                f"{tuple(tensor.shape)} in the model: is it the same architecture (--hidden-size, --num-layers, "
                "vocabulary)?"
            )


def checkpoint_path(load_dir: str | os.PathLike) -> Path:
    """The directory ``DIR/latest`` points at, unverified (``select_checkpoint`` verifies and falls back)."""
    return Path(load_dir) / checkpoint_name(latest_iteration(load_dir))


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / DEEPSPEED_TAG).is_dir()


def cross_backend_optimizer_error(load_dir: Any, saved_by_deepspeed: bool) -> CheckpointError:
    writer, reader = ("DeepSpeed", "without --deepspeed") if saved_by_deepspeed else ("PyTorch", "under --deepspeed")
    return CheckpointError(
        f"--load {load_dir}: the checkpoint was written by {writer}, and its optimizer state does not load "
        f"{reader}: add --no-load-optim to continue from its weights and schedule (or --finetune for the weights)"
    )


def load_checkpoint(
    load_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    weights_only: bool = False,
    partial: bool = False,
) -> tuple[int, dict[str, Any] | None]:
    """Load ``latest`` into ``model`` (and ``optimizer`` unless None), whatever the layout that saved it.

    ``partial``: ``model`` holds part of the saved one (a pipeline stage), so the checkpoint's other weights
    are expected. Returns ``(iteration, state)``: ``state`` holds ``state.pt``'s contents plus this rank's
    ``rng``; None with ``weights_only``. A collective: every rank calls it."""
    iteration, path = select_checkpoint(load_dir)
    if is_deepspeed_checkpoint(path):
        if optimizer is not None:
            raise cross_backend_optimizer_error(load_dir, saved_by_deepspeed=True)
        weights = deepspeed_weights(path, load_dir)
        own = model_tensors(model)
        _check_keys(load_dir, own, weights.keys(), partial=partial)
        check_shapes(load_dir, own, weights)
        if partial:  # the other stages' weights stay in the file
            weights = {k: v for k, v in weights.items() if k in own}
        _set_model_tensors(model, weights, full=True)
        return iteration, None if weights_only else read_state(path, load_dir, optimizer_loaded=False)
    needed = [path / METADATA_FILE] + ([] if weights_only else [path / STATE_FILE])
    for f in needed:
        if not f.is_file():
            raise CheckpointError(f"--load {load_dir}: checkpoint file {f} is missing")
    try:
        saved = _checkpoint_metadata(path)
    except Exception as e:
        raise CheckpointError(f"--load {load_dir}: cannot read {path / METADATA_FILE} ({_first_line(e)})") from None

    model_sd = model_tensors(model)
    _check_keys(load_dir, model_sd, [k[len(MODEL) :] for k in saved if k.startswith(MODEL)], partial=partial)
    optim_state = None
    if optimizer is not None and any(k.startswith(OPTIM) for k in saved):
        optim_state = _optimizer_tensors(model, optimizer, materialize=True)
    target = _flatten(model_sd, optim_state)
    check_shapes(load_dir, target, saved)
    _dcp_load(target, path, load_dir)

    loaded = {k[len(MODEL) :]: v for k, v in target.items() if k.startswith(MODEL)}
    _set_model_tensors(model, loaded)
    if optim_state is not None:
        local = _zero1_local(optimizer)
        if local is None:
            template = get_optimizer_state_dict(model, optimizer)
            set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": template["param_groups"]})
        # ZeRO-1: optim_state holds this rank's live state tensors, which DCP filled in place.
    if weights_only:
        return iteration, None
    return iteration, read_state(path, load_dir, optimizer_loaded=optim_state is not None)


def _check_keys(load_dir: Any, model_sd: dict[str, Any], saved: Any, partial: bool = False) -> None:
    saved = set(saved)
    missing = sorted(k for k in model_sd if k not in saved)
    unexpected = [] if partial else sorted(k for k in saved if k not in model_sd)
    if missing or unexpected:
        raise CheckpointError(
            f"--load {load_dir}: the checkpoint does not match the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); is it the same architecture?"
        )


def read_state(path: Path, load_dir: Any, optimizer_loaded: bool) -> dict[str, Any]:
    """``state.pt`` (trainer position, schedule, scaler) plus this rank's RNG states."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"--load {load_dir}: checkpoint file {state_file} is missing")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        rng_file = path / f"rng_rank{_rank()}.pt"
        state["rng"] = torch.load(rng_file if rng_file.is_file() else path / "rng_rank0.pt", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"--load {load_dir}: cannot read {state_file} ({_first_line(e)})") from None
    state["optimizer_loaded"] = optimizer_loaded
    return state


def deepspeed_weights(path: Path, load_dir: Any = None) -> dict[str, torch.Tensor]:
    """The fp32 weights of a DeepSpeed checkpoint, consolidated from its ZeRO partitions (or, without ZeRO,
    its module state), in this process."""
    try:
        from rapidlite.parallel.deepspeed_backend import import_deepspeed

        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except Exception as e:
        raise CheckpointError(f"--load {load_dir or path}: a DeepSpeed checkpoint needs DeepSpeed ({e})") from None
    tag_dir = path / DEEPSPEED_TAG
    try:
        if any(tag_dir.glob("*optim_states.pt")):
            # zero_to_fp32 prints its progress: kept out of the run's output.
            quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
            with warnings.catch_warnings(), quiet[0], quiet[1]:
                warnings.simplefilter("ignore")
                weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
        else:
            (states,) = sorted(tag_dir.glob("*model_states.pt"))
            weights = torch.load(states, map_location="cpu", weights_only=False)["module"]
    except Exception as e:
        raise CheckpointError(
            f"--load {load_dir or path}: cannot read the DeepSpeed checkpoint in {tag_dir} ({_first_line(e)})"
        ) from None
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def read_model_tensors(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of one checkpoint directory, in this process, whoever saved them."""
    path = Path(checkpoint_dir)
    if is_deepspeed_checkpoint(path):
        return deepspeed_weights(path)
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read {path / METADATA_FILE} ({_first_line(e)})") from None
    target = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL) and hasattr(meta, "size")
    }
    try:
        with _one_process_is_fine():
            dcp.load(target, storage_reader=SafeFileSystemReader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the checkpoint in {path} ({_first_line(e)})") from None
    return {k[len(MODEL) :]: v for k, v in target.items()}


# ---------------------------------------------------------------------------------------- export
def export_hf(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    state_dict: dict[str, Any] | None = None,
    merge_adapters: bool = False,
) -> Path | None:
    """Save a Hugging Face model (and tokenizer) with ``save_pretrained`` in safetensors, atomically, from
    the full weights gathered on rank 0 (a collective). Returns None for models that are not Hugging Face
    models, and on ranks other than 0. ``state_dict``: the full weights, gathered already by a backend that
    holds them elsewhere (a pipeline's stages, DeepSpeed's partitions).

    A LoRA (peft) model is written as its adapter in peft's format in ``out_dir/adapter``, and with
    ``merge_adapters`` also as the base model with the adapters merged in, in ``out_dir`` itself."""
    from rapidlite.models import lora
    from rapidlite.models.spec import spec_of

    adapters = lora.is_peft_model(model)
    base = lora.unwrap(model)
    savable = hasattr(base, "save_pretrained") or spec_of(base).save is not None
    if not savable and not adapters:
        return None
    if merge_adapters and not savable:
        if _rank() == 0:
            logging.getLogger(LOGGER_NAME).warning(
                f"--merge-lora: {type(base).__name__} is not a Hugging Face model, so there is no merged model to "
                "write; the adapter alone is exported"
            )
        merge_adapters = False
    if state_dict is not None:
        full = state_dict
    elif adapters and merge_adapters and not _sharded(model):
        full = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # base, quantised or not, and adapters
    elif adapters and merge_adapters:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:  # the adapter alone needs none of the base's weights gathered
        full = model_tensors(model, full=True)
    if _rank() != 0:
        return None
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp_{out_dir.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if adapters:
        lora.save_adapter(model, full, tmp / "adapter")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "adapter")
    if not adapters or merge_adapters:
        weights = lora.merged_state_dict(model, full) if adapters else full
        _save_full_model(base, weights, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    old = out_dir.with_name(f".tmp_old_{out_dir.name}_{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _save_full_model(model: torch.nn.Module, weights: dict[str, Any], directory: Path) -> None:
    from rapidlite.models.hf import quiet_deepspeed_accelerator, saved_config, unquantized
    from rapidlite.models.spec import spec_of

    save = spec_of(model).save
    quiet_deepspeed_accelerator()
    with saved_config(model):
        if save is not None:  # the family writes Hugging Face's layout itself (the built-in GPT)
            save(model, weights, directory)
        else:
            target = unquantized(model)
            if target is not model:
                from rapidlite.models.lora import restore_conv1d_layout

                restore_conv1d_layout(model, target, weights)
            target.save_pretrained(directory, state_dict=weights, safe_serialization=True)


def _first_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException) and e.failures:  # its text is every rank's traceback
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
