"""bitsandbytes' AdamW with 8-bit moments (``--optimizer adamw8bit``, ``paged_adamw8bit``): the optimizer, adapted
so checkpoints keep its state whole, and the bytes of that state.

bitsandbytes keeps two fp32 moments for a tensor of fewer than ``MIN_8BIT_SIZE`` elements; for a larger one two
uint8 moments (``state1``, ``state2``) quantised block-wise, with an fp32 absmax per block of ``QUANT_BLOCK``
elements for each (``absmax1``, ``absmax2``). Every parameter a fresh optimizer steps points at the same two
256-entry fp32 quantisation maps (``qmap1``, ``qmap2``). Bitsandbytes is imported only when one is built.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

MIN_8BIT_SIZE = 4096
QUANT_BLOCK = 256
QMAP_BYTES = 2 * 256 * 4
# --optimizer's 8-bit choices (config.sections.EIGHT_BIT_OPTIMIZERS) and the bitsandbytes class each builds.
CLASSES = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}


@functools.cache
def _adapted(name: str) -> type[torch.optim.Optimizer]:
    """bitsandbytes' optimizer class ``name`` with a state dict that checkpoints keep whole.

    bitsandbytes counts steps in a Python int, and its own ``state_dict`` nests the quantised tensors in a dict
    that hides them from FSDP. Checkpoints keep each parameter's tensors at its top level, and only tensors
    (``checkpoint.dcp``): so the state dict here is torch's flat one with the step as an int64 tensor, and loading
    turns the step back into the int before bitsandbytes would cast a tensor step to the parameter's dtype (bf16
    rounds it)."""
    import bitsandbytes.optim

    class Adapted(getattr(bitsandbytes.optim, name)):
        def state_dict(self) -> dict[str, Any]:
            saved = torch.optim.Optimizer.state_dict(self)  # it holds each parameter's live dict: copied here
            saved["state"] = {
                key: {**state, "step": torch.tensor(state["step"], dtype=torch.int64)}
                for key, state in saved["state"].items()
            }
            return saved

        def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
            states = {key: {**state, "step": int(state["step"])} for key, state in state_dict["state"].items()}
            super().load_state_dict({**state_dict, "state": states}, move_to_device=move_to_device)

    Adapted.__name__ = Adapted.__qualname__ = name
    return Adapted


def build(optimizer: str, groups: list[dict[str, Any]], **defaults: Any) -> torch.optim.Optimizer:
    """``--optimizer`` ``optimizer`` (a key of ``CLASSES``) over ``groups`` (their weight decay is each group's)."""
    return _adapted(CLASSES[optimizer])(groups, min_8bit_size=MIN_8BIT_SIZE, **defaults)


# bitsandbytes' CPU step (backends/cpu/ops.py, _optimizer_update_8bit_blockwise_cpu) works on a whole tensor in
# fp32: its two moments dequantised, the scaled gradient, and the denominator's square root and quotient are
# live together (measured: 4.99 x the tensor's fp32 bytes over the steady state). CUDA's kernel works block by
# block in registers.
CPU_STEP_COPIES = 5


def cpu_step_bytes(sizes: list[int]) -> int:
    """The temporaries of bitsandbytes' CPU step at its largest tensor of ``sizes`` (quantised ones only: a
    smaller tensor's fp32 moments are updated in place)."""
    quantised = [n for n in sizes if n >= MIN_8BIT_SIZE]
    return CPU_STEP_COPIES * 4 * max(quantised, default=0)


def state_bytes(sizes: list[int]) -> int:
    """The state's bytes for parameters of ``sizes`` elements each, once every one has stepped."""
    quantised = [n for n in sizes if n >= MIN_8BIT_SIZE]
    absmax = 2 * 4 * sum(math.ceil(n / QUANT_BLOCK) for n in quantised)
    full = 8 * sum(n for n in sizes if n < MIN_8BIT_SIZE)
    return 2 * sum(quantised) + absmax + full + (QMAP_BYTES if quantised else 0)
