"""Images in the causal-LM tasks: what ``causal_lm`` (and ``dpo``) do when the data has images.

The data or the model decides: a training split that brings images (``data_has_images``), or a vision-language
model (trained then on text-only chats through its processor), makes the run a vision-language one. The model is
then ``AutoModelForImageTextToText`` with its ``AutoProcessor`` (``rapidlite.models.vision``); the rows are checked
up front (placeholders against images, image files present) and encoded lazily, in the data loader's workers; the
vision tower is frozen by default and the projector not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rapidlite.config.settings import Sections
from rapidlite.data.vision import (
    BadImage,
    VisionCollator,
    VisionDataset,
    VisionEncoder,
    VisionSample,
    has_images,
    image_path,
    vision_sample,
)
from rapidlite.data.vision_pairs import VisionPairCollator, VisionPairEncoder, vision_pair
from rapidlite.errors import ConfigError, DataError
from rapidlite.models import vision

DETECT_ROWS = 16  # the training rows looked at to tell image data from text
CHECK_ROWS = 4  # the rows encoded whole at start-up (images opened), so a bad one is found before any step


def data_has_images(raw: Any) -> bool:
    """Whether the data's training split (else its first split) brings images: an ``images``/``image`` column with
    any, or image items in the contents of its first rows (a later row's image item in a text run is refused by
    the text reader, never dropped)."""
    if raw is None:
        return False
    split = raw["train"] if "train" in raw else next(iter(raw.values()))
    for column in ("images", "image"):
        if column in split.column_names:
            values = undecoded(split.select_columns([column]))[column]
            if any(v not in (None, [], "") for v in values):
                return True
    return any(has_images(split[i]) for i in range(min(DETECT_ROWS, len(split))))


def data_directory(settings: Sections) -> str:
    """Where relative image paths start: the data directory (with ``--data-name``/``--data-dir`` descended into),
    or a data file's directory."""
    path, name, sub, _ = settings.data.source
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        for part in (name, sub):
            if part and os.path.isdir(os.path.join(path, part)):
                path = os.path.join(path, part)
        return path
    return os.path.dirname(os.path.abspath(path))


def undecoded(split: Any) -> Any:
    """A ``datasets`` split whose Image columns give ``{"bytes", "path"}`` (decoded in the workers, not here)."""
    import datasets

    for name, feature in split.features.items():
        inner = getattr(feature, "feature", feature)
        if isinstance(feature, datasets.Image) or (isinstance(inner, datasets.Image) and inner is not feature):
            image = datasets.Image(decode=False)
            split = split.cast_column(name, image if feature is inner else type(feature)(image))
    return split


@dataclass
class VisionSplit:
    """The rows of a split that train (their numbers), the images they bring, and the rows left out (a missing
    image under --skip-bad-images)."""

    rows: list[int]
    images: int = 0
    missing: int = 0


def prompt_images(sample: Any) -> list[Any]:
    """The image sources of a chat (``VisionSample``) or a pair (``VisionPair``: its prompt's)."""
    return sample.images if isinstance(sample, VisionSample) else sample.prompt.images


def checked_split(split: Any, base: str, skip_bad: bool, name: str, read: Any = vision_sample) -> VisionSplit:
    """Every row of a split read as ``read`` reads it (a chat, or a pair); a row whose placeholders and images do
    not pair up is one line, as is an image file that is not there (left out and counted with ``skip_bad``).
    Nothing is kept but the row numbers: the rows are read again, and their images opened, as they train."""
    out = VisionSplit([])
    for index in range(len(split)):
        row = split[index]
        images = prompt_images(read(row, index))
        missing = next((p for s in images if (p := image_path(s, base)) is not None and not os.path.isfile(p)), None)
        if missing is not None:
            if not skip_bad:
                raise DataError(
                    f"{name} row {index}: image {missing}: no such file (relative paths start at {base}); fix the "
                    "path, or pass --skip-bad-images to leave such rows out"
                )
            out.missing += 1
            continue
        out.rows.append(index)
        out.images += len(images)
    return out


def opened_up_front(name: str, dataset: VisionDataset) -> None:
    """The first rows encoded whole (images opened) at start-up: a bad image stops the run before any step."""
    for i in range(min(CHECK_ROWS, len(dataset))):
        try:
            dataset.encoder(dataset.sample(i), dataset.rows[i])
        except BadImage as e:
            raise DataError(f"{name} {e}") from None


class VisionLanguage:
    """The vision-language half of a causal-LM trainer: the processor, the lazily encoded splits, the model with
    its tower and projector frozen as the flags say."""

    images = False  # the run is a vision-language one (``vision_run``, decided with the data)
    model_config_: Any = None  # the model's config, read before its weights (``tokenizer_and_data_source``)

    def vision_run(self, raw: Any) -> bool:
        """Whether the run is a vision-language one: the data has images, or the model is a vision-language model
        (trained on text-only chats through its processor, as it will be used)."""
        return data_has_images(raw) or vision.is_vision_config(self.model_config_)

    def vision_data(self, raw: Any, seq_length: int, pad_id: int) -> tuple[Any, Any, Any, VisionCollator]:
        """``--task causal_lm``'s chats with images (``rapidlite.data.vision``)."""
        options = self.settings.vision
        encoder = self.vision_encoder(seq_length, train_on_prompt=self.settings.task_options.train_on_prompt)
        splits, checked = self._vision_splits(raw, encoder, vision_sample)
        self.collator = VisionCollator(self.tokenizer.pad_token_id)
        counts = " / ".join(f"{len(v)} {k}" for k, v in splits.items())
        missing = sum(c.missing for c in checked.values())
        self.logger.info(
            f"data: images and text ({counts} samples, {checked['train'].images if 'train' in checked else 0} "
            f"training images, encoded as they are read), processor {type(self.processor).__name__}, images "
            f"scaled to {options.image_min_pixels:,d}-{options.image_max_pixels:,d} pixels"
            + (f", {missing} rows left out with a missing image (--skip-bad-images)" if missing else "")
        )
        self.data = None
        self.vision_validation = splits.get("validation")
        return splits.get("train"), splits.get("validation"), splits.get("test"), self.collator

    def vision_pair_data(self, raw: Any, seq_length: int) -> tuple[Any, Any, Any, VisionPairCollator]:
        """``--task dpo``'s pairs with images (``rapidlite.data.vision_pairs``)."""
        settings: Sections = self.settings
        for given, flag_name in (
            (settings.task.eval_generate, "--eval-generate"),
            (settings.preference.precompute_ref_logprobs, "--precompute-ref-logprobs"),
        ):
            if given:
                raise ConfigError(f"{flag_name}: not built for preference data with images yet; drop {flag_name}")
        encoder = VisionPairEncoder(self.vision_encoder(seq_length))
        splits, checked = self._vision_splits(raw, encoder, vision_pair)
        counts = " / ".join(f"{len(v)} {k}" for k, v in splits.items())
        missing = sum(c.missing for c in checked.values())
        self.logger.info(
            f"data: preference pairs with images ({counts} pairs, encoded as they are read), processor "
            f"{type(self.processor).__name__}"
            + (f", {missing} rows left out with a missing image (--skip-bad-images)" if missing else "")
        )
        self.eval_prompts = []
        collator = VisionPairCollator(self.tokenizer.pad_token_id)
        return splits.get("train"), splits.get("validation"), splits.get("test"), collator

    def _vision_splits(self, raw: Any, encoder: Any, read: Any) -> tuple[dict[str, Any], dict[str, VisionSplit]]:
        """Each split checked (``checked_split``) and its first rows opened, as a lazily encoded dataset."""
        skip_bad = self.settings.vision.skip_bad_images
        base = encoder.base if isinstance(encoder, VisionEncoder) else encoder.base.base
        splits: dict[str, Any] = {}
        checked: dict[str, VisionSplit] = {}
        for name in ("train", "validation", "test"):
            if name not in raw:
                continue
            split = undecoded(raw[name])
            checked[name] = checked_split(split, base, skip_bad, name, read)
            splits[name] = VisionDataset(split, checked[name].rows, encoder, skip_bad, read)
            opened_up_front(name, splits[name])
        return splits, checked

    def vision_encoder(self, seq_length: int, train_on_prompt: bool = False) -> VisionEncoder:
        """The checks every task's image data goes through, the processor, and the sample encoder
        (``train_on_prompt``: causal_lm's ``--train-on-prompt``)."""
        settings: Sections = self.settings
        options = settings.vision
        if settings.task.packing:
            raise ConfigError(
                "--packing: the data has images, and packing is not built for vision-language models (their image "
                "tokens and positions are per sample); drop --packing"
            )
        if settings.topology.cp > 1:
            raise ConfigError(
                "--context-parallel-size: not built for data with images (a sample's image tokens would be split "
                "from its images); drop the flag"
            )
        if settings.data.padding_free:
            raise ConfigError("--padding-free: not built for data with images; drop --padding-free")
        if options.image_min_pixels > options.image_max_pixels:
            raise ConfigError(
                f"--image-min-pixels {options.image_min_pixels} is above --image-max-pixels "
                f"{options.image_max_pixels}; lower the one or raise the other"
            )
        config = self.model_config_
        if config is not None and not vision.is_vision_config(config):
            raise vision.text_only_error(self.base_name, getattr(config, "model_type", None))
        self.processor = vision.load_processor(self.base_name)
        tokenizer = self.processor.tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        return VisionEncoder(
            self.processor,
            seq_length,
            data_directory(settings),
            options.image_min_pixels,
            options.image_max_pixels,
            train_on_prompt=train_on_prompt,
        )

    def vision_model(self, name: str) -> Any:
        settings: Sections = self.settings
        options = settings.vision
        if settings.lora.enabled and not options.freeze_vision_tower:
            raise ConfigError(
                "--no-freeze-vision-tower with --lora-rank: LoRA trains adapters only; name the tower's layers in "
                "--lora-target-modules to adapt it"
            )
        if settings.topology.tp > 1:
            raise ConfigError(
                "--tensor-model-parallel-size: not built for vision-language models; use data parallelism, or "
                "--zero-3-memory-optimization to spread the model"
            )
        model = vision.load_vision_model(name, **self.pretrained_load_kwargs())
        line = vision.freeze(model, options.freeze_vision_tower, options.freeze_projector)
        if not settings.lora.enabled:
            self.logger.info(f"vision-language model {type(model).__name__}: {line}")
        return model

    def after_compose(self) -> None:
        super().after_compose()
        if self.images and self.settings.lora.enabled:  # the split once the adapters are on
            self.logger.info(f"vision-language model: {vision.split_line(self.model)}")

    def vision_generate_and_score(self, model: Any, count: int) -> float:
        """The share of the first ``count`` validation samples whose greedy answer to their last prompt (with its
        images) equals their last assistant turn (stripped); the answers are logged on the main process."""
        import torch

        from rapidlite.data.vision import bounded, open_image

        dataset, options = self.vision_validation, self.settings.vision
        if dataset is None or len(dataset) == 0:
            return 0.0
        tokenizer, device = self.processor.tokenizer, self.engine.device
        stops = {
            tokenizer.eos_token_id,
            *_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)),
        }
        hits, lines = 0, []
        for i in range(min(count, len(dataset))):
            sample, row = dataset.sample(i), dataset.rows[i]
            last = max(i for i, m in enumerate(sample.messages) if m["role"] == "assistant")
            reference = "".join(p.get("text", "") for p in sample.messages[last]["content"]).strip()
            text = self.processor.apply_chat_template(
                sample.messages[:last], tokenize=False, add_generation_prompt=True
            )
            images = [bounded(open_image(s, dataset.encoder.base, row), options.image_min_pixels,
                              options.image_max_pixels) for s in sample.images]  # fmt: skip
            inputs = self.processor(
                text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False
            )
            inputs = {k: v.to(device) for k, v in inputs.items()}
            start = inputs["input_ids"].shape[1]
            budget = len(tokenizer(reference, add_special_tokens=False)["input_ids"]) + 16
            for _ in range(budget):
                logits = model(**inputs, use_cache=False).logits[:, -1]
                if hasattr(logits, "full_tensor"):
                    logits = logits.full_tensor()
                token = logits.argmax(dim=-1, keepdim=True)
                for key in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"):
                    if key in inputs:
                        value = token if key == "input_ids" else torch.full_like(token, int(key == "attention_mask"))
                        inputs[key] = torch.cat([inputs[key], value.to(inputs[key].dtype)], dim=1)
                if int(token) in stops:
                    break
            answer = tokenizer.decode(inputs["input_ids"][0, start:], skip_special_tokens=True).strip()
            hits += answer == reference
            lines.append(f"  [{'ok' if answer == reference else 'xx'}] row {row}: {answer[:60]!r} ({reference[:40]!r})")
        if self.engine.is_main_process:
            self.logger.info(f"greedy answers to {len(lines)} validation images:\n" + "\n".join(lines))
        return hits / len(lines)


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value or () if isinstance(v, int)]
