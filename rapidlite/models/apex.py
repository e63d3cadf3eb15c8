"""NVIDIA Apex's fused kernels: used where they apply when Apex is installed, never required.

The package named ``apex`` on PyPI is an unrelated web toolkit, so Apex is recognised by the two modules
rapidlite uses, ``apex.optimizers.FusedAdam`` and ``apex.normalization.FusedLayerNorm``, not by its name.
Without them every path is torch's, silently: torch's own AdamW is already fused on CUDA and its CUDA
``layer_norm`` is a fused kernel too, so Apex is a bonus, not a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ApexKernels:
    """The Apex classes rapidlite can use."""

    fused_adam: type[Any]  # apex.optimizers.FusedAdam
    fused_layer_norm: type[Any]  # apex.normalization.FusedLayerNorm


def nvidia_apex() -> ApexKernels | None:
    """NVIDIA Apex's FusedAdam and FusedLayerNorm, or None when they do not import.

    Not cached: callers ask once per optimizer or norm and only for CUDA parameters, and a later install (or a
    test's stand-in module) is seen. An Apex built without its CUDA extensions imports but fails when a kernel
    is constructed; callers fall back to torch then."""
    try:
        from apex.normalization import FusedLayerNorm
        from apex.optimizers import FusedAdam
    except Exception:  # ImportError, or whatever an unrelated package named apex raises on import
        return None
    return ApexKernels(fused_adam=FusedAdam, fused_layer_norm=FusedLayerNorm)
