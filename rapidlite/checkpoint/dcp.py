"""Sharded save and load with ``torch.distributed.checkpoint`` (DCP): atomic, resumable under any layout.

Tensors are keyed by parameter name, not by rank, so a checkpoint saved by 2 ranks under ZeRO-3 loads on 1
rank without ZeRO and the reverse: DCP reads each rank's slice of every tensor from whichever files hold
it. Only tensors go through DCP; optimizer hyperparameters come from the resumed run's flags.

A checkpoint is written under ``.tmp_iter_N`` and renamed when every rank has finished and the manifest is
complete; only then is ``latest`` replaced. A crash mid-save leaves ``latest`` at the previous good checkpoint.

A DeepSpeed checkpoint resumes under DeepSpeed (same layout); its weights (consolidated by DeepSpeed's
``zero_to_fp32``) also load without DeepSpeed, and a DCP checkpoint's weights load under DeepSpeed:
across backends the optimizer state does not carry over (``--no-load-optim``).

Loading a DCP checkpoint unpickles nothing but tensors and plain containers: ``torch.load(weights_only=True)``
for the side files and a restricted unpickler for DCP's metadata. DeepSpeed's files are read by DeepSpeed,
which unpickles them in full: load only DeepSpeed checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

# Through their modules, not imported by name: tests and benchmarks replace _write_latest and _hash_own_files there.
from rapidlite.checkpoint import integrity, layout
from rapidlite.checkpoint.integrity import _fail_save, _first_line, _write_failure, _write_manifest, first_failure
from rapidlite.checkpoint.layout import (
    DEEPSPEED_TAG,
    LATEST_FILE,
    METADATA_FILE,
    MODEL,
    OPTIM,
    STATE_FILE,
    _all_gather,
    _barrier,
    _fsync_dir,
    _rank,
    _world,
    checkpoint_name,
    is_deepspeed_checkpoint,
)
from rapidlite.checkpoint.rng import rng_state
from rapidlite.checkpoint.selection import select_checkpoint
from rapidlite.checkpoint.watchdog import SaveWatchdog
from rapidlite.errors import CheckpointError


@contextlib.contextmanager
def _one_process_is_fine():
    # DCP warns on every call without a process group, which is how one process runs here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _zero1_local(optimizer: Any) -> list[torch.optim.Optimizer] | None:
    """The optimizers over this rank's share of the parameters, for ZeRO-1's sharded optimizer (with expert
    parallelism, also the one over this rank's experts: ``Zero1WithExperts``). Its module is loaded where one
    was built: without it (every other layout), no import just to answer no."""
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return [optimizer.optim]
    return getattr(optimizer, "local_optimizers", None)


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
    locals_ = _zero1_local(optimizer)
    if locals_ is None:
        return get_optimizer_state_dict(model, optimizer)["state"]
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for local in locals_:
        if materialize:
            _materialize_state(local)
        state.update({names[id(p)]: dict(s) for p, s in local.state.items()})
    return state


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
    every rank, with the partial checkpoint removed and ``latest`` unchanged; when the failed rank's peers are
    left waiting in the backend's collectives, ``watchdog.SaveWatchdog`` ends them with that line."""
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
    # A rank failing inside a backend's write can leave the others in its collectives: the watchdog ends them.
    with SaveWatchdog(save_dir, tmp, iteration, rank, world) as watchdog:
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
            watchdog.record(e, _write_failure(e, save_dir) or _first_line(e))
        _barrier()  # every rank's files are complete
        files: dict[str, dict[str, int]] = {}
        if failure is None:
            try:
                files = integrity._hash_own_files(tmp, rank, world)
            except OSError as e:
                failure = e
                watchdog.record(e, _write_failure(e, save_dir) or _first_line(e))
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
                layout._write_latest(save_dir, iteration)
            except OSError as e:
                reason = _write_failure(e, save_dir) or _first_line(e)
        reasons = _all_gather(reason)
        if any(reasons):
            # The checkpoint itself is complete and verified: a resume finds it although 'latest' lags behind.
            raise CheckpointError(
                f"--save {save_dir}: cannot update '{LATEST_FILE}' after writing {final.name}: "
                f"{first_failure(reasons)} ({final.name} is complete: --load {save_dir} resumes from it)"
            )
        return final


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


def _checkpoint_metadata(path: Path) -> dict[str, Any]:
    return dict(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of a DCP checkpoint's model tensors, by parameter name, from its metadata (no tensor is read);
    empty for a DeepSpeed checkpoint."""
    if is_deepspeed_checkpoint(path):
        return {}
    try:
        saved = _checkpoint_metadata(path)
    except Exception as e:
        raise CheckpointError(f"cannot read {path / METADATA_FILE} ({_first_line(e)})") from None
    return {k[len(MODEL) :]: tuple(v.size) for k, v in saved.items() if k.startswith(MODEL) and hasattr(v, "size")}


def _dcp_load(target: dict[str, torch.Tensor], path: Path, load_dir: Any) -> None:
    try:
        with _one_process_is_fine():
            dcp.load(target, storage_reader=SafeFileSystemReader(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"--load {load_dir}: cannot read the checkpoint in {path} ({_first_line(e)})") from None


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


def _check_keys(load_dir: Any, model_sd: dict[str, Any], saved: Any, partial: bool = False) -> None:
    saved = set(saved)
    missing = sorted(k for k in model_sd if k not in saved)
    unexpected = [] if partial else sorted(k for k in saved if k not in model_sd)
    if missing or unexpected:
        raise CheckpointError(
            f"--load {load_dir}: the checkpoint does not match the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); is it the same architecture?"
        )


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
    chosen: tuple[int, Path] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Load ``latest`` into ``model`` (and ``optimizer`` unless None), whatever the layout that saved it.

    ``partial``: ``model`` holds part of the saved one (a pipeline stage), so the checkpoint's other weights
    are expected. ``chosen``: ``(iteration, directory)`` of the checkpoint to load, selected already
    (``select_checkpoint``). Returns ``(iteration, state)``: ``state`` holds ``state.pt``'s contents plus this
    rank's ``rng``; None with ``weights_only``. A collective: every rank calls it."""
    iteration, path = chosen or select_checkpoint(load_dir)
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
