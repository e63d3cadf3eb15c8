"""Mixture-of-experts flags: the router's losses and training, which every MoE model reads, and the built-in
GPT's experts, with Megatron's names (``--num-experts``, ``--moe-router-topk``, ...), which a Hugging Face
model takes from its ``config.json`` instead (``rapidlite.models.moe``, ``rapidlite.models.gpt_moe``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rapidlite.config.fields import flag
from rapidlite.config.sections import MOE
from rapidlite.errors import ConfigError

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
# Megatron's default weight of the load-balancing loss where the model names none (the built-in GPT).
BUILT_IN_AUX_COEFF = 1e-2


@dataclass(frozen=True)
class MoEConfig:
    """The router of a mixture-of-experts model: the losses added for it and whether it trains (any MoE model;
    a dense one refuses them), and the built-in GPT's experts (``--num-experts`` makes it an MoE)."""

    GROUP: ClassVar[str] = MOE

    moe_aux_loss_coeff: float | None = flag(
        None,
        "weight of the router's load-balancing loss in the training loss (default: the model config's "
        f"router_aux_loss_coef, the built-in GPT's {BUILT_IN_AUX_COEFF:g}; 0 turns it off)",
    )
    moe_z_loss_coeff: float = flag(
        0.0,
        "weight of the router z-loss (the squared log-sum-exp of the router logits, as ST-MoE) in the training loss",
    )
    freeze_router: bool = flag(
        False,
        "keep the router weights fixed in full fine-tuning (under LoRA the router is frozen unless "
        "--lora-target-modules names it)",
    )
    num_experts: int | None = flag(None, "built-in GPT: routed experts in each block's MLP (default: a dense MLP)")
    moe_router_topk: int = flag(2, "built-in GPT: experts each token is routed to")
    moe_ffn_hidden_size: int | None = flag(None, "built-in GPT: each expert's hidden size (default: --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "built-in GPT: hidden size of a shared expert every token goes through as well (default: none)"
    )
    moe_router_load_balancing_type: str = flag(
        "aux_loss",
        "built-in GPT: the load-balancing loss over each layer's tokens (aux_loss), over each sequence's "
        "(seq_aux_loss, DeepSeek-V3's), or none",
        choices=LOAD_BALANCING_TYPES,
    )
    moe_router_enable_expert_bias: bool = flag(
        False,
        "built-in GPT: balance the load without a loss: a per-expert bias added to the router's scores for the "
        "choice only, moved after each step towards the experts that got fewer tokens (DeepSeek-V3)",
    )
    moe_router_bias_update_rate: float = flag(1e-3, "built-in GPT: the expert bias's step per optimizer step")
    moe_grouped_gemm: bool = flag(
        False,
        "built-in GPT: all experts in one grouped matmul (torch._grouped_mm) where it runs, instead of one matmul "
        "per expert",
    )
    moe_token_dispatcher_type: str = flag(
        "alltoall", "built-in GPT: how tokens reach their experts' ranks", choices=("alltoall",)
    )
    moe_expert_capacity_factor: float | None = flag(
        None,
        "built-in GPT: each expert takes at most this factor times its even share of a training forward's "
        "(token, choice) pairs, the rest dropped and logged as moe/dropped_tokens (default: none dropped)",
    )
    moe_token_drop_policy: str = flag(
        "probs",
        "built-in GPT, with a capacity: drop the pairs of lowest routing probability (probs) or the latest tokens "
        "(position)",
        choices=("probs", "position"),
    )


def check_built_in_experts(ep: int, moe: MoEConfig) -> None:
    """The built-in GPT's experts that expert parallelism cannot split, before any process starts (a Hugging Face
    model's are checked once loaded: ``parallel.expert_parallel``)."""
    if ep <= 1:
        return
    flag = f"--expert-model-parallel-size {ep}"
    if moe.num_experts is None:
        raise ConfigError(f"{flag}: the built-in GPT is dense (no experts to split); add --num-experts N")
    if moe.num_experts % ep:
        raise ConfigError(f"{flag} does not divide the {moe.num_experts} experts of each layer (--num-experts)")


def check_expert_parallel(ep: int, tp: int, deepspeed: bool) -> None:
    """One line for a layout expert parallelism does not compose with (yet)."""
    if ep <= 1:
        return
    flag = f"--expert-model-parallel-size {ep}"
    if deepspeed:
        raise ConfigError(f"{flag}: DeepSpeed's engine does not split rapidlite's experts; drop --deepspeed")
    if tp > 1:
        raise ConfigError(
            f"{flag} with --tensor-model-parallel-size: not built; split the experts over data-parallel "
            "(and pipeline) ranks only"
        )


# The built-in GPT's architecture flags: a Hugging Face model's experts come from its config.json.
ARCHITECTURE = (
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_load_balancing_type",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_grouped_gemm",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
)


def check(moe: MoEConfig, given: frozenset[str], pretrained: str | None, tp: int) -> None:
    """One line for an MoE flag that cannot hold: a built-in architecture flag on a Hugging Face model or on a
    dense built-in GPT, a top-k above the expert count, a negative rate, tensor parallelism of the built-in MoE
    (not built)."""
    named = [name for name in ARCHITECTURE if name in given]
    if named and pretrained:
        raise ConfigError(
            f"--{named[0].replace('_', '-')} shapes the built-in GPT's experts; a Hugging Face model's come from "
            f"its config.json ({pretrained}): drop the flag"
        )
    if named and moe.num_experts is None and named != ["num_experts"]:
        raise ConfigError(f"--{named[0].replace('_', '-')}: the built-in GPT is dense; add --num-experts N")
    if moe.num_experts is None:
        return
    if moe.num_experts <= 0:
        raise ConfigError(f"--num-experts {moe.num_experts}: must be a positive integer")
    if not 0 < moe.moe_router_topk <= moe.num_experts:
        raise ConfigError(
            f"--moe-router-topk {moe.moe_router_topk}: must be between 1 and --num-experts {moe.num_experts}"
        )
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(moe, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    if tp > 1:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp}: the built-in GPT's experts (--num-experts) are not split that way; "
            "train it with data or pipeline parallelism and ZeRO (--zero-3-memory-optimization)"
        )
    factor = moe.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ConfigError(f"--moe-expert-capacity-factor {factor:g}: must be > 0 (leave it out to drop no token)")
    if "moe_token_drop_policy" in given and factor is None:
        raise ConfigError("--moe-token-drop-policy: no token is dropped without --moe-expert-capacity-factor")
    if moe.moe_router_bias_update_rate < 0:
        raise ConfigError(f"--moe-router-bias-update-rate {moe.moe_router_bias_update_rate:g}: must be >= 0")
