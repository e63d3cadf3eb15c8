"""The built-in GPT's architecture (``GPTConfig``): field names are Megatron's flags, so ``GPTConfig.of`` reads
the command line and ``config.json`` round-trips it. With ``num_experts`` the blocks' MLPs are mixtures of
experts (``rapidlite.models.gpt_moe``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from rapidlite.config.moe import LOAD_BALANCING_TYPES
from rapidlite.config.settings import Sections
from rapidlite.errors import ConfigError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class GPTConfig:
    """Architecture of a ``GPTModel``; field names are Megatron's flags (``num_layers`` is ``--num-layers``)."""

    vocab_size: int  # the tokenizer's; the embedding has padded_vocab_size rows
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden, or with SwiGLU int(8 * hidden / 3) rounded up to 64
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # None: seq_length
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    untie_embeddings_and_output_weights: bool = False
    bias: bool = True  # biases in linear layers and LayerNorm (LLaMA-style models have none)
    # A mixture of experts in every block (None: a dense MLP); see rapidlite.models.gpt_moe.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_enable_expert_bias: bool = False
    moe_grouped_gemm: bool = False
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = -(-(8 * self.hidden_size // 3) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self.validate()

    def validate(self) -> None:
        """Raise ``ConfigError`` (one line naming the flag) for an inconsistent configuration."""
        positive = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")
        positive += ("seq_length", "max_position_embeddings", "make_vocab_size_divisible_by")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: must be a positive integer")
        for name in ("init_method_std", "layernorm_epsilon", "rotary_base"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: must be positive")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: must be in [0, 1)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization {self.normalization}: choose LayerNorm or RMSNorm")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(
                f"--position-embedding-type {self.position_embedding_type}: choose learned_absolute or rope"
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"--position-embedding-type rope needs an even head size; --hidden-size {self.hidden_size} / "
                f"--num-attention-heads {self.num_attention_heads} = {self.head_dim}"
            )
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )

        if self.num_experts is not None:
            self._validate_experts()

    def _validate_experts(self) -> None:
        for name in ("num_experts", "moe_ffn_hidden_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: must be a positive integer")
        if not 0 < self.moe_router_topk <= self.num_experts:
            raise ConfigError(
                f"--moe-router-topk {self.moe_router_topk}: must be between 1 and --num-experts {self.num_experts}"
            )
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ConfigError(
                f"--moe-router-load-balancing-type {self.moe_router_load_balancing_type}: choose "
                + ", ".join(LOAD_BALANCING_TYPES)
            )

    @property
    def num_experts_per_tok(self) -> int:
        """The router's top-k, under Hugging Face's name (``MoELayout.top_k``)."""
        return self.moe_router_topk

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by`` (Megatron)."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, settings: Sections, vocab_size: int) -> GPTConfig:
        """The architecture the flags describe (``--num-layers``, ``--hidden-size``, ...), with rapidlite's
        defaults for what they leave open."""
        m, moe, seq_length = settings.model, settings.moe, settings.data.seq_length
        hidden = m.hidden_size or 256
        return cls(
            vocab_size=vocab_size,
            num_layers=m.num_layers or 4,
            hidden_size=hidden,
            num_attention_heads=m.num_attention_heads or max(1, hidden // 64),
            ffn_hidden_size=m.ffn_hidden_size,
            seq_length=seq_length,
            max_position_embeddings=m.max_position_embeddings or seq_length,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
            init_method_std=m.init_method_std,
            hidden_dropout=0.1 if m.hidden_dropout is None else m.hidden_dropout,
            attention_dropout=0.1 if m.attention_dropout is None else m.attention_dropout,
            normalization=m.normalization,
            swiglu=m.swiglu,
            position_embedding_type=m.position_embedding_type,
            untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            rotary_base=m.rotary_base or 10000.0,
            bias=not m.disable_bias_linear,
            num_experts=moe.num_experts,
            moe_router_topk=moe.moe_router_topk,
            moe_ffn_hidden_size=moe.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
            moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
            moe_grouped_gemm=moe.moe_grouped_gemm,
            moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
            moe_token_drop_policy=moe.moe_token_drop_policy,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from ``to_dict`` output; unknown keys (such as ``model_type``) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
