"""Tensor parallelism (``--tensor-model-parallel-size``) on DTensor, Megatron's layout.

Each model family declares its plan beside its model code (``ModelSpec.tensor_parallel``, in
``rapidlite/models/families/``; the layout and the building blocks are described in
``rapidlite.models.sharding``); this module applies the plan of the model's family, and a family without
one is refused with one line naming the families that have one. A model no family claims is split by the
column/row-wise plan its Hugging Face config declares, if any.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rapidlite.errors import ConfigError
from rapidlite.models.losses import loss_parallel_context, maybe_loss_parallel  # noqa: F401 (re-exported)
from rapidlite.models.spec import families_with, spec_of


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> torch.nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` by its family's plan."""
    spec = spec_of(model)
    if spec.tensor_parallel is None:
        raise ConfigError(
            f"--tensor-model-parallel-size: there is no tensor-parallel plan for {type(model).__name__} (the "
            f"{spec.family} model family); the families with one: {', '.join(families_with('tensor_parallel'))}"
        )
    spec.tensor_parallel(model, tp_mesh, sequence_parallel)
    return model


def backward_context() -> contextlib.AbstractContextManager:
    return loss_parallel_context()
