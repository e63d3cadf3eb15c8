"""Offline assets for ``rapidlite --task causal_lm --demo vision``: a tiny Qwen2-VL learns to name what it sees.

Each image is drawn with PIL at build time: one shape (a square, a circle or a triangle) in one of six colours, at
a random place and size on a light background of random size. The question is "what is in the image"; the answer
is the colour and the shape ("red circle"). The splits are drawn apart, so an exact match on validation needs the
model to read the image. The model is a randomly initialised two-layer Qwen2-VL (vision tower, patch merger and
language model) with its processor put together in code (``rapidlite.tasks.vision_build``). The untrained model
answers nothing right; a couple of minutes of training on a CPU answer most images.
"""

from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Mapping
from typing import Any

from rapidlite.tasks.demo_build import DemoBuild, DemoSpec

GENERATOR_VERSION = 2
IMAGE_SIDE = 56  # the processor's smallest image side; its largest is twice that (16 image tokens)
FAMILY = "qwen2_vl"
COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220),
    "yellow": (235, 200, 20), "purple": (140, 40, 170), "black": (20, 20, 20),
}  # fmt: skip
SHAPES = ("square", "circle", "triangle")
QUESTION = "what is in the image"
WORDS = (*QUESTION.split(), *COLOURS, *SHAPES)


def draw(rng: random.Random, colour: str, shape: str) -> Any:
    """One image: ``shape`` in ``colour``, placed and sized at random on a light background."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(72, 112), rng.randint(72, 112)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    size = rng.randint(36, min(width, height) - 8)
    x, y = rng.randint(0, width - size), rng.randint(0, height - size)
    box = (x, y, x + size, y + size)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Each split's rows: a PIL image with its question and answer (written out by ``write_split``)."""
    rng = random.Random(seed)
    splits = {}
    for name, count in sizes.items():
        rows = []
        for _ in range(count):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            rows.append({"image": draw(rng, colour, shape), "answer": f"{colour} {shape}"})
        splits[name] = rows
    return splits


def write_split(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    """The split's images as PNG files in ``images/`` beside it, and its rows in LLaMA-Factory's layout (an
    ``<image>`` placeholder in the user turn, the image's path relative to the data directory)."""
    images = path.parent / "images"
    images.mkdir(exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            name = f"images/{path.stem}-{i:05d}.png"
            row["image"].save(path.parent / name)
            messages = [
                {"role": "user", "content": f"<image>{QUESTION}"},
                {"role": "assistant", "content": row["answer"]},
            ]
            f.write(json.dumps({"messages": messages, "images": [name]}) + "\n")


def build_processor(build: DemoBuild) -> Any:
    from rapidlite.tasks.vision_build import tiny_processor

    return tiny_processor(FAMILY, WORDS, image_side=IMAGE_SIDE)


def token_config(processor: Any) -> dict[str, Any]:
    from rapidlite.tasks.vision_build import config_kwargs

    return config_kwargs(FAMILY, processor, hidden=64, layers=2, heads=4, vision_width=64)


# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 16, "lr": 2e-3, "epochs": 6, "seq_length": 64, "log_interval": 25, "weight_decay": 0.0,
    "clip_grad": 1.0, "eval_generate": 60, "freeze_vision_tower": False,
}
demo = DemoSpec(
    "vision", GENERATOR_VERSION, splits={"train": 3000, "validation": 60},
    generate=generate, write_split=write_split, suffix=".jsonl", tokenizer=build_processor,
    model="Qwen2VLForConditionalGeneration", config={}, token_config=token_config, flags=DEMO_FLAGS,
)
# fmt: on
write_demo_assets = demo.write_assets
