"""Mixed precision: which autocast dtype a device gets, and Megatron's dynamic loss scaler.

Weights and optimizer state stay fp32 ("master weights"); only the forward/backward math runs
in bf16/fp16 under ``torch.autocast``. fp16 needs loss scaling to keep small gradients
representable; bf16 has fp32's exponent range and does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch


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


def resolve_precision(precision: str, device: torch.device) -> Precision:
    """'auto' (``--mixed-precision``) takes bf16 where the device runs it natively, else fp16.

    On CPU, bf16 is the fast path (AVX-512 bf16 / AMX); fp16 autocast on CPU works but was
    measured ~17x slower than fp32, so it is never chosen automatically there.
    """
    device_type = device.type
    if precision == "auto":
        if device_type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16"
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return Precision(dtype=dtype, device_type=device_type)


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
    def from_args(cls, args: Any) -> LossScaler:
        if args.loss_scale is not None:
            return cls(initial_scale=args.loss_scale, dynamic=False)
        return cls(
            initial_scale=args.initial_loss_scale,
            min_scale=args.min_loss_scale,
            growth_interval=args.loss_scale_window,
            hysteresis=args.hysteresis,
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
