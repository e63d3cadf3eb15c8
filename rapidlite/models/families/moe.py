"""Hugging Face mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS.

Their blocks are LLaMA-style (``model.layers`` of ``self_attn`` + ``mlp``) with a routed ``mlp``: a router
(``mlp.gate``, GPT-OSS's ``mlp.router``) and the experts, which transformers 5 keeps as 3-D tensors
(``mlp.experts.gate_up_proj`` ``[experts, ., .]`` and ``down_proj``), beside shared experts in Qwen2-MoE and
DeepSeek-V3. The default LoRA targets are the attention projections, the dense and shared MLPs' linear layers,
and the experts' tensors (``experts``: peft's ``target_parameters``). Tensor and pipeline parallelism are not
built for them (refused in one line).
"""

from __future__ import annotations

from rapidlite.models.spec import EXPERTS, ModelSpec, MoELayout, blocks_at, register

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek-V3's latent attention
_MLP = ("gate_proj", "up_proj", "down_proj")  # dense layers and shared experts


def _family(family: str, model_types: tuple[str, ...], layout: MoELayout, attention=_ATTENTION) -> ModelSpec:
    return register(
        ModelSpec(
            family=family,
            model_types=model_types,
            blocks=blocks_at("model", "layers"),
            hidden_dropout_keys=("hidden_dropout", "dropout"),
            attention_dropout_keys=("attention_dropout",),
            lora_targets=(*attention, *_MLP, EXPERTS),
            moe=layout,
        )
    )


MIXTRAL = _family("mixtral", ("mixtral",), MoELayout())
QWEN2_MOE = _family("qwen2_moe", ("qwen2_moe",), MoELayout(shared=("shared_expert", "shared_expert_gate")))
QWEN3_MOE = _family("qwen3_moe", ("qwen3_moe",), MoELayout())
OLMOE = _family("olmoe", ("olmoe",), MoELayout())
DEEPSEEK_V3 = _family("deepseek_v3", ("deepseek_v3",), MoELayout(shared=("shared_experts",)), attention=_MLA)
GPT_OSS = _family("gpt_oss", ("gpt_oss",), MoELayout(router="router", gated_experts=False))  # clamped, biased
