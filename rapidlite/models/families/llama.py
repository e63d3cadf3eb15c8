"""LLaMA-style Hugging Face decoders (LLaMA, Mistral, Qwen2/3, Gemma, Phi-3, OLMo): ``model.layers`` of
``self_attn`` + a gated MLP. Tensor parallelism follows the column/row-wise plan their configs declare;
pipeline stages are the decoder split of ``model.embed_tokens`` → ``model.layers`` → ``model.norm`` →
``lm_head``."""

from __future__ import annotations

from rapidlite.models.sharding import declared_plan
from rapidlite.models.spec import ModelSpec, blocks_at, register
from rapidlite.models.staging import DecoderSplit

# Phi-3 fuses the attention and MLP inputs (qkv_proj, gate_up_proj): without them its default would adapt only the
# output projections.
_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")

SPEC = register(
    ModelSpec(
        family="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2"),
        blocks=blocks_at("model", "layers"),
        hidden_dropout_keys=("hidden_dropout", "dropout"),
        attention_dropout_keys=("attention_dropout",),
        tensor_parallel=declared_plan,
        pipeline=DecoderSplit("model", "embed_tokens", "layers", "norm", pos=None, drop=None),
        lora_targets=(*_ATTENTION, *_MLP),
    )
)
