"""Model specs: what rapidlite needs to know about a model family, declared once per family.

A ``ModelSpec`` names a family's transformer blocks (the units of activation checkpointing, ``torch.compile``
and FSDP wrapping), the config keys of its sizes and dropout rates (what ``--num-layers``, ``--hidden-size``,
``--hidden-dropout``, ... override, and what the FLOPs formula reads), its tensor-parallel plan, its pipeline
split and its default LoRA target modules. ``spec_of(model)`` and ``spec_for_config(config)`` look a family up
once, by a match on rapidlite's own model classes or a Hugging Face config's ``model_type``; other modules ask
the spec instead of testing class names. A model no family claims gets the generic spec: blocks are its
largest ``ModuleList``, the usual config key names apply, tensor parallelism follows the column/row-wise plan
a Hugging Face config declares (refused with one line when it declares none), and there is no pipeline split.

The families themselves are declared in ``rapidlite/models/families/`` (one module each, registered when
``rapidlite.models`` is imported); a user's family is one ``register(ModelSpec(...))``. This module and the
family modules import nothing from ``rapidlite.parallel``: the building blocks the plans are written with
are ``rapidlite.models.sharding`` (tensor parallelism) and ``rapidlite.models.staging`` (pipeline splits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from rapidlite.models.sharding import declared_plan

if TYPE_CHECKING:
    from rapidlite.models.staging import PipelineSplit

# A tensor-parallel plan shards a model in place: ``plan(model, tp_mesh, sequence_parallel)``. It covers every
# part a pipeline stage may hold (absent parts are None) and refuses what it cannot split with a ConfigError.
TensorParallelPlan = Callable[[nn.Module, Any, bool], None]

# --num-layers / --hidden-size / --num-attention-heads / --ffn-hidden-size → a config's attribute names
GENERIC_SIZE_KEYS: Mapping[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
}
GENERIC_HIDDEN_DROPOUT_KEYS = ("hidden_dropout_prob", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout")
GENERIC_ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def layer_stack(module: nn.Module | None) -> Sequence[nn.Module] | None:
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
        blocks = layer_stack(module)
        if blocks is not None:
            size = sum(p.numel() for block in blocks for p in block.parameters())
            if size > best_size:
                best, best_size = blocks, size
    return best


def blocks_at(*names: str) -> Callable[[nn.Module], Sequence[nn.Module] | None]:
    """Blocks at an attribute path (e.g. ``model.layers``), falling back to the generic guess when a head class
    keeps them elsewhere."""

    def blocks(model: nn.Module) -> Sequence[nn.Module] | None:
        module: Any = model
        for name in names:
            module = getattr(module, name, None)
        return layer_stack(module) or largest_stack(model)

    return blocks


# --lora-target-modules' name of a mixture of experts' 3-D expert tensors (peft's target_parameters)
EXPERTS = "experts"


@dataclass(frozen=True)
class MoELayout:
    """Where a mixture-of-experts family keeps its routed parts, inside each block's ``mlp`` (a block without
    them, DeepSeek-V3's first dense layers, is dense): the ``router`` (its output is ``(logits [tokens, experts],
    weights, chosen experts)``), the ``experts`` module and its 3-D ``expert_parameters`` (``[experts, ., .]``),
    and the ``shared`` experts every token goes through. ``default_aux_coeff``: the load-balancing weight when
    the config names none (DeepSeek-V3 balances by its routers' bias instead). ``per_layer``: the losses are
    Megatron's (each routed layer's, its token shares over the top-k, summed over layers; the config's
    ``moe_router_load_balancing_type``), not transformers' (one over the tokens of every layer together).
    ``gated_experts``: each expert is ``act(gate) * up`` then ``down`` on ``gate_up_proj`` (gate rows first)
    and ``down_proj``, without biases, ``act`` its ``act_fn`` (all of transformers' families but GPT-OSS), which
    is how expert parallelism computes a Hugging Face model's experts."""

    router: str = "gate"
    experts: str = "experts"
    expert_parameters: tuple[str, ...] = ("gate_up_proj", "down_proj")
    shared: tuple[str, ...] = ()
    default_aux_coeff: float = 0.0
    per_layer: bool = False
    gated_experts: bool = True

    @staticmethod
    def num_experts(config: Any) -> int:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        raise ValueError(f"{type(config).__name__} names no expert count")

    @staticmethod
    def top_k(config: Any) -> int:
        return int(config.num_experts_per_tok)

    def aux_coeff(self, config: Any) -> float:
        value = getattr(config, "router_aux_loss_coef", None)
        return float(value) if value is not None else self.default_aux_coeff

    @staticmethod
    def balancing(config: Any) -> str:
        """``aux_loss``, ``seq_aux_loss`` or ``none`` (the built-in GPT's flag; transformers' families: aux_loss)."""
        return getattr(config, "moe_router_load_balancing_type", "aux_loss")

    def routes(self, config: Any) -> bool:
        """Whether a model of the family with this config has experts (the built-in GPT may be dense)."""
        try:
            return self.num_experts(config) > 0
        except ValueError:
            return False


@dataclass(frozen=True)
class VisionLayout:
    """Where a vision-language family keeps its parts, as qualified module names: the vision ``tower`` (the
    image encoder), the ``projector`` into the language model's embeddings (a module, or parameters such as
    LLaVA-NeXT's ``image_newline``) and the ``language_model`` (its blocks are the family's ``blocks``).
    ``projector_inside_tower``: the projector is a child of the tower (Qwen2-VL's ``visual.merger``), so the
    tower's parameters are those under ``tower`` outside ``projector``."""

    tower: str
    projector: tuple[str, ...]
    language_model: str
    projector_inside_tower: bool = False

    def part(self, name: str) -> str:
        """``tower``, ``projector`` or ``language`` (the language model and the output head): the part a
        parameter of the model (qualified name, a peft wrapper's prefix allowed) belongs to."""
        dotted = f".{name}"
        if any(f".{p}." in dotted or dotted.endswith(f".{p}") for p in self.projector):
            return "projector"
        if f".{self.tower}." in dotted:
            return "tower"
        return "language"


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    - ``model_types``: the Hugging Face ``config.model_type`` values it covers; ``matches``: a test for
      rapidlite's own model classes (which have no ``model_type``).
    - ``blocks``: the model's transformer blocks, in order.
    - ``size_keys``: ``--num-layers``/``--hidden-size``/... → the config attributes they set, the first of which
      holding an int is read back for the FLOPs formula (``flops_dims`` overrides that reading).
    - ``tensor_parallel``: the plan (None: ``--tensor-model-parallel-size`` is refused for the family).
    - ``pipeline``: the split into stages (None: ``--pipeline-model-parallel-size`` is refused).
    - ``lora_targets``: default LoRA target modules; empty: every linear layer.
    - ``save``: writes the model's full weights as a Hugging Face model directory, for the export
      (``save(model, state_dict, directory)``); None: the model's own ``save_pretrained`` does.
    - ``moe``: where a mixture-of-experts family keeps its router and experts (None: a dense family).
    - ``vision``: where a vision-language family keeps its image encoder, projector and language model (None:
      a text-only family).
    """

    family: str
    blocks: Callable[[nn.Module], Sequence[nn.Module] | None] = largest_stack
    model_types: tuple[str, ...] = ()
    matches: Callable[[nn.Module], bool] | None = None
    size_keys: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(GENERIC_SIZE_KEYS))
    hidden_dropout_keys: tuple[str, ...] = GENERIC_HIDDEN_DROPOUT_KEYS
    attention_dropout_keys: tuple[str, ...] = GENERIC_ATTENTION_DROPOUT_KEYS
    tensor_parallel: TensorParallelPlan | None = None
    pipeline: PipelineSplit | None = None
    flops_dims: Callable[[Any], tuple[int | None, int | None]] | None = None
    lora_targets: tuple[str, ...] = ()
    save: Callable[[nn.Module, dict[str, Any], str], None] | None = None
    moe: MoELayout | None = None
    vision: VisionLayout | None = None

    def layers_and_hidden(self, config: Any) -> tuple[int | None, int | None]:
        """(layers, hidden size) of the FLOPs formula's attention term, from a model's config (None where the
        config has no such int)."""
        if config is None:
            return None, None
        if self.flops_dims is not None:
            return self.flops_dims(config)

        def first_int(flag: str) -> int | None:
            values = (getattr(config, key, None) for key in self.size_keys.get(flag, ()))
            return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)

        return first_int("num_layers"), first_int("hidden_size")


_REGISTRY: list[ModelSpec] = []
GENERIC = ModelSpec(
    family="generic",
    # T5/BART-style and GPT-Neo-style configs name them so (GPT-2's names are the generic defaults).
    size_keys={
        **GENERIC_SIZE_KEYS,
        "num_layers": (*GENERIC_SIZE_KEYS["num_layers"], "num_layers"),
        "hidden_size": (*GENERIC_SIZE_KEYS["hidden_size"], "d_model"),
    },
    tensor_parallel=declared_plan,
)


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family; lookups try families in registration order. A second family of the same name is refused
    (a bug in the declarations, not a user error)."""
    if any(known.family == spec.family for known in _REGISTRY) or spec.family == GENERIC.family:
        raise ValueError(f"a model family named {spec.family!r} is already registered")
    _REGISTRY.append(spec)
    return spec


def families_with(capability: str) -> list[str]:
    """The registered families that declare ``capability`` (a ``ModelSpec`` field, e.g. ``"pipeline"``), for
    the one-line refusals."""
    return [spec.family for spec in _REGISTRY if getattr(spec, capability) is not None]


def spec_for_config(config: Any) -> ModelSpec:
    """The family of a Hugging Face config (by ``model_type``), else the generic spec."""
    model_type = getattr(config, "model_type", None)
    return next((s for s in _REGISTRY if model_type in s.model_types), GENERIC)


def spec_of(model: nn.Module) -> ModelSpec:
    """The family of a model: rapidlite's own by class, a Hugging Face model by its config, else generic. A
    peft wrapper (LoRA) is looked through to the model it adapts."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and type(model).__module__.startswith("peft."):
        model = base()
    for spec in _REGISTRY:
        if spec.matches is not None and spec.matches(model):
            return spec
    return spec_for_config(getattr(model, "config", None))


def moe_layout(model: nn.Module) -> MoELayout | None:
    """The mixture-of-experts layout of ``model`` (None: a dense model, of a dense family or not)."""
    layout = spec_of(model).moe
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return layout if layout is not None and layout.routes(getattr(base, "config", None)) else None


def find_blocks(model: nn.Module) -> Sequence[nn.Module] | None:
    """The model's transformer blocks, as its family declares them."""
    return spec_of(model).blocks(model)
