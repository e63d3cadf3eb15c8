"""The images of a vision-language run in its plan (``--dry-run`` of ``causal_lm``/``dpo`` on such a model).

The language model is planned as any decoder's, at ``--seq-length`` tokens a sample (the image tokens are among
them). The images add the vision encoder's forward: one image a sample is planned, at ``--image-max-pixels``
(a square image, the largest the run lets through), processed by the model's own processor, so the patch count
and the image tokens are the family's rule. What that forward saves for the backward pass is counted on meta
tensors as the language model's is: with the tower frozen (the default) only the trainable projector keeps its
input; with ``--no-freeze-vision-tower`` every block's activations are kept.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rapidlite.errors import first_line

if TYPE_CHECKING:
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class ImageTerm:
    """One planned image: its side in pixels after bounding, its patches, its tokens in the language model,
    and the bytes the vision encoder saves for the backward pass (``saved``) and its largest tensor."""

    side: int
    patches: int
    tokens: int
    saved: int
    largest: int


class _OnMeta(TorchDispatchMode):
    """Moves a CPU tensor that meets a meta one in an op to the meta device: position ids a vision encoder
    derives from its grid (real numbers, on the CPU) meet the meta activations."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in flat):

            def moved(a: Any) -> Any:
                if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0:
                    return a.to("meta")
                return a

            args = tuple(moved(a) for a in args)
            kwargs = {k: moved(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def image_term(model: torch.nn.Module, name: str, max_pixels: int, dtype: torch.dtype | None) -> ImageTerm:
    """The planned image of ``model`` (a meta vision-language model, in its compute dtype) through the processor of
    ``name``."""
    from PIL import Image

    from rapidlite.models.vision import image_patches, load_processor

    processor = load_processor(name)
    side = math.isqrt(max_pixels)
    inputs = processor.image_processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
    pixels = inputs.pop("pixel_values")
    patch = getattr(getattr(model.config, "vision_config", None), "patch_size", None)
    patches = image_patches({**inputs, "pixel_values": pixels}, patch)
    tokens = _tokens(processor, side)
    saved, largest = _saved(model, pixels.to("meta", dtype or pixels.dtype), inputs)
    return ImageTerm(side, patches, tokens, saved, largest)


def _tokens(processor: Any, side: int) -> int:
    """The image's tokens in the language model, by the processor's own rule."""
    try:
        return int(processor._get_num_multimodal_tokens(image_sizes=[(side, side)]).num_image_tokens[0])
    except (AttributeError, NotImplementedError, TypeError, KeyError):
        return 0


def _saved(model: torch.nn.Module, pixels: torch.Tensor, extra: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The bytes the vision encoder's forward (with the projector) saves for the backward, and its largest."""
    seen = {t.untyped_storage()._cdata for t in model.parameters()}
    totals = {"saved": 0, "largest": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                nbytes = t.untyped_storage().nbytes()
                totals["saved"] += nbytes
                totals["largest"] = max(totals["largest"], nbytes)
        return t

    inner = getattr(model, "model", model)
    try:
        with _OnMeta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inner.get_image_features(pixel_values=pixels, **extra)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        raise ImageProfileError(first_line(e)) from e
    return totals["saved"], totals["largest"]


class ImageProfileError(Exception):
    """The vision encoder's forward did not run on meta tensors."""


def count_images(settings: Sections, ranks: list[Any], task: Any, config: Any, dtype: Any) -> tuple[list[str], int]:
    """A vision-language run's images (``plans_images``) in each rank's activations (one image a sample, at
    ``--image-max-pixels``), the notes that say so, and the image patches a sample brings (the vision encoder's
    FLOPs run on them; a preference pair's two sequences each see the prompt's image). Nothing for another run."""
    from rapidlite.errors import RapidliteError
    from rapidlite.models import lora
    from rapidlite.planning.model import meta_model, plans_images

    if not plans_images(task, config):
        return [], 0
    # The model as it trains (adapters on, the tower frozen as the flags say), in the compute dtype.
    adapters = dataclasses.replace(settings.lora, load_in_4bit=False, load_in_8bit=False)
    model = lora.unwrap(lora.prepare(meta_model(settings), adapters, dtype, torch.device("meta"), None))
    model = model.to(dtype) if dtype is not None else model
    micro = settings.batching.micro_batch_size
    try:
        term = image_term(model, settings.model.pretrained_model_name_or_path, settings.vision.image_max_pixels, dtype)
    except ImageProfileError as e:
        return [f"images NOT counted: the vision encoder's forward could not run on meta tensors ({e})"], 0
    except RapidliteError as e:  # no processor beside the model: its images' sizes are the processor's rule
        return [f"images NOT counted: {e}"], 0
    for r in ranks:
        r.activations += term.saved * micro
        r.activation_per_sample += term.saved
        r.transient = max(r.transient, 2 * term.largest)
    frozen = "frozen: only the projector keeps its input" if settings.vision.freeze_vision_tower else "trained"
    note = (
        f"images: one a sample planned at --image-max-pixels ({term.side} x {term.side}): {term.patches} patches, "
        f"{term.tokens} of the --seq-length tokens; the vision encoder ({frozen}) saves "
        f"{term.saved / 2**20:.2f} MiB an image"
    )
    return [note], term.patches * task.inputs_per_sample
