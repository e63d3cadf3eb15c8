"""Model FLOPs per token, device peaks, and model FLOPs utilisation (MFU).

Training FLOPs per token (forward + backward, as in Megatron-LM and PaLM's appendix B)::

    6 N + 12 L d T

- ``N``: the weights that take part in matrix multiplies: every parameter except embedding tables (a lookup
  costs no FLOPs), but an embedding table that is also the output layer (tied, GPT-2/BERT) counts once. In a
  mixture of experts, the active ones: each expert tensor counts top-k / experts of its size.
  Each weight costs 2 FLOPs per token forward and 4 backward.
- ``12 L d T``: attention scores and weighted values (``L`` layers, hidden size ``d``, ``T`` tokens per
  sequence); not halved for a causal mask, as Megatron and PaLM count it.
- A vision-language model's image encoder and projector (``N_v``) run per image patch, not per token: ``2 N_v``
  forward and ``4 N_v,trained`` backward per patch (a frozen tower has no backward: nothing before it trains).
  The encoder's own attention is not counted.

The same formula holds for decoders (GPT-2, LLaMA-style: the SwiGLU MLP's three matrices are all in ``N``)
and encoders (BERT: bidirectional attention, MLM head tied to the word embeddings). ``L`` and ``d`` are read
from the config keys the model's family names (``ModelSpec.layers_and_hidden``); a model whose config names
no layer count or hidden size (not a transformer) gets ``6 N``. Recomputation under activation checkpointing
is not counted: MFU counts the model's FLOPs, not the hardware's, so checkpointing lowers it.

MFU is the model FLOPs a device achieves per second over its peak. The peak is ``--peak-flops`` when given,
else the datasheet dense peak of a known GPU at the training precision; on CPU there is no datasheet:
``rapidlite-bench peak`` measures the matrix-multiply peak to pass as ``--peak-flops``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rapidlite.models.spec import moe_layout, spec_of

# Dense (no sparsity) datasheet peaks in FLOP/s: (16-bit tensor cores, fp32). Matched against
# torch.cuda.get_device_name(), most specific name first ("A100" before "A10", "L40S" before "L4").
GPU_PEAKS: list[tuple[str, float, float | None, float]] = [
    # (name contains, dense bf16/fp16, dense TF32 (None: no TF32 cores), fp32), FLOP/s from the datasheets
    ("H100 SXM", 989e12, 494.5e12, 67e12),
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100", 989e12, 494.5e12, 67e12),
    ("H200", 989e12, 494.5e12, 67e12),
    ("A100", 312e12, 156e12, 19.5e12),
    ("A800", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("A10", 125e12, 62.5e12, 31.2e12),
    ("L4", 121e12, 60e12, 30.3e12),
    ("V100", 125e12, None, 15.7e12),
    ("T4", 65e12, None, 8.1e12),
]


@dataclass(frozen=True)
class ModelFlops:
    """The terms of ``6 N + 12 L d T`` for one model; ``frozen_params`` of the ``N`` get no weight gradient (a
    LoRA base), which saves their third matrix multiply: ``6 N - 2 N_frozen``."""

    matmul_params: int
    num_layers: int | None
    hidden_size: int | None
    frozen_params: int = 0
    # A vision-language model's image encoder and projector, apart from ``N``: they run per image patch, not per
    # token. ``vision_trained``: of them, those that train; ``patch_size``: the encoder's (for counting patches).
    vision_params: int = 0
    vision_trained: int = 0
    patch_size: int | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ModelFlops:
        spec = spec_of(model)
        config = getattr(model, "config", None)
        layers, hidden = spec.layers_and_hidden(config)
        share = active_shares(model)
        vision: set[int] = set()
        if spec.vision is not None:
            vision = {id(p) for n, p in model.named_parameters() if spec.vision.part(n) != "language"}
        text = lambda p: id(p) not in vision  # noqa: E731
        image = lambda p: id(p) in vision  # noqa: E731
        trained = lambda p: id(p) in vision and p.requires_grad  # noqa: E731
        patch = getattr(getattr(config, "vision_config", None), "patch_size", None) if vision else None
        return cls(
            matmul_parameters(model, share=share, keep=text),
            layers,
            hidden,
            matmul_parameters(model, True, share, keep=text),
            matmul_parameters(model, keep=image),
            matmul_parameters(model, keep=trained),
            patch if isinstance(patch, int) else None,
        )

    def per_patch(self) -> float:
        """Training FLOPs per image patch: the encoder's forward, and the backward of its weights that train."""
        return 2.0 * self.vision_params + 4.0 * self.vision_trained

    def per_token(self, seq_length: float) -> float:
        """Training FLOPs per token for sequences of ``seq_length`` tokens."""
        attention = (
            12.0 * self.num_layers * self.hidden_size * seq_length if self.num_layers and self.hidden_size else 0
        )
        return 6.0 * self.matmul_params - 2.0 * self.frozen_params + attention

    def describe(self) -> str:
        n = f"N={self.matmul_params / 1e6:.2f}M"
        six = "6 N"
        if self.frozen_params:
            six, n = "6 N - 2 N_frozen", f"{n}, N_frozen={self.frozen_params / 1e6:.2f}M"
        images = ""
        if self.vision_params:
            images = (
                f"; per image patch 2 N_v + 4 N_v,trained (N_v={self.vision_params / 1e6:.2f}M, "
                f"N_v,trained={self.vision_trained / 1e6:.2f}M)"
            )
        if self.num_layers and self.hidden_size:
            return f"{six} + 12 L d T ({n}, L={self.num_layers}, d={self.hidden_size}){images}"
        return f"{six} ({n}; no layer count or hidden size in the model's config){images}"


def _numel(param: torch.Tensor) -> int:
    shape = getattr(getattr(param, "quant_state", None), "shape", None)  # a packed 4-bit weight: its true shape
    return math.prod(shape) if shape is not None else param.numel()


def active_shares(model: nn.Module) -> dict[int, float]:
    """A mixture of experts' expert tensors (by ``id``) and the share of them a token goes through: its top-k
    over the expert count (6 N counts the active parameters)."""
    layout = moe_layout(model)
    if layout is None:
        return {}
    config = getattr(model, "config", None)
    share = layout.top_k(config) / layout.num_experts(config)
    return {id(p): share for n, p in model.named_parameters() if f".{layout.experts}." in f".{n}"}


def matmul_parameters(
    model: nn.Module,
    frozen: bool = False,
    share: dict[int, float] | None = None,
    keep: Callable[[nn.Parameter], bool] | None = None,
) -> int:
    """Parameters used in matrix multiplies: all but embedding tables; a tied output layer counts once.
    Sharded parameters (DTensor) count whole; ``frozen``: only those that do not train; ``share``: the part of
    a parameter a token uses (``active_shares``), where it is not 1; ``keep``: only the parameters it accepts."""
    in_matmul: dict[int, float] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for param in module.parameters(recurse=False):
            if (not frozen or not param.requires_grad) and (keep is None or keep(param)):
                in_matmul[id(param)] = _numel(param) * (share or {}).get(id(param), 1.0)
    return round(sum(in_matmul.values()))


def device_peak_flops(device: torch.device, dtype: torch.dtype | None, tf32: bool | None = False) -> float | None:
    """The datasheet peak of a known GPU at ``dtype`` (None: fp32, on TF32 cores when ``tf32``), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half, tf32_peak, fp32 in GPU_PEAKS:
        if key in name:
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return tf32_peak if tf32 and tf32_peak is not None else fp32
    return None


# ---------------------------------------------------------------------- measured matmul peak


def measure_matmul_peak(
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    sizes: tuple[int, ...] = (1024, 2048, 3072),
    repeats: int = 5,
) -> tuple[float, int]:
    """The best FLOP/s of square matrix multiplies at ``dtype`` over ``sizes`` (median of ``repeats`` timed
    runs each, after one warm-up); returns (FLOP/s, the size that reached it)."""
    device = torch.device(device)
    best = (0.0, sizes[0])
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        times = []
        for i in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
        flops = 2.0 * n**3 / statistics.median(times)
        best = max(best, (flops, n))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
