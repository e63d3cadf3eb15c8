"""Vision-language fine-tuning data: rows with images, in the layouts people have, turned into a model's inputs.

Layouts (``vision_sample``), told apart row by row:

- LLaMA-Factory's: ``messages`` (or ShareGPT's ``conversations``) whose text holds ``<image>`` placeholders, and
  an ``images`` list (paths);
- TRL's and axolotl's: content lists with ``{"type": "image"}`` items, each carrying its image (``path``, ``url``,
  ``base64`` or ``image``) or taking the next of the row's ``images`` (``image``: one), which may be PIL images
  (a ``datasets`` Image column) or paths; text-only contents with ``images`` get them before the first user
  turn, as TRL does;
- TRL's conversational prompt/completion (``prompt`` and ``completion`` message lists), or plain ``prompt`` /
  ``completion`` (``response``) strings, which become one user and one assistant turn.

Paths are relative to the data file's directory. A sample's images are opened when the sample is (in the data
loader's workers), resized so their pixel count lies within ``--image-min-pixels`` and ``--image-max-pixels``
(LLaMA-Factory's rule), then given to the model's processor (``AutoProcessor``) with the text its chat template
renders. The assistant turns train; the prompt, the image tokens and the padding do not. As TRL's
``SFTTrainer`` does, the text before each assistant turn is processed with its images, and the turn itself is
tokenized apart, so a label boundary never falls inside a token.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.data.instruction import _message, turn_segments
from rapidlite.errors import DataError, first_line

IMAGE_PLACEHOLDER = "<image>"  # LLaMA-Factory's (and LLaVA's) placeholder in text contents
IMAGE_SOURCES = ("image", "path", "url", "base64")  # where a content item keeps its image
IGNORE = -100
# The keys of a sample that run along its tokens (padded in a batch); every other key is an image tensor.
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids")
_PADS = {"input_ids": None, "attention_mask": 0, "labels": IGNORE, "token_type_ids": 0, "mm_token_type_ids": 0}


class BadImage(DataError):
    """An image that cannot be opened: a missing file, bytes that are not an image, an unreachable URL."""


@dataclass
class VisionSample:
    """A row as the processor takes it: chat messages whose contents are lists of ``{"type": "text", "text"}``
    and ``{"type": "image"}`` items, and the images in their order (sources: a path, URL, base64 text or an
    image)."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)


def row_images(row: dict[str, Any]) -> list[Any]:
    """A row's ``images`` (a list) or ``image`` (one), without empty entries."""
    value = row.get("images")
    if value is None and row.get("image") is not None:
        value = [row["image"]]
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        value = [value]
    return [v for v in value if v is not None]


def _messages_of(row: dict[str, Any]) -> list[Any] | None:
    for key in ("messages", "conversations"):
        if isinstance(row.get(key), list):
            return list(row[key])
    prompt, completion = row.get("prompt"), row.get("completion", row.get("response"))
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational prompt/completion
        return [*prompt, *completion]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return None


def _content_images(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content)


def has_images(row: dict[str, Any]) -> bool:
    """Whether a row brings images: an ``images``/``image`` column with any, or an image item in a content list."""
    if row_images(row):
        return True
    messages = _messages_of(row) or []
    return any(isinstance(m, dict) and _content_images(m.get("content", m.get("value"))) for m in messages)


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    """A text content as items: ``<image>`` placeholders become image items, the text between them text items."""
    items: list[dict[str, Any]] = []
    for i, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            items.append({"type": "image"})
        if part:
            items.append({"type": "text", "text": part})
    return items


def vision_sample(row: dict[str, Any], index: int) -> VisionSample:
    """The row (number ``index`` of its split, for the error lines) in the processor's layout; a row whose image
    placeholders and images do not pair up is one line."""
    raw = _messages_of(row)
    if raw is None:
        keys = ", ".join(k for k, v in row.items() if v is not None)
        raise DataError(
            f"row {index}: a vision-language model trains on chats (messages or conversations, or prompt and "
            "completion, with or without images); its columns "
            f"are {keys}"
        )
    given = row_images(row)
    placed = any(isinstance(m, dict) and _content_images(m.get("content", m.get("value"))) for m in raw) or any(
        isinstance(m, dict) and IMAGE_PLACEHOLDER in str(m.get("content", m.get("value")) or "") for m in raw
    )
    messages, images, pending = [], [], list(given)
    for message in raw:
        content = message.get("content", message.get("value")) if isinstance(message, dict) else None
        role = _message({**message, "content": ""} if isinstance(message, dict) else message)["role"]
        items: list[dict[str, Any]] = []
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        for part in parts:
            if not isinstance(part, dict):
                part = {"type": "text", "text": str(part)}
            if part.get("type") == "image":
                key = next((k for k in IMAGE_SOURCES if part.get(k) is not None), None)
                source = None if key is None else {"base64": part[key]} if key == "base64" else part[key]
                if source is None:  # a placeholder item: the next of the row's images
                    if not pending:
                        raise _unpaired(index, raw, given)
                    source = pending.pop(0)
                images.append(source)
                items.append({"type": "image"})
            elif part.get("type") in (None, "text"):
                text = str(part.get("text") or "")
                for item in _split_placeholders(text):
                    if item["type"] == "image":
                        if not pending:
                            raise _unpaired(index, raw, given)
                        images.append(pending.pop(0))
                    items.append(item)
            else:
                raise DataError(
                    f"row {index}: a content item of type {part.get('type')!r}; images and text are read "
                    "(type image or text)"
                )
        messages.append({"role": role, "content": items})
    if pending and not placed:  # TRL's rule: a text-only chat's images open its first user turn
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise DataError(f"row {index}: {len(given)} images but no user turn to put them in")
        first_user["content"] = [{"type": "image"} for _ in pending] + first_user["content"]
        images, pending = list(given), []
    if pending:
        raise _unpaired(index, raw, given)
    return VisionSample(messages, images)


def _unpaired(index: int, raw: list[Any], given: list[Any]) -> DataError:
    slots = sum(
        str(m.get("content", m.get("value")) or "").count(IMAGE_PLACEHOLDER)
        if not isinstance(m.get("content"), list)
        else sum(1 for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
        for m in raw
        if isinstance(m, dict)
    )
    return DataError(
        f"row {index}: {slots} image placeholders ({IMAGE_PLACEHOLDER} or image items) but {len(given)} images; "
        "give one image per placeholder"
    )


def _describe(source: Any) -> str:
    if isinstance(source, str):
        return source if len(source) < 120 else f"{source[:40]}... ({len(source)} characters)"
    if isinstance(source, dict) and source.get("path"):
        return str(source["path"])
    return type(source).__name__


# A text source this long with no whitespace is bare base64 image data, not a path (paths are far shorter).
BASE64_LENGTH = 1024


def _is_base64(text: str) -> bool:
    return text.startswith("data:") or (len(text) >= BASE64_LENGTH and not any(c.isspace() for c in text[:256]))


def image_path(source: Any, base: str) -> str | None:
    """The file a path source names (relative to ``base``, the data file's directory), else None."""
    if isinstance(source, dict):
        source = source.get("path") if source.get("bytes") is None and "base64" not in source else None
    if not isinstance(source, str) or source.startswith(("http://", "https://")) or _is_base64(source):
        return None
    path = os.path.expanduser(source)
    return path if os.path.isabs(path) else os.path.join(base, path)


def open_image(source: Any, base: str, index: int) -> Any:
    """The PIL image (RGB) of one source: a PIL image, ``datasets``' ``{"bytes", "path"}``, a path, a URL or base64
    text (a data URL or bare). One line naming the image and the row when it cannot be read."""
    from PIL import Image

    def bad(why: str) -> BadImage:
        return BadImage(f"row {index}: image {_describe(source)}: {why}")

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    data: bytes | None = None
    if isinstance(source, dict) and "base64" in source:  # an image item's base64 (axolotl's key)
        source = str(source["base64"])
        if not source.startswith("data:") and len(source) < BASE64_LENGTH:
            source = "data:," + source  # short, but named base64 by its key
    if isinstance(source, dict) and source.get("bytes") is not None:
        data = source["bytes"]
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        import urllib.request

        try:
            with urllib.request.urlopen(source, timeout=30) as response:
                data = response.read()
        except OSError as e:
            raise bad(f"cannot be fetched ({first_line(e, 100)})") from None
    elif isinstance(source, str) and _is_base64(source):
        try:
            data = base64.b64decode(source.split(",", 1)[-1], validate=True)
        except (binascii.Error, ValueError):
            raise bad("not base64 image data") from None
    path = image_path(source, base) if data is None else None
    if data is None and path is None:
        raise bad("not a path, URL, base64 text or image")
    if path is not None and not os.path.isfile(path):
        raise bad(f"no such file ({path})")
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise bad(f"not an image ({first_line(e, 100)})") from None


def bounded(image: Any, min_pixels: int, max_pixels: int) -> Any:
    """The image resized (aspect kept) so its pixel count lies within ``[min_pixels, max_pixels]``."""
    width, height = image.size
    pixels = width * height
    if min_pixels <= pixels <= max_pixels:
        return image
    scale = ((max_pixels if pixels > max_pixels else min_pixels) / pixels) ** 0.5
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return image.resize(size)


def bounded_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``bounded``'s output size for an image of this size (what the planner counts tokens from)."""
    pixels = width * height
    if min_pixels <= pixels <= max_pixels:
        return width, height
    scale = ((max_pixels if pixels > max_pixels else min_pixels) / pixels) ** 0.5
    return max(1, int(width * scale)), max(1, int(height * scale))


def render_turns(messages: list[dict[str, Any]], processor: Any) -> list[tuple[str, bool, int]]:
    """The conversation as ``(text, trained, images)`` pieces through the processor's chat template
    (``instruction.turn_segments``); ``images``: the image items the piece holds."""

    def rendered(turns: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError, or a processor without a template
            raise DataError(
                f"the processor's chat template cannot render a conversation: {first_line(e, 160)}; give the "
                "model's processor its chat_template"
            ) from None

    if any(m["role"] == "assistant" and any(p["type"] == "image" for p in m["content"]) for m in messages):
        raise DataError("an assistant turn holds an image: images are read in the prompt turns only")
    pieces: list[tuple[str, bool, int]] = []
    consumed = 0
    for text, trained, end in turn_segments(messages, rendered):
        held = sum(1 for m in messages[:end] for p in m["content"] if p["type"] == "image") - consumed
        pieces.append((text, trained, held))
        consumed += held
    return pieces


@dataclass(frozen=True)
class VisionEncoder:
    """Turns a ``VisionSample`` into the model's inputs for one sample: token ids, labels, attention mask and the
    processor's image tensors (``pixel_values``, ``image_grid_thw``, ...), cut at ``seq_length`` after the last
    image token (a cut through an image's tokens is one line)."""

    processor: Any
    seq_length: int
    base: str  # relative image paths start here
    min_pixels: int
    max_pixels: int
    train_on_prompt: bool = False

    def __call__(self, sample: VisionSample, index: int) -> dict[str, torch.Tensor]:
        images = [bounded(open_image(s, self.base, index), self.min_pixels, self.max_pixels) for s in sample.images]
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        pieces: list[dict[str, torch.Tensor]] = []
        images_out: dict[str, list[torch.Tensor]] = {}
        start = 0
        for text, trained, held in render_turns(sample.messages, self.processor):
            if held:
                out = self.processor(
                    text=[text], images=[images[start : start + held]], return_tensors="pt", add_special_tokens=False
                )
                start += held
            else:
                out = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            piece = {k: v[0] for k, v in out.items() if k in TOKEN_KEYS}
            for key, value in out.items():
                if key not in TOKEN_KEYS:
                    images_out.setdefault(key, []).append(value)
            ids = piece["input_ids"]
            piece["labels"] = ids.clone() if trained or self.train_on_prompt else torch.full_like(ids, IGNORE)
            pieces.append(piece)
        keys = [k for k in TOKEN_KEYS if any(k in p for p in pieces)]
        # A piece the tokenizer made has no token types (text: 0) and may have no attention mask (all 1).
        encoded = {
            k: torch.cat(
                [p[k] if k in p else torch.full_like(p["input_ids"], int(k == "attention_mask")) for p in pieces]
            )
            for k in keys
        }
        if self.train_on_prompt:
            encoded["labels"][self._image_positions(encoded["input_ids"])] = IGNORE
        for key, values in images_out.items():
            encoded[key] = torch.cat(values)
        return self._cut(encoded, index)

    def _image_positions(self, ids: torch.Tensor) -> torch.Tensor:
        token_ids = image_token_ids(self.processor)
        return torch.isin(ids, torch.tensor(sorted(token_ids), dtype=ids.dtype)) if token_ids else ids < 0

    def _cut(self, encoded: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        ids = encoded["input_ids"]
        if len(ids) <= self.seq_length:
            return encoded
        images = self._image_positions(ids).nonzero()
        if len(images) and int(images[-1]) >= self.seq_length:
            raise DataError(
                f"row {index}: its images' tokens run to position {int(images[-1]) + 1}, past --seq-length "
                f"{self.seq_length}; raise --seq-length or lower --image-max-pixels"
            )
        cut = {k: (v[: self.seq_length] if k in TOKEN_KEYS else v) for k, v in encoded.items()}
        cut["truncated"] = torch.tensor(1)
        return cut


def image_token_ids(processor: Any) -> set[int]:
    """The ids the processor expands images into (and the boundary tokens it sets around them)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = set()
    for name in ("image_token_id", "image_token_index", "boi_token_id", "eoi_token_id", "fake_image_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    for name in ("image_token", "boi_token", "eoi_token", "fake_image_token", "global_image_token"):
        token = getattr(processor, name, None)
        if isinstance(token, str):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                ids.add(token_id)
    return ids


class VisionDataset(torch.utils.data.Dataset):
    """The ``rows`` of a split (a ``datasets`` split or a list of rows), each read (``read``: a chat, or a pair)
    and encoded when the data loader asks for it, its images opened in the loader's workers. With ``skip_bad`` a
    sample whose image cannot be read becomes None (left out of its batch by the collator, and warned about);
    without, that is one line and the run stops."""

    def __init__(
        self, split: Any, rows: Sequence[int], encoder: Any, skip_bad: bool = False, read: Any = vision_sample
    ):
        self.split, self.rows, self.encoder, self.skip_bad, self.read = split, list(rows), encoder, skip_bad, read

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> Any:
        """The ``i``-th row, read."""
        row = self.rows[i]
        return self.read(self.split[row], row)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor] | None:
        try:
            return self.encoder(self.sample(i), self.rows[i])
        except BadImage as e:
            if not self.skip_bad:
                raise
            logging.getLogger("rapidlite").warning(f"--skip-bad-images: skipped {e}")
            return None


def pad_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Image tensors of several samples along their first dimension, the others padded with zeros to the largest
    (LLaVA-NeXT's patch counts, Idefics3's image counts: the models skip all-zero entries)."""
    if len({t.shape[1:] for t in tensors}) == 1:
        return torch.cat(list(tensors))
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        out = t.new_zeros((t.shape[0], *shape))
        out[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
        padded.append(out)
    return torch.cat(padded)


@dataclass
class VisionCollator:
    """Pads a batch of encoded samples on the right (ids with ``pad_id``, labels with -100, masks and token types
    with 0) and joins their image tensors (``pad_cat``). Samples ``VisionDataset`` skipped are left out."""

    pad_id: int

    def __call__(self, samples: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        kept = [s for s in samples if s is not None]
        if not kept:
            raise DataError("--skip-bad-images: every sample of a batch had an unreadable image")
        length = max(len(s["input_ids"]) for s in kept)
        batch: dict[str, torch.Tensor] = {}
        for key in TOKEN_KEYS:
            if key not in kept[0]:
                continue
            pad = self.pad_id if key == "input_ids" else _PADS[key]
            rows = [torch.nn.functional.pad(s[key], (0, length - len(s[key])), value=pad) for s in kept]
            batch[key] = torch.stack(rows)
        for key in kept[0]:
            if key not in TOKEN_KEYS and key != "truncated":
                batch[key] = pad_cat([s[key] for s in kept if key in s])
        return batch
