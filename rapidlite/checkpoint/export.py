"""The Hugging Face export at the end of a run (``DIR/hf``): ``save_pretrained`` from the full weights, written
atomically on rank 0; a LoRA model as its adapter (and, with ``--merge-lora``, merged)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rapidlite.checkpoint.dcp import _sharded, model_tensors
from rapidlite.checkpoint.layout import _rank
from rapidlite.observe.logging import LOGGER_NAME


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
    from rapidlite.models import lora, lora_export
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
    tmp = staging_dir(out_dir)
    if adapters:
        lora_export.save_adapter(model, full, tmp / "adapter")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "adapter")
    if not adapters or merge_adapters:
        weights = lora_export.merged_state_dict(model, full) if adapters else full
        _save_full_model(base, weights, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    install(tmp, out_dir)
    return out_dir


def staging_dir(out_dir: Path) -> Path:
    """An empty sibling of ``out_dir`` to write an export into before ``install`` renames it into place."""
    tmp = out_dir.with_name(f".tmp_{out_dir.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def install(tmp: Path, out_dir: Path) -> None:
    """Rename the complete export ``tmp`` to ``out_dir``, replacing what was there: a reader sees the old export
    or the new one, never half of one."""
    old = out_dir.with_name(f".tmp_old_{out_dir.name}_{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _save_full_model(model: torch.nn.Module, weights: dict[str, Any], directory: Path) -> None:
    from rapidlite.models.hf import plain_save, saved_config, unquantized
    from rapidlite.models.spec import spec_of

    save = spec_of(model).save
    with saved_config(model), plain_save():
        if save is not None:  # the family writes Hugging Face's layout itself (the built-in GPT)
            save(model, weights, directory)
        else:
            target = unquantized(model)
            if target is not model:
                from rapidlite.models.lora_export import restore_conv1d_layout

                restore_conv1d_layout(model, target, weights)
            target.save_pretrained(directory, state_dict=weights, safe_serialization=True)
