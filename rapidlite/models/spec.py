"""Model specs: what rapidlite needs to know about a model family, declared once per family.

A ``ModelSpec`` names a family's transformer blocks (the units of activation checkpointing, ``torch.compile``
and FSDP wrapping), the config keys of its sizes and dropout rates (what ``--num-layers``, ``--hidden-size``,
``--hidden-dropout``, ... override) and its default LoRA target modules. ``spec_of(model)`` and
``spec_for_config(config)`` look a family up once, by the built-in GPT's class or a Hugging Face config's
``model_type``; other modules ask the spec instead of testing class names. A model no family claims gets
the generic spec: blocks are its largest ``ModuleList``, the usual config key names apply.

Adding a family is one ``register(ModelSpec(...))`` call here (or in the family's own model file).
This module imports nothing from ``rapidlite.parallel``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

# --num-layers / --hidden-size / --num-attention-heads / --ffn-hidden-size → a config's attribute names
GENERIC_SIZE_KEYS: Mapping[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
}
GENERIC_HIDDEN_DROPOUT_KEYS = ("hidden_dropout_prob", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout")
GENERIC_ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def _stack(module: nn.Module | None) -> Sequence[nn.Module] | None:
    """The blocks of a layer stack: a ``ModuleList`` (itself), or the ``ModuleDict`` keyed by layer index that a
    pipeline stage keeps of it (its blocks, in order)."""
    if isinstance(module, nn.ModuleList) and len(module) > 0:
        return module
    if isinstance(module, nn.ModuleDict) and len(module) > 0 and all(k.isdigit() for k in module):
        return list(module.values())
    return None


def largest_stack(model: nn.Module) -> Sequence[nn.Module] | None:
    """The generic guess: the model's largest stack of blocks by parameter count."""
    best, best_size = None, 0
    for module in model.modules():
        blocks = _stack(module)
        if blocks is not None:
            size = sum(p.numel() for block in blocks for p in block.parameters())
            if size > best_size:
                best, best_size = blocks, size
    return best


def _path(*names: str) -> Callable[[nn.Module], list[nn.Module] | None]:
    """Blocks at an attribute path (e.g. ``model.layers``), falling back to the generic guess when a head class
    keeps them elsewhere."""

    def blocks(model: nn.Module) -> Sequence[nn.Module] | None:
        module: Any = model
        for name in names:
            module = getattr(module, name, None)
        return _stack(module) or largest_stack(model)

    return blocks


@dataclass(frozen=True)
class ModelSpec:
    """One model family. ``model_types``: the Hugging Face ``config.model_type`` values it covers (none for
    rapidlite's own models, matched by ``matches``)."""

    family: str
    blocks: Callable[[nn.Module], list[nn.Module] | None] = largest_stack
    model_types: tuple[str, ...] = ()
    matches: Callable[[nn.Module], bool] | None = None
    size_keys: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(GENERIC_SIZE_KEYS))
    hidden_dropout_keys: tuple[str, ...] = GENERIC_HIDDEN_DROPOUT_KEYS
    attention_dropout_keys: tuple[str, ...] = GENERIC_ATTENTION_DROPOUT_KEYS
    lora_targets: tuple[str, ...] = ()  # default LoRA target modules; empty: every linear layer


_REGISTRY: list[ModelSpec] = []
GENERIC = ModelSpec(family="generic")


def register(spec: ModelSpec) -> ModelSpec:
    _REGISTRY.append(spec)
    return spec


def spec_for_config(config: Any) -> ModelSpec:
    """The family of a Hugging Face config (by ``model_type``), else the generic spec."""
    model_type = getattr(config, "model_type", None)
    return next((s for s in _REGISTRY if model_type in s.model_types), GENERIC)


def spec_of(model: nn.Module) -> ModelSpec:
    """The family of a model: rapidlite's own by class, a Hugging Face model by its config, else generic."""
    for spec in _REGISTRY:
        if spec.matches is not None and spec.matches(model):
            return spec
    return spec_for_config(getattr(model, "config", None))


def find_blocks(model: nn.Module) -> Sequence[nn.Module] | None:
    """The model's transformer blocks, as its family declares them."""
    return spec_of(model).blocks(model)


def _bert_blocks(model: nn.Module) -> Sequence[nn.Module] | None:
    encoder = getattr(getattr(model, "base_model", model), "encoder", None)
    return _stack(getattr(encoder, "layer", None)) or largest_stack(model)


def _is_builtin_gpt(model: nn.Module) -> bool:
    from rapidlite.models.gpt import GPTModel

    return isinstance(model, GPTModel)


register(
    ModelSpec(
        family="gpt",
        matches=_is_builtin_gpt,
        blocks=_path("layers"),
        size_keys={
            "num_layers": ("num_layers",),
            "hidden_size": ("hidden_size",),
            "num_attention_heads": ("num_attention_heads",),
            "ffn_hidden_size": ("ffn_hidden_size",),
        },
        hidden_dropout_keys=("hidden_dropout",),
        attention_dropout_keys=("attention_dropout",),
        lora_targets=("q_proj", "k_proj", "v_proj", "out_proj", "up_proj", "gate_proj", "down_proj"),
    )
)
register(
    ModelSpec(
        family="llama",  # LLaMA-style decoders: model.layers of self_attn + mlp with gated projections
        model_types=("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2"),
        blocks=_path("model", "layers"),
        hidden_dropout_keys=("hidden_dropout", "dropout"),
        attention_dropout_keys=("attention_dropout",),
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
)
register(
    ModelSpec(
        family="gpt2",
        model_types=("gpt2",),
        blocks=_path("transformer", "h"),
        size_keys={
            "num_layers": ("n_layer",),
            "hidden_size": ("n_embd",),
            "num_attention_heads": ("n_head",),
            "ffn_hidden_size": ("n_inner",),
        },
        hidden_dropout_keys=("resid_pdrop", "embd_pdrop"),
        attention_dropout_keys=("attn_pdrop",),
        lora_targets=("c_attn", "c_proj", "c_fc"),
    )
)
register(
    ModelSpec(
        family="bert",
        model_types=("bert", "roberta", "xlm-roberta"),
        blocks=_bert_blocks,
        hidden_dropout_keys=("hidden_dropout_prob",),
        attention_dropout_keys=("attention_probs_dropout_prob",),
        lora_targets=("query", "key", "value", "dense"),
    )
)
