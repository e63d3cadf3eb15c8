"""The built-in GPT in Hugging Face's own layouts, so ``transformers`` loads what rapidlite pretrains.

A ``GPTModel`` whose blocks are GPT-2's (LayerNorm with biases, GELU MLP, learned absolute positions) is
written as ``GPT2LMHeadModel``; one whose blocks are LLaMA's (RMSNorm, SwiGLU, rotary positions; linear
biases or none) as ``LlamaForCausalLM``. Both compute what the built-in model computes: the same weights
(q/k/v fused and transposed into GPT-2's ``Conv1D`` layout), exact GELU, the same rotary angles (channel
pairs ``(i, i + d/2)``, LLaMA's ``rotate_half``), the padded vocabulary kept (its rows get logits in both).
Other combinations have no Hugging Face counterpart: ``hf_layout`` says which, and ``hf_model`` refuses them
in one line.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from rapidlite.errors import ConfigError
from rapidlite.logging import LOGGER_NAME

GPT2, LLAMA = "gpt2", "llama"
HF_CLASSES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM"}


def hf_layout(config: Any) -> str | None:
    """``"gpt2"``, ``"llama"`` or None: the Hugging Face architecture that computes what ``config`` builds."""
    learned = config.position_embedding_type == "learned_absolute"
    if config.normalization == "LayerNorm" and not config.swiglu and learned and config.bias:
        return GPT2
    if config.normalization == "RMSNorm" and config.swiglu and not learned:
        return LLAMA
    return None


def _why_not(config: Any) -> str:
    return (
        f"the built-in GPT with --normalization {config.normalization}, "
        f"{'--swiglu' if config.swiglu else 'a GELU MLP'}, --position-embedding-type "
        f"{config.position_embedding_type} and {'biases' if config.bias else 'no biases'} has no Hugging Face "
        "layout: GPT-2's is LayerNorm + GELU + learned_absolute + biases, LLaMA's is RMSNorm + --swiglu + rope"
    )


def hf_config(config: Any, special_tokens: dict[str, int] | None = None) -> Any:
    """The ``transformers`` config of the matching architecture (see ``hf_layout``)."""
    from transformers import GPT2Config, LlamaConfig

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
    if layout == LLAMA:
        return LlamaConfig(
            vocab_size=config.padded_vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.ffn_hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_attention_heads,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.layernorm_epsilon,
            rope_theta=config.rotary_base,
            attention_dropout=config.attention_dropout,
            attention_bias=config.bias,
            mlp_bias=config.bias,
            hidden_act="silu",
            initializer_range=config.init_method_std,
            tie_word_embeddings=tied,
            **tokens,
        )
    raise ConfigError(_why_not(config))


def hf_state_dict(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The built-in model's full weights renamed (and for GPT-2 fused and transposed) into the layout's keys.
    A tied output weight is left to the embedding, as ``transformers`` stores it."""
    layout = hf_layout(config)
    if layout is None:
        raise ConfigError(_why_not(config))
    out: dict[str, torch.Tensor] = {}
    tied = not config.untie_embeddings_and_output_weights
    if layout == GPT2:
        out["transformer.wte.weight"] = state["embedding.word_embeddings.weight"]
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        for i in range(config.num_layers):
            src, dst = f"layers.{i}.", f"transformer.h.{i}."
            for norm, hf_norm in (("input_norm", "ln_1"), ("mlp_norm", "ln_2")):
                for kind in ("weight", "bias"):
                    out[f"{dst}{hf_norm}.{kind}"] = state[f"{src}{norm}.{kind}"]
            qkv = [f"{src}attention.{p}_proj" for p in "qkv"]
            # Conv1D keeps [in, out]; q, k and v side by side along out.
            out[f"{dst}attn.c_attn.weight"] = torch.cat([state[f"{p}.weight"] for p in qkv]).t().contiguous()
            out[f"{dst}attn.c_attn.bias"] = torch.cat([state[f"{p}.bias"] for p in qkv])
            for mine, theirs in (("attention.out_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc")):
                out[f"{dst}{theirs}.weight"] = state[f"{src}{mine}.weight"].t().contiguous()
                out[f"{dst}{theirs}.bias"] = state[f"{src}{mine}.bias"]
            out[f"{dst}mlp.c_proj.weight"] = state[f"{src}mlp.down_proj.weight"].t().contiguous()
            out[f"{dst}mlp.c_proj.bias"] = state[f"{src}mlp.down_proj.bias"]
        out["transformer.ln_f.weight"] = state["final_norm.weight"]
        out["transformer.ln_f.bias"] = state["final_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
        for i in range(config.num_layers):
            src, dst = f"layers.{i}.", f"model.layers.{i}."
            pairs = [(f"attention.{p}_proj", f"self_attn.{p}_proj") for p in "qkv"]
            pairs += [("attention.out_proj", "self_attn.o_proj")]
            pairs += [(f"mlp.{p}_proj", f"mlp.{p}_proj") for p in ("gate", "up", "down")]
            for mine, theirs in pairs:
                for kind in ("weight", "bias") if config.bias else ("weight",):
                    out[f"{dst}{theirs}.{kind}"] = state[f"{src}{mine}.{kind}"]
            out[f"{dst}input_layernorm.weight"] = state[f"{src}input_norm.weight"]
            out[f"{dst}post_attention_layernorm.weight"] = state[f"{src}mlp_norm.weight"]
        out["model.norm.weight"] = state["final_norm.weight"]
    if not tied:
        out["lm_head.weight"] = state["output.weight"]
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
    layout = hf_layout(config)
    if layout is None:
        raise ConfigError(_why_not(config))
    out: dict[str, torch.Tensor] = {}
    h = config.hidden_size
    if layout == GPT2:
        out["embedding.word_embeddings.weight"] = hf_state["transformer.wte.weight"]
        out["embedding.position_embeddings.weight"] = hf_state["transformer.wpe.weight"]
        for i in range(config.num_layers):
            src, dst = f"transformer.h.{i}.", f"layers.{i}."
            for norm, hf_norm in (("input_norm", "ln_1"), ("mlp_norm", "ln_2")):
                for kind in ("weight", "bias"):
                    out[f"{dst}{norm}.{kind}"] = hf_state[f"{src}{hf_norm}.{kind}"]
            weights = hf_state[f"{src}attn.c_attn.weight"].t().split(h)
            biases = hf_state[f"{src}attn.c_attn.bias"].split(h)
            for p, weight, bias in zip("qkv", weights, biases, strict=True):
                out[f"{dst}attention.{p}_proj.weight"] = weight.contiguous()
                out[f"{dst}attention.{p}_proj.bias"] = bias
            for mine, theirs in (
                ("attention.out_proj", "attn.c_proj"),
                ("mlp.up_proj", "mlp.c_fc"),
                ("mlp.down_proj", "mlp.c_proj"),
            ):
                out[f"{dst}{mine}.weight"] = hf_state[f"{src}{theirs}.weight"].t().contiguous()
                out[f"{dst}{mine}.bias"] = hf_state[f"{src}{theirs}.bias"]
        out["final_norm.weight"] = hf_state["transformer.ln_f.weight"]
        out["final_norm.bias"] = hf_state["transformer.ln_f.bias"]
        embedding = out["embedding.word_embeddings.weight"]
    else:
        out["embedding.word_embeddings.weight"] = hf_state["model.embed_tokens.weight"]
        for i in range(config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            pairs = [(f"attention.{p}_proj", f"self_attn.{p}_proj") for p in "qkv"]
            pairs += [("attention.out_proj", "self_attn.o_proj")]
            pairs += [(f"mlp.{p}_proj", f"mlp.{p}_proj") for p in ("gate", "up", "down")]
            for mine, theirs in pairs:
                for kind in ("weight", "bias") if config.bias else ("weight",):
                    out[f"{dst}{mine}.{kind}"] = hf_state[f"{src}{theirs}.{kind}"]
            out[f"{dst}input_norm.weight"] = hf_state[f"{src}input_layernorm.weight"]
            out[f"{dst}mlp_norm.weight"] = hf_state[f"{src}post_attention_layernorm.weight"]
        out["final_norm.weight"] = hf_state["model.norm.weight"]
        embedding = out["embedding.word_embeddings.weight"]
    out["output.weight"] = hf_state.get("lm_head.weight", embedding)
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
            f"{_why_not(model.config)}: {directory} holds rapidlite's own format (GPTModel.from_pretrained loads it)"
        )
        model.save_pretrained(directory, state_dict=state)
        return
    save_hf(model, state, directory)
