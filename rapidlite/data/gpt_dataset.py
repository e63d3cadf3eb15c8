"""Megatron's GPT dataset over mmap indexed data: fixed-length samples packed across documents.

A sample is ``seq_length + 1`` tokens (inputs and the shifted labels) read straight from the ``.bin``
memory map. Three indices, deterministic per seed and cached as ``.npy`` files, make that cheap:

- document index: the split's documents, repeated for as many epochs as the requested samples need and
  shuffled epoch by epoch;
- sample index: ``[num_samples + 1, 2]`` (position in the document index, token offset) where each
  sample starts; consecutive samples share one boundary token, as in Megatron;
- shuffle index: the order in which samples are served.

Documents run into each other inside a sample; they are separated by the EOD token when the data was
preprocessed with ``--append-eod``. ``--split 969,30,1`` divides the documents (not the samples) into
train/valid/test. Several ``--data-path`` prefixes, optionally weighted (``w1 p1 w2 p2``), are blended:
each dataset serves a share of the samples proportional to its weight, in a fixed interleaving.

The indices are written beside the data (``PREFIX_cache/``), or under the rapidlite cache when that
directory is read-only, atomically: ranks that build the same index at once write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidlite.data.indexed_dataset import IndexedDataset
from rapidlite.errors import ConfigError, DataError
from rapidlite.runtime.cache import cache_root, make_cache_dir

INDEX_VERSION = 1


# ----------------------------------------------------------------------------------------- splits
def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98,2"``, ``"1"``; ``/`` also separates) → three weights summing to 1."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split {split}: expected up to three numbers such as 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {split}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Document ranges ``[start, end)`` of train, valid and test."""
    bounds = [0]
    for weight in parse_split(split):
        bounds.append(bounds[-1] + int(round(weight * num_documents)))
    bounds = [min(b, num_documents) for b in bounds]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """``[p]``, ``[p1, p2]`` (equal weights) or ``[w1, p1, w2, p2]`` → ``[(weight, prefix)]``."""
    items = list(data_path)

    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if len(items) >= 2 and is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
            raise ConfigError(
                f"--data-path {' '.join(items)}: give prefixes, or weight-prefix pairs such as 0.7 a_text 0.3 b_text"
            )
        pairs = [(float(w), p) for w, p in zip(items[0::2], items[1::2], strict=True)]
    else:
        pairs = [(1.0, p) for p in items]
    if any(w <= 0 for w, _ in pairs):
        raise ConfigError(f"--data-path {' '.join(items)}: weights must be positive")
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


# ----------------------------------------------------------------------------------------- indices
def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, shuffle: bool = True
) -> np.ndarray:
    """The documents once per epoch, each epoch shuffled (unless ``shuffle`` is False)."""
    epochs = []
    for _ in range(num_epochs):
        epoch = documents.copy()
        if shuffle:
            rng.shuffle(epoch)
        epochs.append(epoch)
    return np.concatenate(epochs).astype(np.int32) if epochs else np.zeros(0, np.int32)


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Start (document-index position, offset) of each sample, plus the end of the last one.

    Sample ``i`` covers the tokens from ``index[i]`` up to and including ``index[i + 1]``: ``seq_length + 1``
    tokens, the last shared with the next sample."""
    lengths = sizes[document_index].astype(np.int64)
    # Global token position where each document of the document index starts.
    starts = np.concatenate([[0], np.cumsum(lengths)])
    targets = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if targets[-1] >= starts[-1]:
        raise DataError(
            f"the data holds {starts[-1]} tokens, fewer than the {targets[-1] + 1} that {num_samples} samples need"
        )
    position = np.searchsorted(starts, targets, side="right") - 1
    offset = targets - starts[position]
    return np.stack([position, offset], axis=1).astype(np.int64)


class SampleCutter:
    """``build_sample_index``'s samples from a stream of documents (``--streaming``): documents' ids concatenated in
    order, cut into ``seq_length + 1`` tokens, consecutive samples sharing one boundary token. ``add`` takes a
    document's ids and returns the samples it completed (``{"text": ids}``); ``state_dict`` is the tokens not yet
    in a sample (a checkpoint keeps them)."""

    def __init__(self, seq_length: int) -> None:
        self.seq_length = seq_length
        self.tokens: list[int] = []

    def add(self, ids: Sequence[int]) -> list[dict[str, list[int]]]:
        self.tokens.extend(ids)
        samples = []
        start = 0
        while len(self.tokens) - start > self.seq_length:
            samples.append({"text": self.tokens[start : start + self.seq_length + 1]})
            start += self.seq_length
        del self.tokens[:start]
        return samples

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens = list(state["tokens"])


def document_ids(row: dict[str, Any], tokenizer: Any, key: str = "text") -> list[list[int]]:
    """A streamed document's ids ending with the tokenizer's EOD, as ``rapidlite-preprocess --append-eod`` writes
    them (a row without text: none)."""
    text = row.get(key)
    if not isinstance(text, str) or not text:
        return []
    return [list(tokenizer.tokenize(text)) + [tokenizer.eod]]


def build_blending_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample, which dataset serves it and that dataset's sample number.

    Sample ``k`` of dataset ``j`` is due at time ``(k + 0.5) / w_j``; serving samples in order of their due
    time keeps every dataset within one sample of its share at every point (as Megatron's greedy
    interleaving does), vectorised: a Python loop over millions of samples would stall the start."""
    weights = np.asarray(weights, dtype=np.float64)
    counts = [int(np.ceil(w * num_samples)) + 1 for w in weights]
    due = np.concatenate([(np.arange(n) + 0.5) / w for w, n in zip(weights, counts, strict=True)])
    source = np.concatenate([np.full(n, j, dtype=np.int16) for j, n in enumerate(counts)])
    number = np.concatenate([np.arange(n, dtype=np.int64) for n in counts])
    order = np.argsort(due, kind="stable")[:num_samples]
    return source[order], number[order]


def _cache_dir(prefix: str) -> Path:
    beside = Path(f"{prefix}_cache")
    try:
        beside.mkdir(parents=True, exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    digest = hashlib.sha1(os.path.abspath(prefix).encode()).hexdigest()[:12]
    return make_cache_dir(Path(cache_root()) / "index_cache" / f"{Path(prefix).name}_{digest}")


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents ``[start, end)`` of ``indexed``.

    ``dataset[i]`` → ``{"text": int64 tensor [seq_length + 1]}`` (Megatron's key)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        prefix: str,
        name: str,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.indexed, self.name = indexed, name
        self.seq_length = seq_length
        start, end = document_range
        documents = np.arange(start, end, dtype=np.int32)
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[start:end].sum())
        self.cache_hit = False
        if num_samples <= 0 or end <= start:
            self.document_index = np.zeros(0, np.int32)
            self.sample_index = np.zeros((1, 2), np.int64)
            self.shuffle_index = np.zeros(0, np.int64)
            return
        if tokens_per_epoch <= 1:
            raise DataError(f"{prefix}: the {name} split has {tokens_per_epoch} tokens; it needs more data")
        # Samples overlap by one token: an epoch gives (tokens - 1) // seq_length of them.
        num_epochs = max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))
        while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
            num_epochs += 1
        params = {
            "version": INDEX_VERSION,
            "prefix": os.path.basename(prefix),
            "sequences": len(indexed),
            "tokens": tokens_per_epoch,
            "range": [start, end],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "epochs": num_epochs,
            "shuffle": shuffle,
        }
        key = hashlib.md5(json.dumps(params, sort_keys=True).encode()).hexdigest()
        directory = _cache_dir(prefix)
        paths = {kind: directory / f"{name}_{key}_{kind}_index.npy" for kind in ("doc", "sample", "shuffle")}
        if all(p.is_file() for p in paths.values()):
            self.cache_hit = True
            self.document_index = np.load(paths["doc"], mmap_mode="r", allow_pickle=False)
            self.sample_index = np.load(paths["sample"], mmap_mode="r", allow_pickle=False)
            self.shuffle_index = np.load(paths["shuffle"], mmap_mode="r", allow_pickle=False)
            return
        self.cache_hit = False
        rng = np.random.RandomState(seed)
        self.document_index = build_document_index(documents, num_epochs, rng, shuffle)
        self.sample_index = build_sample_index(sizes, self.document_index, seq_length, num_samples)
        order = rng.permutation(num_samples) if shuffle else np.arange(num_samples)
        self.shuffle_index = order.astype(np.int64)
        for kind, array in (
            ("doc", self.document_index),
            ("sample", self.sample_index),
            ("shuffle", self.shuffle_index),
        ):
            _save_atomic(paths[kind], array)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, sample: int) -> np.ndarray:
        """The tokens of sample number ``sample`` in unshuffled order."""
        (first, first_offset), (last, last_offset) = self.sample_index[sample], self.sample_index[sample + 1]
        if first == last:
            return np.asarray(
                self.indexed.get(
                    int(self.document_index[first]), int(first_offset), int(last_offset - first_offset + 1)
                )
            )
        parts = [self.indexed.get(int(self.document_index[first]), int(first_offset))]
        for position in range(first + 1, last):
            parts.append(self.indexed.get(int(self.document_index[position])))
        parts.append(self.indexed.get(int(self.document_index[last]), 0, int(last_offset + 1)))
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.sample_tokens(int(self.shuffle_index[index]))
        return {"text": torch.from_numpy(tokens.astype(np.int64))}


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from several datasets in proportion to their weights (deterministic interleaving)."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], num_samples: int):
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_index(weights, num_samples)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> Any:
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]


def check_mmap_data(data_prefix: Sequence[str] | str, data_impl: str, skip_warmup: bool) -> None:
    """Megatron's ``data_impl`` (only the mmap format exists here) and ``--mmap-warmup``: with
    ``skip_warmup=False`` each ``.bin`` is read once, so the page cache holds it."""
    if data_impl not in ("mmap", "infer"):
        raise ConfigError(f"--data-impl {data_impl}: only the mmap format is supported (rapidlite-preprocess)")
    if not skip_warmup:
        for _, prefix in parse_data_path([data_prefix] if isinstance(data_prefix, str) else data_prefix):
            with open(f"{prefix}.bin", "rb") as f:
                while f.read(1 << 24):
                    pass


def check_token_ids(indexed: IndexedDataset, prefix: str, vocab_size: int) -> None:
    if np.iinfo(indexed.dtype).max < vocab_size:  # the dtype cannot hold an id outside the vocabulary
        return
    largest = indexed.max_token_id()
    if largest >= vocab_size:
        raise DataError(
            f"--data-path {prefix}: token id {largest} is outside the tokenizer's vocabulary ({vocab_size} ids): the "
            "data was made with another tokenizer; preprocess it with this one or pass the one it was made with"
        )


def build_train_valid_test_datasets(
    data_prefix: Sequence[str],
    splits_string: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    data_impl: str = "mmap",
    skip_warmup: bool = True,
    vocab_size: int | None = None,
) -> tuple[Any, Any, Any]:
    """Megatron's entry point: GPT train/valid/test datasets from one or more (weighted) prefixes.

    ``skip_warmup=False`` (``--mmap-warmup``) reads each ``.bin`` once first, so the page cache holds it.
    ``vocab_size``: every token id must be below it (checked when the data is opened: one pass over each
    ``.bin``), so data made with another tokenizer is one line, not an index error mid-step."""
    check_mmap_data(data_prefix, data_impl, skip_warmup)
    blend = parse_data_path(data_prefix)
    if vocab_size is not None:
        for _, prefix in blend:
            check_token_ids(IndexedDataset(prefix), prefix, vocab_size)
    names = ("train", "valid", "test")
    if len(blend) == 1:
        (_, prefix), out = blend[0], []
        indexed = IndexedDataset(prefix)
        ranges = split_ranges(len(indexed), splits_string)
        for name, doc_range, n in zip(names, ranges, train_valid_test_num_samples, strict=True):
            dataset = GPTDataset(indexed, prefix, name, doc_range, n, seq_length, seed) if n > 0 else None
            out.append(dataset if dataset is not None and len(dataset) > 0 else None)
        return tuple(out)
    out = []
    for i, (name, n) in enumerate(zip(names, train_valid_test_num_samples, strict=True)):
        if n <= 0:
            out.append(None)
            continue
        parts, weights = [], []
        for weight, prefix in blend:
            indexed = IndexedDataset(prefix)
            doc_range = split_ranges(len(indexed), splits_string)[i]
            if doc_range[1] <= doc_range[0]:
                continue
            # A little more than each share, so the greedy interleaving never runs a dataset dry.
            share = int(math.ceil(weight * n * 1.005)) + 1
            parts.append(GPTDataset(indexed, prefix, name, doc_range, share, seq_length, seed))
            weights.append(weight)
        total = sum(weights)
        out.append(BlendedDataset(parts, [w / total for w in weights], n) if parts else None)
    return tuple(out)


# ----------------------------------------------------------------------------------------- batches
def gpt_batch(
    text: torch.Tensor,
    eod: int | None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Megatron's ``get_ltor_masks_and_position_ids``: inputs, labels, loss mask, position ids and (with
    ``reset_attention_mask``) a causal mask that does not cross EOD tokens (``True`` = attend), with the same
    documents as numbers per token (``segment_ids``: a document starts after each EOD)."""
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    batch, length = tokens.shape
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    if eod_mask_loss and eod is not None:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, length).clone()
    attention_mask = segment_ids = None
    if reset_attention_mask and eod is not None:
        after_eod = (tokens[:, :-1] == eod).long().cumsum(1)
        segment_ids = torch.cat((torch.zeros_like(tokens[:, :1]), after_eod), dim=1)
    if reset_attention_mask:
        attention_mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=tokens.device))
        attention_mask = attention_mask.unsqueeze(0).repeat(batch, 1, 1).unsqueeze(1)
    if (reset_position_ids or reset_attention_mask) and eod is not None:
        for b in range(batch):
            for i in (tokens[b] == eod).nonzero().flatten().tolist():
                if i + 1 >= length:
                    continue
                if reset_attention_mask:
                    attention_mask[b, 0, i + 1 :, : i + 1] = False
                if reset_position_ids:
                    position_ids[b, i + 1 :] -= position_ids[b, i + 1].item()
    return {
        "input_ids": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "segment_ids": segment_ids,
    }


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Megatron's name and order for the inputs ``tokens`` (already shifted): ``(attention_mask, loss_mask,
    position_ids)``. ``attention_mask`` is None unless ``reset_attention_mask`` (plain causal attention)."""
    # gpt_batch takes the unshifted text: append a dummy label column and use its masks.
    padded = torch.cat([tokens, tokens[:, -1:]], dim=1)
    batch = gpt_batch(padded, eod, eod_mask_loss, reset_position_ids, reset_attention_mask)
    return batch["attention_mask"], batch["loss_mask"], batch["position_ids"]
