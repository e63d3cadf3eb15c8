"""LoRA's update added to the base layer's output in one ``addmm``.

peft's ``lora.Linear`` computes ``result + lora_B(lora_A(dropout(x))) * scaling``: three tensors of the layer's
output size (B's output, its scaled copy and the sum) for each adapted layer, on every device. ``AddmmLoraLinear``
computes the same sum as ``torch.addmm(result, lora_A(dropout(x)), B^T, alpha=scaling)``: one tensor of that size,
and two kernels fewer. The base layer's output is not written in place (selective recompute may keep it), and
autograd saves what peft's path saves (the adapter's rank-sized input and B's weight).

It takes over a layer only where it computes exactly peft's function: a plain ``nn.Linear`` base, adapters that
are active, unmerged and plain LoRA (no DoRA or other variant, no bias on B), plain tensors (not DTensor shards,
not DeepSpeed ZeRO-3's partitioned parameters) and, outside autocast, one dtype for the output, the adapter's
input and B's weight. Anything else runs peft's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear
from torch import nn


class AddmmLoraLinear(Linear):
    """peft's ``lora.Linear`` with the ``addmm`` forward (see the module docstring). ``fuse_lora_updates`` swaps a
    layer's class to it, which keeps ``isinstance`` checks, copies and peft's own methods (merging, saving) as they
    are."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = self._addmm_adapters(args, kwargs)
        if active is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x)
        result = self.base_layer(x)
        dtype = result.dtype
        for name in active:
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = lora_A(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.weight.dtype)))
            weight = lora_B.weight
            if not _addable(result, h, weight):
                result = result + lora_B(h) * self.scaling[name]
                continue
            flat = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), weight.t(),
                               alpha=self.scaling[name])  # fmt: skip
            result = flat.view(result.shape)
        return result.to(dtype)  # as peft's: an fp32 adapter's sum on a half-precision base comes back to its dtype

    def _addmm_adapters(self, args: tuple, kwargs: dict) -> list[str] | None:
        """The adapters to add, or None where peft's own forward must run."""
        if args or any(v is not None for v in kwargs.values()) or self.disable_adapters or self.merged:
            return None
        if type(self.base_layer) is not nn.Linear:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if any(a in self.lora_variant or self.lora_B[a].bias is not None for a in active):
            return None
        return active


def fuse_lora_updates(model: nn.Module) -> int:
    """Give each of ``model``'s peft ``lora.Linear`` layers the ``addmm`` forward (``AddmmLoraLinear``); how many
    there were."""
    swapped = 0
    for module in model.modules():
        # an older peft, without the variants table or input casting this forward reads, keeps its own forward
        if type(module) is Linear and hasattr(module, "lora_variant") and hasattr(module, "_cast_input_dtype"):
            module.__class__ = AddmmLoraLinear
            swapped += 1
    return swapped


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def _addable(result: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``addmm`` computes peft's sum here: plain tensors of the expected shapes (a ZeRO-3 parameter not
    gathered is empty) in one dtype, or under the device's autocast, which casts them to one."""
    if not (_plain(result) and _plain(h) and _plain(weight)) or hasattr(weight, "ds_id"):
        return False
    if weight.dim() != 2 or weight.shape != (result.shape[-1], h.shape[-1]):
        return False
    if torch.is_autocast_enabled(result.device.type):
        return True
    return result.dtype == h.dtype == weight.dtype
