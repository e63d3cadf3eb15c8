"""Activation checkpointing (``--checkpoint-activations``): trade recomputation for activation memory.

Hugging Face models use their own switch (``activation_checkpointing_enable``), which checkpoints each
``GradientCheckpointingLayer``. Other modules get their transformer blocks (as their model spec declares them;
the largest ``ModuleList`` for a model no family claims) checkpointed with ``torch.utils.checkpoint``. The
block's ``forward`` is wrapped on the instance rather than the module replaced by a wrapper, so parameter names
and checkpoints stay unchanged.

Granularity ``full`` recomputes whole blocks; ``selective`` keeps the outputs of matrix multiplies and
attention and recomputes only the cheap elementwise ops, norms and dropout.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rapidlite.errors import ConfigError
from rapidlite.models.spec import find_blocks

_aten = torch.ops.aten
# Outputs worth keeping: the expensive ops. Everything else is recomputed in the backward pass.
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_kwargs(granularity: str) -> dict:
    kwargs = {"use_reentrant": False}
    if granularity == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    return kwargs


def _checkpointed_forward(forward, kwargs):
    @functools.wraps(forward)
    def run(*args, **fkwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **fkwargs)
        return checkpoint(forward, *args, **kwargs, **fkwargs)

    return run


def apply_activation_checkpointing(
    model: torch.nn.Module, granularity: str = "full", num_layers: int | None = None
) -> int:
    """Checkpoint the first ``num_layers`` blocks (all by default); returns how many were checkpointed."""
    kwargs = _checkpoint_kwargs(granularity)
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) and _is_layer(m)]
        for layer in layers[num_layers:] if num_layers is not None else []:
            layer.gradient_checkpointing = False
        return len(layers) if num_layers is None else min(num_layers, len(layers))
    blocks = find_blocks(model)
    if blocks is None:
        raise ConfigError(
            "--checkpoint-activations: the model has no stack of blocks (torch.nn.ModuleList) to "
            "checkpoint; call torch.utils.checkpoint in your model instead"
        )
    chosen = list(blocks)[:num_layers] if num_layers is not None else list(blocks)
    for block in chosen:
        block.forward = _checkpointed_forward(block.forward, kwargs)
    return len(chosen)


def _is_layer(module: torch.nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers without the layer base class: every flagged module is a layer
        return True
    return isinstance(module, GradientCheckpointingLayer)
