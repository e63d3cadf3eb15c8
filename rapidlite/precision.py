"""Mixed precision: which autocast dtype a device gets, and Megatron's dynamic loss scaler.

Weights and optimizer state stay fp32 ("master weights"); only the forward/backward math runs
in bf16/fp16 under ``torch.autocast``. fp16 needs loss scaling to keep small gradients
representable; bf16 has fp32's exponent range and does not.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from rapidlite.config.runtime import PrecisionConfig


@dataclass(frozen=True)
class Precision:
    """The resolved policy: ``dtype`` None means plain fp32."""

    dtype: torch.dtype | None
    device_type: str

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def apply(self, module: torch.nn.Module) -> None:
        """Run ``module``'s forward under this autocast, through forward hooks: the module, its class and its
        ``forward`` stay the user's own. The closing hook runs even when the forward raises."""
        if self.dtype is None:
            return
        open_contexts: list[contextlib.AbstractContextManager] = []

        def enter(_module: torch.nn.Module, _args: Any) -> None:
            context = self.autocast()
            context.__enter__()
            open_contexts.append(context)

        def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
            open_contexts.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32 ones.

    x86 has a bf16 fast path only with AVX-512 BF16 or AMX; without them oneDNN emulates bf16, measured 40x
    slower than fp32 (1.5 against 60 GFLOP/s on an AVX2-only EPYC), so the instruction sets decide there.
    Elsewhere (ARM's BF16 extensions vary) a millisecond probe decides: bf16 must beat fp32 clearly."""
    cpu = torch.cpu
    if (
        getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    ):
        return True
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return False
    return _probe_matmul_seconds(torch.bfloat16) < 0.8 * _probe_matmul_seconds(torch.float32)


def _probe_matmul_seconds(dtype: torch.dtype, n: int = 256, repeats: int = 3) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return (time.perf_counter() - start) / repeats


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # a precision's compute dtype (None: fp32)


def resolve_precision(precision: str, device: torch.device) -> tuple[Precision, str | None]:
    """The policy for ``args.precision`` on ``device``, and a notice to log (None when there is nothing to say).

    'auto' (``--mixed-precision``) takes bf16 where the device runs it fast: Ampere and newer GPUs, CPUs
    with a bf16 fast path (``cpu_bf16_is_fast``); fp16 with loss scaling on older GPUs; fp32 on other CPUs,
    where bf16 would be many times slower (fp16 autocast on CPU is slower still, so never chosen there). An
    explicit ``--bf16`` is obeyed, with a warning where it is slow.
    """
    device_type = device.type
    notice = None
    slow_bf16 = device_type == "cpu" and not cpu_bf16_is_fast()
    if precision == "auto":
        if device_type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        elif slow_bf16:
            precision = "fp32"
            notice = (
                "--mixed-precision: this CPU has no bf16 fast path (no AVX-512 BF16 or AMX), where bf16 runs many "
                "times slower than fp32; training in fp32 (--bf16 forces bf16)"
            )
        else:
            precision = "bf16"
    elif precision == "bf16" and slow_bf16:
        notice = (
            "--bf16: this CPU has no bf16 fast path (no AVX-512 BF16 or AMX): bf16 matrix multiplies run many times "
            "slower than fp32 here (--mixed-precision picks fp32 on such CPUs)"
        )
    return Precision(dtype=DTYPES[precision], device_type=device_type), notice


def set_tf32(requested: bool | None, device: torch.device) -> bool | None:
    """``--tf32``/``--no-tf32`` on a CUDA device: fp32 matrix multiplies and convolutions on TF32 tensor cores
    (10-bit mantissa, fp32 range and accumulation), as Megatron and nanoGPT train. Default: on for Ampere and
    newer (compute capability 8.0+), which have TF32 cores. Returns the setting in force (None off CUDA,
    where TF32 does not exist)."""
    if device.type != "cuda":
        return None
    enabled = torch.cuda.get_device_capability(device) >= (8, 0) if requested is None else requested
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # torch 2.9+: the new switches
        matmul.fp32_precision = conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    return enabled


class LossScaler:
    """Loss scaling for fp16 (Megatron's ``DynamicGradScaler`` semantics).

    Dynamic: the scale halves (not below ``min_scale``) after ``hysteresis`` overflowing steps
    and doubles after ``growth_interval`` clean steps in a row. Static (``dynamic=False``): the
    scale never changes. Either way a step whose gradients overflow is skipped.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        dynamic: bool = True,
    ) -> None:
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.dynamic = dynamic
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @classmethod
    def of(cls, cfg: PrecisionConfig) -> LossScaler:
        """The scaler the fp16 flags ask for: static with ``--loss-scale``, else dynamic."""
        if cfg.loss_scale is not None:
            return cls(initial_scale=cfg.loss_scale, dynamic=False)
        return cls(
            initial_scale=cfg.initial_loss_scale,
            min_scale=cfg.min_loss_scale,
            growth_interval=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
        )

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
