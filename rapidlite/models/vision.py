"""Vision-language models: their processors, their loading, and which of their parts train.

``load_processor`` is ``AutoProcessor.from_pretrained``; where torchvision is not installed, transformers cannot
build a processor that declares a video processor (Qwen2-VL's, Qwen2.5-VL's, SmolVLM's), and the processor is
then put together from its tokenizer and image processor with no video processor (images only), said in one line.
``freeze`` applies ``--freeze-vision-tower`` and ``--freeze-projector`` by the family's ``VisionLayout``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError, first_line
from rapidlite.models.spec import VisionLayout, spec_for_config, spec_of

log = logging.getLogger("rapidlite")
FAMILIES = "Qwen2.5-VL, Qwen2-VL, LLaVA (1.5, NeXT), Gemma 3, SmolVLM / Idefics3"


def is_vision_config(config: Any) -> bool:
    """Whether a model config is a vision-language model's (it has a vision encoder's config)."""
    return config is not None and getattr(config, "vision_config", None) is not None


def vision_layout(config_or_model: Any) -> VisionLayout | None:
    """The family's ``VisionLayout`` of a config or a model (None: not a vision-language family rapidlite knows)."""
    if isinstance(config_or_model, nn.Module):
        return spec_of(config_or_model).vision
    return spec_for_config(config_or_model).vision


@contextlib.contextmanager
def _without_video_processor() -> Iterator[None]:
    """transformers checks each part of a processor against its base class, and without torchvision the video
    processor's is a placeholder: a part left out (None) passes while this lasts."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self: Any, name: str, argument: Any) -> Any:
        return None if argument is None and "video" in name else check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _images_only(name: str) -> Any:
    """The processor of ``name`` put together from its tokenizer and image processor, with no video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.utils import cached_file

    config_file = cached_file(name, "processor_config.json", _raise_exceptions_for_missing_entries=False)
    processor_class = None
    if config_file is not None:
        with open(config_file, encoding="utf-8") as f:
            processor_class = json.load(f).get("processor_class")
    if processor_class is None:
        processor_class = AutoTokenizer.from_pretrained(name).init_kwargs.get("processor_class")
    cls = getattr(transformers, processor_class or "", None)
    if cls is None:
        raise ConfigError(f"{name}: its processor class ({processor_class}) is not one transformers has")
    with _without_video_processor():
        processor = cls(
            image_processor=AutoImageProcessor.from_pretrained(name),
            tokenizer=AutoTokenizer.from_pretrained(name),
            video_processor=None,
            chat_template=_chat_template(name),
        )
    keep(processor)
    log.info(f"torchvision is not installed: {cls.__name__} built for images only (videos need torchvision)")
    return processor


def keep(processor: Any) -> Any:
    """A processor whose parts may be None saves the others only (``save_pretrained`` reads ``get_attributes``)."""
    present = [a for a in type(processor).get_attributes() if getattr(processor, a, None) is not None]
    processor.get_attributes = lambda: present
    return processor


def _chat_template(name: str) -> str | None:
    from transformers.utils import cached_file

    for filename in ("chat_template.jinja", "chat_template.json"):
        path = cached_file(name, filename, _raise_exceptions_for_missing_entries=False)
        if path is not None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            return json.loads(text)["chat_template"] if filename.endswith(".json") else text
    return None


def load_processor(name: str) -> Any:
    """``AutoProcessor.from_pretrained(name)`` (images only where torchvision is missing); one line when the model
    has no processor that takes images."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(name)
    except Exception as e:  # OSError/ValueError from transformers
        video = "video" in str(e).lower()
        if video and not _has_torchvision():
            return _images_only(name)
        raise ConfigError(f"{name}: its processor cannot be loaded ({first_line(e, 160)})") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(
            f"{name}: the data has images, but the model's processor takes none ({type(processor).__name__}); "
            f"give a vision-language model ({FAMILIES})"
        )
    return processor


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def load_vision_model(name: str, **kwargs: Any) -> nn.Module:
    """``AutoModelForImageTextToText`` from ``name``, attention through SDPA where the model class has it."""
    from transformers import AutoModelForImageTextToText

    from rapidlite.models.hf import load_error, load_hf_model

    try:
        return load_hf_model(AutoModelForImageTextToText.from_pretrained, name, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError for missing or unknown models
        raise load_error("vision-language model", name, e) from None


def text_only_error(name: str, model_type: str | None) -> ConfigError:
    return ConfigError(
        f"the data has images, but {name} ({model_type or 'unknown type'}) is a text-only model; give a "
        f"vision-language model ({FAMILIES}) or text-only data"
    )


def parameter_parts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``(trainable, total)`` parameter counts of the model's tower, projector and language model."""
    layout = vision_layout(model)
    counts: dict[str, list[int]] = {"tower": [0, 0], "projector": [0, 0], "language": [0, 0]}
    for name, param in model.named_parameters():
        part = layout.part(name) if layout is not None else "language"
        counts[part][1] += param.numel()
        counts[part][0] += param.numel() if param.requires_grad else 0
    return {k: (v[0], v[1]) for k, v in counts.items()}


def freeze(model: nn.Module, freeze_tower: bool, freeze_projector: bool) -> str:
    """Stop the tower's (``--freeze-vision-tower``) and the projector's (``--freeze-projector``) parameters
    training; the line that splits the trainable counts by part."""
    layout = vision_layout(model)
    if layout is None:
        raise ConfigError(
            f"{type(model).__name__}: a vision-language model of a family rapidlite does not know; its families "
            f"are {FAMILIES}"
        )
    for name, param in model.named_parameters():
        part = layout.part(name)
        if (part == "tower" and freeze_tower) or (part == "projector" and freeze_projector):
            param.requires_grad_(False)
    return split_line(model)


def split_line(model: nn.Module) -> str:
    parts = parameter_parts(model)
    names = {"tower": "vision tower", "projector": "projector", "language": "language model"}
    return "trainable: " + ", ".join(
        f"{names[k]} {t:,d} of {n:,d}" + (" (frozen)" if t == 0 and n else "") for k, (t, n) in parts.items()
    )


def image_patches(batch: Any, patch_size: int | None) -> int:
    """The image patches a batch (or a processor's output) brings to the vision encoder: Qwen-VL's grid, else each
    image's or crop's (height / patch) x (width / patch); 0 without images."""
    grid = batch.get("image_grid_thw") if hasattr(batch, "get") else None
    if isinstance(grid, torch.Tensor):
        return int(grid.prod(-1).sum())
    pixels = batch.get("pixel_values") if hasattr(batch, "get") else None
    if not isinstance(pixels, torch.Tensor) or pixels.dim() < 4 or not patch_size:
        return 0
    crops = math.prod(pixels.shape[:-3])
    return int(crops * (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size))
