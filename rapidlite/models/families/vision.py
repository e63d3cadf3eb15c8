"""Vision-language families (transformers' ``AutoModelForImageTextToText``): an image encoder, a projector into
the language model's embeddings, and a LLaMA-style language model whose blocks are what checkpointing, FSDP
wrapping and LoRA's default targets act on. Tensor and pipeline parallelism are not built for them (refused in
one line); the language model's sizes are read from the config's ``text_config``."""

from __future__ import annotations

from typing import Any

from rapidlite.models.spec import ModelSpec, VisionLayout, blocks_at, register

# The language model's attention and MLP projections (LLaMA-, Qwen2- and Gemma-style).
_LANGUAGE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _text_dims(config: Any) -> tuple[int | None, int | None]:
    text = getattr(config, "text_config", None) or config
    return getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)


def _family(name: str, model_types: tuple[str, ...], layout: VisionLayout) -> ModelSpec:
    return register(
        ModelSpec(
            family=name,
            model_types=model_types,
            blocks=blocks_at("model", layout.language_model, "layers"),
            flops_dims=_text_dims,
            lora_targets=_LANGUAGE_TARGETS,
            vision=layout,
        )
    )


# LLaVA 1.5 and NeXT, Gemma 3: a SigLIP/CLIP tower and a projector module beside the language model.
LLAVA = _family("llava", ("llava",), VisionLayout("vision_tower", ("multi_modal_projector",), "language_model"))
LLAVA_NEXT = _family(
    "llava_next",
    ("llava_next",),
    VisionLayout("vision_tower", ("multi_modal_projector", "image_newline"), "language_model"),
)
GEMMA3 = _family("gemma3", ("gemma3",), VisionLayout("vision_tower", ("multi_modal_projector",), "language_model"))
# Qwen2-VL and Qwen2.5-VL: the patch merger that projects into the language model sits inside the tower.
QWEN2_VL = _family(
    "qwen2_vl",
    ("qwen2_vl", "qwen2_5_vl"),
    VisionLayout("visual", ("visual.merger",), "language_model", projector_inside_tower=True),
)
# Idefics3 and SmolVLM: a SigLIP tower, a pixel-shuffle connector and the text model.
IDEFICS3 = _family("idefics3", ("idefics3", "smolvlm"), VisionLayout("vision_model", ("connector",), "text_model"))
