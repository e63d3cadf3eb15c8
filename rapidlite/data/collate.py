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

from rapidlite.errors import DataError

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


# --------------------------------------------------------------------------------------------------
# Padding-free batches: samples concatenated into one row
# --------------------------------------------------------------------------------------------------


def _one_row(columns: dict[str, torch.Tensor], lengths: torch.Tensor, shift_labels: bool) -> dict[str, torch.Tensor]:
    """Token fields already concatenated sample after sample (``columns``, 1-D) as one row ``[1, T]``, with the
    ``position_ids`` of samples of ``lengths`` tokens and, with ``shift_labels``, -100 as each sample's first
    label. The one packer: ``flatten_rows`` (lists, ``--packing``) and ``FlatteningCollator`` (batches) use it."""
    if bool((lengths <= 0).any()):
        raise DataError("--padding-free/--packing: a sample has no tokens; drop empty samples from the data")
    starts = lengths.cumsum(0) - lengths
    positions = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, lengths)
    flat = {key: value[None] for key, value in columns.items()}
    if shift_labels and "labels" in flat:
        flat["labels"] = flat["labels"].clone()
        flat["labels"][0, starts] = IGNORE_INDEX
    flat["position_ids"] = positions[None]
    return flat


def flatten_rows(rows: Sequence[Mapping[str, Any]], shift_labels: bool = False) -> dict[str, torch.Tensor]:
    """Samples (dicts of equal-length token fields: lists or 1-D tensors) concatenated into one row ``[1, T]``
    with ``position_ids`` restarting at 0 at each sample: Hugging Face's ``DataCollatorWithFlattening`` layout.
    ``shift_labels`` (causal language models, whose token t predicts t+1): each sample's first label is -100, so
    no sample learns to predict the next one's first token; the per-token loss then equals the samples' own."""
    if not rows:
        raise ValueError("no samples to flatten")
    keys = list(rows[0].keys())
    lengths = torch.tensor([len(row["input_ids"]) for row in rows], dtype=torch.int64)
    columns = {}
    for key in keys:
        values = [_tensor(row[key]) for row in rows]
        if any(len(v) != n for v, n in zip(values, lengths.tolist(), strict=True)):
            raise ValueError(f"field {key} does not have one value per token of input_ids")
        columns[key] = torch.cat(values)
    return _one_row(columns, lengths, shift_labels)


def packed_sample_count(position_ids: torch.Tensor) -> int:
    """The samples of a row packed with restarting position ids (a new sample wherever a position does not follow
    the one before it by 1: transformers' ``find_packed_sequence_indices`` rule)."""
    if position_ids.numel() == 0:
        return 0
    return int((position_ids.diff(dim=-1) != 1).sum()) + position_ids.shape[0]


class FlatteningCollator:
    """Padding-free batches (``--padding-free``): the batch ``collate_fn`` makes (padded, with an attention mask
    or of equal lengths) becomes one row holding only the real tokens of its samples, in order, with position
    ids restarting at each sample and no attention mask (``flatten_rows``). Fields with one value per token are
    concatenated; fields with one value per sample (a class label) stay ``[samples, ...]``. ``shift_labels``:
    see ``flatten_rows``; settable after construction (it depends on the model, which is built later)."""

    def __init__(self, collate_fn: Any, shift_labels: bool = False) -> None:
        self.collate_fn = collate_fn
        self.shift_labels = shift_labels

    def __call__(self, samples: list[Any]) -> dict[str, torch.Tensor]:
        batch = self.collate_fn(samples)
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise DataError(
                "--padding-free flattens batches of token rows: the batches have no 2-D input_ids; drop --padding-free"
            )
        if "position_ids" in batch:
            raise DataError(
                "--padding-free: the batches have position_ids already (they are packed); drop --padding-free"
            )
        mask = batch.get(_MASK_KEY)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        token_keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.shape == ids.shape]
        # A boolean selection reads row after row: each sample's real tokens, in order, samples concatenated.
        columns = {k: batch[k][real] for k in token_keys if k != _MASK_KEY}
        flat: dict[str, Any] = _one_row(columns, real.sum(1), self.shift_labels)
        for key, value in batch.items():
            if key in token_keys:
                continue
            if not (isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == ids.shape[0]):
                raise DataError(
                    f"--padding-free: batch field {key} has neither one value per token nor one per sample; drop "
                    "--padding-free"
                )
            flat[key] = value
        return flat
