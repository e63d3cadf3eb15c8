"""Image flags of the vision-language tasks (``causal_lm`` and ``dpo`` on data with images): how images are
sized and what happens to one that cannot be read, and which parts of the model train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rapidlite.config.fields import flag
from rapidlite.config.sections import IMAGES

# LLaMA-Factory's defaults (image_max_pixels 768 x 768, image_min_pixels 32 x 32).
MAX_PIXELS = 768 * 768
MIN_PIXELS = 32 * 32


@dataclass(frozen=True)
class VisionConfig:
    """Images: their size bounds, bad files, and freezing the vision tower and projector."""

    GROUP: ClassVar[str] = IMAGES

    image_max_pixels: int = flag(
        MAX_PIXELS, "a larger image is scaled down (aspect kept) to this many pixels before the processor"
    )
    image_min_pixels: int = flag(MIN_PIXELS, "a smaller image is scaled up to this many pixels")
    skip_bad_images: bool = flag(
        False,
        "a sample whose image cannot be read during training is skipped and counted (default: one line and the "
        "run stops); images missing at start-up are always one line",
    )
    freeze_vision_tower: bool = flag(
        True, "keep the image encoder's weights fixed (--no-freeze-vision-tower trains it)"
    )
    freeze_projector: bool = flag(False, "keep the projector from image features to the language model fixed")
