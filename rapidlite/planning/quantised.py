"""QLoRA's base weights in the plan (``rapidlite.planning.memory``): the plan adapts the full-precision base on
meta, then counts the frozen linear layers bitsandbytes would quantise at their quantised size."""

from __future__ import annotations

import math

import torch

from rapidlite.config.sections import LoraConfig


def _bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _quantisable(module: torch.nn.Module, settings: LoraConfig) -> list[torch.nn.Linear]:
    """The frozen linear layers bitsandbytes would quantise (heads and modules trained in full are kept)."""
    from rapidlite.models.lora import SKIP_ON_LOAD, split_names

    keep = {*SKIP_ON_LOAD, *split_names(settings.lora_modules_to_save)}
    return [
        m
        for name, m in module.named_modules()
        if type(m) is torch.nn.Linear
        and not m.weight.requires_grad
        and not any(part in keep for part in name.split("."))
    ]


def quantisable_bytes(module: torch.nn.Module, settings: LoraConfig) -> int:
    return sum(_bytes(m.weight) for m in _quantisable(module, settings))


def quantised_bytes(module: torch.nn.Module, settings: LoraConfig) -> int:
    """bitsandbytes' sizes: 4-bit packs two weights a byte plus an fp32 scale per block of 64 (double
    quantisation: an 8-bit scale plus an fp32 one per 256 blocks); 8-bit is a byte a weight plus an fp32 scale
    per output row."""
    total = 0
    for m in _quantisable(module, settings):
        n = m.weight.numel()
        if settings.load_in_4bit:
            blocks = math.ceil(n / 64)
            scales = blocks + 4 * math.ceil(blocks / 256) if settings.bnb_4bit_use_double_quant else 4 * blocks
            total += math.ceil(n / 2) + scales
        else:
            total += n + 4 * m.out_features
    return total
