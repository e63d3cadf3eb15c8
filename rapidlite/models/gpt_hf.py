"""The built-in GPT in Hugging Face's own layouts, so ``transformers`` loads what rapidlite pretrains.

A ``GPTModel`` whose blocks are GPT-2's (LayerNorm with biases, GELU MLP, learned absolute positions) is
written as ``GPT2LMHeadModel``; one whose blocks are LLaMA's (RMSNorm, SwiGLU, rotary positions; linear
biases or none) as ``LlamaForCausalLM``, and as ``MixtralForCausalLM`` with experts (``--num-experts``, no
biases, no shared expert, no expert bias: the router and the experts' 3-D tensors keep their layout). Each
computes what the built-in model computes: the same weights (q/k/v fused and transposed into GPT-2's
``Conv1D`` layout), exact GELU, the same rotary angles (channel pairs ``(i, i + d/2)``, LLaMA's
``rotate_half``), the padded vocabulary kept (its rows get logits in all).
Other combinations have no Hugging Face counterpart: ``hf_layout`` says which, and ``hf_model`` refuses them
in one line.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from rapidlite.errors import ConfigError
from rapidlite.observe.logging import LOGGER_NAME

GPT2, LLAMA, MIXTRAL = "gpt2", "llama", "mixtral"
HF_CLASSES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM"}


def hf_layout(config: Any) -> str | None:
    """``"gpt2"``, ``"llama"``, ``"mixtral"`` or None: the Hugging Face architecture that computes what
    ``config`` builds."""
    learned = config.position_embedding_type == "learned_absolute"
    llama = config.normalization == "RMSNorm" and config.swiglu and not learned
    if config.num_experts:
        return MIXTRAL if llama and not config.bias and _plain_experts(config) else None
    if config.normalization == "LayerNorm" and not config.swiglu and learned and config.bias:
        return GPT2
    return LLAMA if llama else None


def _plain_experts(config: Any) -> bool:
    """Experts Mixtral has: routed only, chosen by their probabilities alone."""
    return not config.moe_shared_expert_intermediate_size and not config.moe_router_enable_expert_bias


def _why_not(config: Any) -> str:
    if config.num_experts:
        if not _plain_experts(config):
            extra = "a shared expert" if config.moe_shared_expert_intermediate_size else "an expert bias"
            return f"the built-in mixture of experts with {extra} has no Hugging Face layout (Mixtral's has neither)"
        return (
            "the built-in mixture of experts has Mixtral's Hugging Face layout with --normalization RMSNorm, "
            "--swiglu, --position-embedding-type rope and --disable-bias-linear only"
        )
    return (
        f"the built-in GPT with --normalization {config.normalization}, "
        f"{'--swiglu' if config.swiglu else 'a GELU MLP'}, --position-embedding-type "
        f"{config.position_embedding_type} and {'biases' if config.bias else 'no biases'} has no Hugging Face "
        "layout: GPT-2's is LayerNorm + GELU + learned_absolute + biases, LLaMA's is RMSNorm + --swiglu + rope"
    )


def hf_config(config: Any, special_tokens: dict[str, int] | None = None) -> Any:
    """The ``transformers`` config of the matching architecture (see ``hf_layout``)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    layout = hf_layout(config)
    # GPT2Config's defaults name GPT-2's own <|endoftext|> (50256): the tokenizer's ids or none.
    tokens = {"bos_token_id": None, "eos_token_id": None, **(special_tokens or {})}
    tied = not config.untie_embeddings_and_output_weights
    if layout == GPT2:
        return GPT2Config(
            vocab_size=config.padded_vocab_size,
            n_positions=config.max_position_embeddings,
            n_embd=config.hidden_size,
            n_layer=config.num_layers,
            n_head=config.num_attention_heads,
            n_inner=config.ffn_hidden_size,
            activation_function="gelu",  # exact GELU, as F.gelu
            resid_pdrop=config.hidden_dropout,
            embd_pdrop=config.hidden_dropout,
            attn_pdrop=config.attention_dropout,
            layer_norm_epsilon=config.layernorm_epsilon,
            initializer_range=config.init_method_std,
            tie_word_embeddings=tied,
            **tokens,
        )
    # LLaMA's blocks, and Mixtral's (the same but for their experts in place of the MLP).
    blocks = {
        "vocab_size": config.padded_vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": config.rotary_base,
        "attention_dropout": config.attention_dropout,
        "hidden_act": "silu",
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": tied,
        **tokens,
    }
    if layout == MIXTRAL:
        experts = {"num_local_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk}
        return MixtralConfig(intermediate_size=config.moe_ffn_hidden_size, **experts, **blocks)
    if layout == LLAMA:
        bias = {"attention_bias": config.bias, "mlp_bias": config.bias}
        return LlamaConfig(intermediate_size=config.ffn_hidden_size, **bias, **blocks)
    raise ConfigError(_why_not(config))


def _renamed(config: Any) -> list[tuple[str, str, bool]]:
    """``(built-in key, Hugging Face key, transposed)`` for every weight that maps one to one (all but GPT-2's
    fused q/k/v)."""
    layout = hf_layout(config)
    if layout is None:
        raise ConfigError(_why_not(config))
    pairs: list[tuple[str, str, bool]] = []
    if layout == GPT2:
        pairs += [("embedding.word_embeddings.weight", "transformer.wte.weight", False)]
        pairs += [("embedding.position_embeddings.weight", "transformer.wpe.weight", False)]
        per_layer = [("input_norm", "ln_1", False), ("mlp_norm", "ln_2", False)]
        # Conv1D keeps its weight as [in, out].
        per_layer += [("attention.out_proj", "attn.c_proj", True), ("mlp.up_proj", "mlp.c_fc", True)]
        per_layer += [("mlp.down_proj", "mlp.c_proj", True)]
        for i in range(config.num_layers):
            for mine, theirs, transposed in per_layer:
                for kind in ("weight", "bias"):
                    pairs.append((f"layers.{i}.{mine}.{kind}", f"transformer.h.{i}.{theirs}.{kind}", transposed))
        pairs += [(f"final_norm.{kind}", f"transformer.ln_f.{kind}", False) for kind in ("weight", "bias")]
    else:
        pairs += [("embedding.word_embeddings.weight", "model.embed_tokens.weight", False)]
        linear = [(f"attention.{p}_proj", f"self_attn.{p}_proj") for p in "qkv"]
        linear += [("attention.out_proj", "self_attn.o_proj")]
        if layout == MIXTRAL:  # the router and the experts' 3-D tensors, under the same layout
            linear += [("mlp.router", "mlp.gate")]
        else:
            linear += [(f"mlp.{p}_proj", f"mlp.{p}_proj") for p in ("gate", "up", "down")]
        kinds = ("weight", "bias") if config.bias else ("weight",)
        for i in range(config.num_layers):
            src, dst = f"layers.{i}.", f"model.layers.{i}."
            pairs += [(f"{src}{m}.{k}", f"{dst}{t}.{k}", False) for m, t in linear for k in kinds]
            if layout == MIXTRAL:
                pairs += [
                    (f"{src}mlp.experts.{t}", f"{dst}mlp.experts.{t}", False) for t in ("gate_up_proj", "down_proj")
                ]
            pairs += [(f"{src}input_norm.weight", f"{dst}input_layernorm.weight", False)]
            pairs += [(f"{src}mlp_norm.weight", f"{dst}post_attention_layernorm.weight", False)]
        pairs += [("final_norm.weight", "model.norm.weight", False)]
    if config.untie_embeddings_and_output_weights:  # tied: transformers stores the embedding once
        pairs += [("output.weight", "lm_head.weight", False)]
    return pairs


def _moved(tensor: torch.Tensor, transposed: bool) -> torch.Tensor:
    return tensor.t().contiguous() if transposed else tensor


def hf_state_dict(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The built-in model's full weights under the layout's keys (GPT-2: q/k/v fused and transposed)."""
    out = {theirs: _moved(state[mine], transposed) for mine, theirs, transposed in _renamed(config)}
    if hf_layout(config) == GPT2:
        for i in range(config.num_layers):
            qkv = [f"layers.{i}.attention.{p}_proj" for p in "qkv"]
            out[f"transformer.h.{i}.attn.c_attn.weight"] = _moved(torch.cat([state[f"{p}.weight"] for p in qkv]), True)
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[f"{p}.bias"] for p in qkv])
    return out


def hf_model(model: Any, special_tokens: dict[str, int] | None = None) -> Any:
    """A ``transformers`` causal LM of the matching architecture holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config(model.config, special_tokens))
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(hf_state_dict(model.config, state), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set()):
        raise RuntimeError(f"built-in GPT → {type(hf).__name__}: missing {missing}, unexpected {unexpected}")
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


# The built-in config rides along in the Hugging Face config, so GPTModel.from_pretrained rebuilds the model
# exactly (the tokenizer's vocabulary size under the padded one, its init and dropout settings).
CONFIG_KEY = "rapidlite_gpt"


def gpt_state_dict(config: Any, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_state_dict`` reversed: a Hugging Face export's weights under the built-in model's keys."""
    out = {mine: _moved(hf_state[theirs], transposed) for mine, theirs, transposed in _renamed(config)}
    if hf_layout(config) == GPT2:
        for i in range(config.num_layers):
            weights = hf_state[f"transformer.h.{i}.attn.c_attn.weight"].t().split(config.hidden_size)
            biases = hf_state[f"transformer.h.{i}.attn.c_attn.bias"].split(config.hidden_size)
            for p, weight, bias in zip("qkv", weights, biases, strict=True):
                out[f"layers.{i}.attention.{p}_proj.weight"] = weight.contiguous()
                out[f"layers.{i}.attention.{p}_proj.bias"] = bias
    out.setdefault("output.weight", out["embedding.word_embeddings.weight"])  # tied
    return out


def save_hf(model: Any, state: dict[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """Write ``model`` (a built-in GPT, its full weights ``state``) as the matching ``transformers`` model:
    ``config.json`` and ``model.safetensors``, which ``AutoModelForCausalLM.from_pretrained`` loads (and
    ``GPTModel.from_pretrained`` too)."""
    from safetensors.torch import save_file

    config = hf_config(model.config)
    config.architectures = [HF_CLASSES[hf_layout(model.config)]]
    setattr(config, CONFIG_KEY, model.config.to_dict())
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    tensors = hf_state_dict(model.config, {k: v.detach().cpu() for k, v in full.items()})
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip


def save_for_transformers(model: Any, state: dict[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """The export of a built-in GPT: Hugging Face's layout where one matches, else rapidlite's own format,
    said in one line."""
    if hf_layout(model.config) is None:
        logging.getLogger(LOGGER_NAME).warning(
            f"{_why_not(model.config)}: the export is rapidlite's own format (GPTModel.from_pretrained loads it)"
        )
        model.save_pretrained(directory, state_dict=state)
        return
    save_hf(model, state, directory)
