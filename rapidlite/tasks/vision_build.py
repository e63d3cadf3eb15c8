"""Tiny vision-language models built from their configs, with processors put together in code: the embedded
vision demo's model, and what the tests train. Nothing is downloaded.

``tiny_processor(family, words)`` is a word-level tokenizer over ``words`` (a ChatML chat template that renders
image items as the family's image token) joined to the family's image processor at a small image size;
``tiny_config(family, processor, **sizes)`` is the family's config with a LLaMA-style language model of the given
sizes and a two-layer vision encoder. Families: ``llava`` (CLIP tower, LLaVA 1.5's projector), ``llava_next`` (any
resolution), ``qwen2_vl``, ``qwen2_5_vl`` (windowed attention) and ``gemma3`` (SigLIP, one pooled token an image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")
SPECIALS = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
IMAGE_TOKENS = {
    "llava": ("<image>",),
    "llava_next": ("<image>",),
    "qwen2_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"),
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
}
# Gemma 3's processor finds its image tokens by these names on the tokenizer.
NAMED_TOKENS = {
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
}
ROLES = ("system", "user", "assistant")
# ChatML with content lists: an image item is the family's image text, a text item its text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE {% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
IMAGE_TEXT = {
    "llava": "<image>",
    "llava_next": "<image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}
IMAGE_SIDE = 28  # pixels: LLaVA's crop, and Qwen2-VL's smallest image (2 x 2 patches of 14, one merged token)


def tiny_tokenizer(family: str, words: Sequence[str]) -> Any:
    """A word-level fast tokenizer over ``words`` and the chat roles, with the family's image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIALS, *IMAGE_TOKENS[family]]
    vocab = {w: i for i, w in enumerate([*specials, *ROLES, *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # word-level: tokens joined by spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=specials[2:],
        model_max_length=4096,
        **({"extra_special_tokens": NAMED_TOKENS[family]} if family in NAMED_TOKENS else {}),
    )


def tiny_processor(family: str, words: Sequence[str], image_side: int = IMAGE_SIDE) -> Any:
    """The family's processor over ``tiny_tokenizer`` at ``image_side``-pixel images."""
    import transformers

    from rapidlite.models.vision import _without_video_processor, keep

    tokenizer = tiny_tokenizer(family, words)
    template = CHAT_TEMPLATE.replace("IMAGE", IMAGE_TEXT[family])
    if family in ("llava", "llava_next"):  # LLaVA-NeXT: any resolution, a base crop and up to 2 x 2 tiles
        crop = {"size": {"shortest_edge": image_side}, "crop_size": {"height": image_side, "width": image_side}}
        if family == "llava":
            image_processor, cls = transformers.CLIPImageProcessor(**crop), transformers.LlavaProcessor
        else:
            tiles = [[image_side * h, image_side * w] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))]
            image_processor = transformers.LlavaNextImageProcessor(**crop, image_grid_pinpoints=tiles)
            cls = transformers.LlavaNextProcessor
        return cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    if family in ("qwen2_vl", "qwen2_5_vl"):
        image_processor = transformers.Qwen2VLImageProcessor(
            min_pixels=image_side * image_side, max_pixels=4 * image_side * image_side
        )
        cls = transformers.Qwen2VLProcessor if family == "qwen2_vl" else transformers.Qwen2_5_VLProcessor
        with _without_video_processor():
            processor = cls(
                image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template
            )
        return keep(processor)
    if family == "gemma3":  # SigLIP at image_side, pooled to one token an image
        image_processor = transformers.Gemma3ImageProcessor(size={"height": image_side, "width": image_side})
        return transformers.Gemma3Processor(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_length=1, chat_template=template
        )
    raise ValueError(f"no tiny {family}; families: {', '.join(FAMILIES)}")


def config_kwargs(
    family: str, processor: Any, hidden: int = 64, layers: int = 2, heads: int = 4, vision_width: int = 32, **text: Any
) -> dict:
    """The family config's arguments: a LLaMA-style (Qwen2-style) language model of these sizes and a two-layer
    vision encoder ``vision_width`` wide, token ids from ``processor``."""
    tokenizer = processor.tokenizer
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    language = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "max_position_embeddings": 1024,
        **ids,
        **text,
    }
    token = tokenizer.convert_tokens_to_ids
    if family in ("llava", "llava_next"):
        vision = {
            "model_type": "clip_vision_model", "hidden_size": vision_width, "intermediate_size": 2 * vision_width,
            "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SIDE, "patch_size": 14,
            "projection_dim": vision_width,
        }  # fmt: skip
        grid = (
            {"image_grid_pinpoints": processor.image_processor.image_grid_pinpoints} if family == "llava_next" else {}
        )
        return {
            "vision_config": vision,
            "text_config": {"model_type": "llama", **language},
            "image_token_index": token("<image>"),
            "vision_feature_layer": -1,
            "projector_hidden_act": "gelu",
            **grid,
            **ids,
        }
    if family == "gemma3":
        vision = {
            "hidden_size": vision_width, "intermediate_size": 2 * vision_width, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": IMAGE_SIDE, "patch_size": 14,
        }  # fmt: skip
        return {
            "text_config": {**language, "head_dim": hidden // heads},
            "vision_config": vision,
            "mm_tokens_per_image": 1,
            "boi_token_index": token("<start_of_image>"),
            "eoi_token_index": token("<end_of_image>"),
            "image_token_index": token("<image_soft_token>"),
            **ids,
        }
    head_dim = hidden // heads
    section = [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 2 - head_dim // 8 - head_dim // 8 * 3 // 2]
    language["rope_scaling"] = {"type": "mrope", "mrope_section": section}
    vision = {
        "depth": 2, "embed_dim": vision_width, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2, "in_channels": 3,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    if family == "qwen2_5_vl":  # windowed attention in the first block, full in the second
        vision = {
            "depth": 2, "hidden_size": vision_width, "intermediate_size": 2 * vision_width, "num_heads": 2,
            "out_hidden_size": hidden, "fullatt_block_indexes": [1], "window_size": 56, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        }  # fmt: skip
    return {
        "text_config": language,
        "vision_config": vision,
        "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "vision_start_token_id": token("<|vision_start|>"),
        "vision_end_token_id": token("<|vision_end|>"),
        **ids,
    }


CONFIG_CLASSES = {
    "llava": "LlavaConfig",
    "llava_next": "LlavaNextConfig",
    "qwen2_vl": "Qwen2VLConfig",
    "qwen2_5_vl": "Qwen2_5_VLConfig",
    "gemma3": "Gemma3Config",
}


def tiny_config(family: str, processor: Any, **sizes: Any) -> Any:
    """The family's config (``config_kwargs``)."""
    import transformers

    return getattr(transformers, CONFIG_CLASSES[family])(**config_kwargs(family, processor, **sizes))


def save_tiny_vlm(
    directory: Any, family: str, words: Sequence[str], seed: int = 0, image_side: int = IMAGE_SIDE, **sizes: Any
) -> Any:
    """A randomly initialised tiny model of ``family`` with its processor (``image_side``: ``tiny_processor``'s),
    saved in ``directory``; returns the processor."""
    import torch
    import transformers

    from rapidlite.models.hf import plain_save

    processor = tiny_processor(family, words, image_side)
    config = tiny_config(family, processor, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config)
    with plain_save():
        model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return processor
