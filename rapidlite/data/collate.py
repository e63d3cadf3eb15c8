"""The default batch collation of rapidlite's loaders: tokenizer outputs of different lengths are padded.

``torch.utils.data.default_collate`` stacks equal-shaped samples and fails on tokenized text of varying
length ("each element in list of batch should be of equal size"). A Hugging Face dataset mapped through a
tokenizer, as Rapidformer's page builds it, yields exactly such rows: dicts of token lists. ``PadCollator``
pads them the way ``DataCollatorWithPadding`` does, without needing the tokenizer: ``input_ids`` with the pad
id, sequence ``labels`` with -100 (ignored by the loss), every other sequence field with 0, and an
``attention_mask`` added when the rows carry none, so padding is never attended to. In tokenized rows (with
``input_ids``) a ``label`` or ``label_ids`` column arrives as ``labels``, the name models take, as Hugging Face's
collators pass it. Sequence fields of equal length are stacked into one tensor (``default_collate`` would
transpose a list field into a list of per-position tensors); other fields, and samples that are not dicts,
are ``default_collate``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

IGNORE_INDEX = -100
_MASK_KEY = "attention_mask"


def _is_sequence(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 1
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _tensor(values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    tensor = torch.as_tensor(values)  # token lists: int64, as embeddings and losses expect
    return tensor.to(torch.int64) if not tensor.is_floating_point() and tensor.dtype != torch.bool else tensor


class PadCollator:
    """Pads dict samples whose sequence fields differ in length (see the module docstring); a class, not a
    closure, so loader workers can pickle it. ``pad_token_id`` pads ``input_ids``; ``padding_side`` is
    ``"right"`` (training) or ``"left"``."""

    def __init__(self, pad_token_id: int = 0, padding_side: str = "right") -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PadCollator:
        """Pad id and side from a Hugging Face tokenizer (its pad token, else its eos token, else 0)."""
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        return cls(pad if isinstance(pad, int) else 0, getattr(tokenizer, "padding_side", "right") or "right")

    def pad_value(self, key: str) -> int:
        if key == "input_ids":
            return self.pad_token_id
        if key == "labels":
            return IGNORE_INDEX
        return 0

    def _pad(self, rows: list[torch.Tensor], length: int, value: int | float) -> torch.Tensor:
        out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
        for i, row in enumerate(rows):
            n = min(len(row), length)
            if self.padding_side == "right":
                out[i, :n] = row[:n]
            else:
                out[i, length - n :] = row[len(row) - n :]
        return out

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or not all(isinstance(s, Mapping) for s in samples):
            return default_collate(samples)
        if "input_ids" in samples[0] and "labels" not in samples[0]:  # tokenized rows: Hugging Face's convention
            for old in ("label", "label_ids"):
                if old in samples[0]:
                    samples = [{("labels" if k == old else k): v for k, v in s.items()} for s in samples]
                    break
        keys = list(samples[0].keys())
        if any(set(s.keys()) != set(keys) for s in samples):
            raise ValueError(
                "samples of one batch have different fields: "
                + ", ".join(sorted({k for s in samples for k in s} ^ set(keys)))
            )
        # A field is padded when its lengths differ within the batch (token fields); equal-length fields
        # (a multi-hot label vector, fixed-size features) are stacked as they are.
        ragged = {
            k: max(len(s[k]) for s in samples)
            for k in keys
            if all(_is_sequence(s[k]) for s in samples) and len({len(s[k]) for s in samples}) > 1
        }
        batch: dict[str, Any] = {}
        for key in keys:
            values = [s[key] for s in samples]
            if key in ragged:
                batch[key] = self._pad([_tensor(v) for v in values], ragged[key], self.pad_value(key))
            elif all(_is_sequence(v) for v in values):
                batch[key] = torch.stack([_tensor(v) for v in values])
            else:
                batch[key] = default_collate(values)
        if _MASK_KEY not in batch and "input_ids" in ragged:
            real = [torch.ones(len(s["input_ids"]), dtype=torch.int64) for s in samples]
            batch[_MASK_KEY] = self._pad(real, ragged["input_ids"], 0)
        return batch
