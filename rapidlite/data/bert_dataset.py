"""Megatron's BERT pretraining dataset over sentence-split mmap data: masked LM plus next-sentence prediction.

The data comes from ``rapidlite-preprocess --split-sentences``: each sentence is one sequence of the indexed
dataset and ``document_indices`` groups sentences into documents. ``--split`` divides the documents (not
the sentences) into train/valid/test.

Samples mapping (Megatron's ``get_samples_mapping``), built once and cached as ``.npy`` beside the data
(``PREFIX_cache/``, the GPT dataset's cache helpers): the documents of the split are walked in order, epoch
after epoch until ``num_samples`` entries exist. Consecutive sentences of a document are grouped greedily
until they reach a target length: ``seq_length - 3`` tokens (``[CLS] A [SEP] B [SEP]``; ``seq_length - 2``
without the binary head), or with probability ``short_seq_prob`` a random target in ``[2, that]``. A group
is closed early only when at least two sentences remain in the document and it holds the two sentences NSP
needs, so the last group of a document also has two. Documents with fewer than two sentences are skipped
with the binary head (one sentence suffices without it). Each entry is ``(first sentence, end sentence,
target length)``; each epoch's entries are shuffled, epochs are concatenated and cut at ``num_samples``,
so every full epoch is served exactly once. Unlike Megatron, documents holding a sentence over 512 tokens
are not skipped: truncation shortens such a sample instead.

``dataset[i]`` draws everything from a generator seeded with ``(seed, i)``, so an item does not depend on
the access order or on the DataLoader worker that builds it:

- segments: the entry's sentences are cut at a random sentence boundary into A and B. Next-sentence
  prediction follows Megatron's BERT (not Google's): with probability 0.5 A and B are *swapped* (B comes
  from the same document, just in the wrong order) and the sample is labelled random, instead of B being
  taken from another document;
- truncation (Megatron's ``truncate_segments``): while the pair exceeds the target length, one token is
  removed from the longer segment (B on a tie), from its front or back with equal probability;
- masking (Megatron's ``create_masked_lm_predictions`` at token level, no whole-word masking):
  ``max(1, round(mask_prob * n))`` of the ``n`` text tokens (never ``[CLS]``/``[SEP]``/``[PAD]``) are
  predicted; of those 80% become ``[MASK]``, 10% a random non-special vocabulary id, 10% stay as they are.

Items use the names of Hugging Face's ``BertForPreTraining``, so a collated batch goes straight into it:
``input_ids``, ``token_type_ids`` (0 for ``[CLS]`` A ``[SEP]`` and padding, 1 for B ``[SEP]``),
``attention_mask`` (1 real, 0 padding), ``labels`` (the original id where a token is predicted, -100
elsewhere) and ``next_sentence_label`` (0 = B follows A, 1 = swapped; Hugging Face's convention). Without
the binary head an item is ``[CLS] A [SEP]`` and has no ``next_sentence_label`` key, which suits
``BertForMaskedLM``. All are int64 tensors of ``seq_length`` (``next_sentence_label`` is a scalar).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rapidlite.data.gpt_dataset import (
    BlendedDataset,
    _cache_dir,
    _save_atomic,
    parse_data_path,
    split_ranges,
)
from rapidlite.data.indexed_dataset import IndexedDataset
from rapidlite.errors import ConfigError, DataError

MAPPING_VERSION = 1
MIN_SEQ_LENGTH = 8
IGNORE_INDEX = -100  # the label torch's cross entropy (and Hugging Face) ignores


def check_bert_config(seq_length: int, mask_prob: float, short_seq_prob: float) -> None:
    """ConfigError for a ``--seq-length``, ``--mask-prob`` or ``--short-seq-prob`` BERT cannot use."""
    if seq_length < MIN_SEQ_LENGTH:
        raise ConfigError(
            f"--seq-length {seq_length}: BERT samples need at least {MIN_SEQ_LENGTH} tokens "
            "([CLS] A [SEP] B [SEP] and some text); raise it (512 is usual)"
        )
    if not 0.0 < mask_prob <= 1.0:
        raise ConfigError(f"--mask-prob {mask_prob}: must be in (0, 1]; 0.15 is usual")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ConfigError(f"--short-seq-prob {short_seq_prob}: must be in [0, 1]; 0.1 is usual")


def _seed_key(seed: int) -> int:
    return int(seed) % (1 << 64)  # numpy seed sequences take non-negative integers


# ----------------------------------------------------------------------------------------- mapping
def build_samples_mapping(
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    document_range: tuple[int, int],
    num_samples: int,
    max_tokens: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int = 2,
) -> np.ndarray:
    """``[num_samples, 3]`` int64 rows ``(first sentence, end sentence, target length)``, see the module doc.

    Documents of ``document_range`` with fewer than ``min_sentences`` sentences are skipped; the caller
    makes sure at least one is left (else no epoch yields a sample)."""
    start, end = document_range
    bounds = np.asarray(document_indices[start : end + 1], dtype=np.int64)
    counts = np.diff(bounds)
    eligible = [(int(bounds[d]), int(bounds[d + 1])) for d in np.flatnonzero(counts >= max(1, min_sentences))]
    if num_samples <= 0 or not eligible:
        return np.zeros((0, 3), np.int64)
    lengths = np.asarray(sequence_lengths[bounds[0] : bounds[-1]], dtype=np.int64).tolist()
    base = int(bounds[0])
    rng = np.random.default_rng(_seed_key(seed))

    def target() -> int:
        if short_seq_prob > 0 and rng.random() < short_seq_prob:
            return int(rng.integers(2, max_tokens + 1))
        return max_tokens

    epochs, total = [], 0
    while total < num_samples:
        rows: list[tuple[int, int, int]] = []
        for first, last in eligible:
            group_start, size, goal = first, 0, target()
            for sentence in range(first, last):
                size += lengths[sentence - base]
                remaining = last - sentence - 1
                if (size >= goal and remaining > 1 and sentence - group_start + 1 >= min_sentences) or remaining == 0:
                    rows.append((group_start, sentence + 1, goal))
                    group_start, size = sentence + 1, 0
                    if remaining:
                        goal = target()
        epoch = np.asarray(rows, dtype=np.int64)
        epochs.append(epoch[rng.permutation(len(epoch))])
        total += len(epoch)
    return np.ascontiguousarray(np.concatenate(epochs)[:num_samples])


# ----------------------------------------------------------------------------------------- samples
def truncation_counts(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """Tokens Megatron's ``truncate_segments`` removes from A and B: one at a time from the longer
    segment (B on a tie) until ``len_a + len_b <= max_tokens``; computed without the loop."""
    excess = len_a + len_b - max_tokens
    if excess <= 0:
        return 0, 0
    if len_a > len_b:
        first = min(excess, len_a - len_b)  # A down to B's length; then B, A, B, ... alternate
        rest = excess - first
        return first + rest // 2, (rest + 1) // 2
    first = min(excess, len_b - len_a + 1)  # B down to one below A; then A, B, A, ... alternate
    rest = excess - first
    return (rest + 1) // 2, first + rest // 2


def truncate_segments(
    seg_a: np.ndarray, seg_b: np.ndarray, max_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's truncation: each removed token comes off the front or the back with probability 0.5."""
    cut_a, cut_b = truncation_counts(len(seg_a), len(seg_b), max_tokens)
    out = []
    for segment, cut in ((seg_a, cut_a), (seg_b, cut_b)):
        front = int(rng.binomial(cut, 0.5)) if cut else 0
        out.append(segment[front : len(segment) - (cut - front)])
    return out[0], out[1]


def mask_tokens(
    tokens: np.ndarray,
    candidates: np.ndarray,
    mask_prob: float,
    mask_id: int,
    random_ids: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Masked-LM inputs and labels: ``max(1, round(mask_prob * len(candidates)))`` of the ``candidates``
    positions are predicted (80% ``[MASK]``, 10% a random id of ``random_ids``, 10% unchanged); labels hold
    the original id there and ``IGNORE_INDEX`` elsewhere."""
    inputs = tokens.copy()
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    n = len(candidates)
    if n == 0:
        return inputs, labels
    count = min(n, max(1, int(math.floor(mask_prob * n + 0.5))))
    chosen = rng.choice(candidates, size=count, replace=False)
    labels[chosen] = tokens[chosen]
    draw = rng.random(count)
    inputs[chosen[draw < 0.8]] = mask_id
    replaced = chosen[(draw >= 0.8) & (draw < 0.9)]
    inputs[replaced] = random_ids[rng.integers(0, len(random_ids), len(replaced))]
    return inputs, labels


def _special_ids(tokenizer: Any) -> tuple[int, int, int, int, list[int]]:
    ids = [getattr(tokenizer, name, None) for name in ("cls", "sep", "mask", "pad")]
    if any(i is None for i in ids):
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise ConfigError(
            f"--tokenizer-type {name}: BERT needs [CLS], [SEP], [MASK] and [PAD] tokens; use "
            "BertWordPieceLowerCase (or BertWordPieceCase) with a BERT --vocab-file"
        )
    specials = [int(i) for i in ids]
    unk = getattr(tokenizer, "unk", None)
    if unk is not None:
        specials.append(int(unk))
    cls, sep, mask, pad = specials[:4]
    return cls, sep, mask, pad, specials


class BertDataset(torch.utils.data.Dataset):
    """``num_samples`` BERT samples of ``seq_length`` tokens from documents ``[start, end)`` of ``indexed``.

    ``dataset[i]`` → dict of int64 tensors named for ``BertForPreTraining`` (see the module doc).
    ``samples_mapping[i]`` is the ``(first sentence, end sentence, target length)`` entry of item ``i``."""

    def __init__(
        self,
        indexed: IndexedDataset,
        prefix: str,
        name: str,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        tokenizer: Any,
        mask_prob: float = 0.15,
        short_seq_prob: float = 0.1,
        binary_head: bool = True,
    ) -> None:
        check_bert_config(seq_length, mask_prob, short_seq_prob)
        self.indexed, self.name = indexed, name
        self.seq_length, self.seed = seq_length, int(seed)
        self.mask_prob, self.binary_head = mask_prob, binary_head
        self.cls, self.sep, self.mask, self.pad, specials = _special_ids(tokenizer)
        self.random_ids = np.setdiff1d(np.arange(int(tokenizer.vocab_size), dtype=np.int64), specials)
        if not len(self.random_ids):
            raise ConfigError("--vocab-file: the vocabulary holds only special tokens; BERT needs word pieces")
        self.cache_hit = False
        documents = np.asarray(indexed.document_indices)
        sentences_per_document = np.diff(documents)
        if binary_head and len(sentences_per_document) and int(sentences_per_document.max()) <= 1:
            raise DataError(
                f"{prefix}: every document is a single sequence, so next-sentence prediction has no sentence "
                "pairs; preprocess with rapidlite-preprocess --split-sentences or pass --no-binary-head"
            )
        start, end = document_range
        if num_samples <= 0 or end <= start:
            self.samples_mapping = np.zeros((0, 3), np.int64)
            return
        min_sentences = 2 if binary_head else 1
        if not bool((sentences_per_document[start:end] >= min_sentences).any()):
            what = "two sentences" if binary_head else "a sentence"
            raise DataError(
                f"{prefix}: no document of the {name} split (documents {start}..{end - 1}) has {what}; "
                "give that split more documents with --split"
            )
        max_tokens = seq_length - 3 if binary_head else seq_length - 2
        params = {
            "version": MAPPING_VERSION,
            "kind": "bert",
            "prefix": os.path.basename(prefix),
            "sequences": len(indexed),
            "documents": len(documents) - 1,
            "tokens": int(np.asarray(indexed.sequence_lengths[documents[start] : documents[end]]).sum()),
            "range": [int(start), int(end)],
            "num_samples": int(num_samples),
            "max_tokens": max_tokens,
            "short_seq_prob": float(short_seq_prob),
            "seed": self.seed,
            "binary_head": bool(binary_head),
        }
        key = hashlib.md5(json.dumps(params, sort_keys=True).encode()).hexdigest()
        path = _cache_dir(prefix) / f"{name}_{key}_bert_samples_mapping.npy"
        if path.is_file():
            self.cache_hit = True
            self.samples_mapping = np.load(path, mmap_mode="r", allow_pickle=False)
            return
        self.samples_mapping = build_samples_mapping(
            indexed.sequence_lengths,
            documents,
            (start, end),
            num_samples,
            max_tokens,
            short_seq_prob,
            self.seed,
            min_sentences,
        )
        _save_atomic(path, self.samples_mapping)

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a {self.name} dataset of {len(self)} samples")
        first, end, target = (int(v) for v in self.samples_mapping[index])
        rng = np.random.default_rng([_seed_key(self.seed), index])
        sentences = [self.indexed.get(s) for s in range(first, end)]
        is_random = False
        if self.binary_head:
            a_end = int(rng.integers(1, len(sentences))) if len(sentences) >= 3 else 1
            seg_a, seg_b = np.concatenate(sentences[:a_end]), np.concatenate(sentences[a_end:])
            if rng.random() < 0.5:
                seg_a, seg_b, is_random = seg_b, seg_a, True
        else:
            seg_a, seg_b = np.concatenate(sentences), sentences[0][:0]
        seg_a, seg_b = truncate_segments(seg_a, seg_b, target, rng)
        len_a, len_b = len(seg_a), len(seg_b)

        tokens = np.full(self.seq_length, self.pad, dtype=np.int64)
        token_types = np.zeros(self.seq_length, dtype=np.int64)
        tokens[0], tokens[1 : 1 + len_a], tokens[1 + len_a] = self.cls, seg_a, self.sep
        length = 2 + len_a
        if self.binary_head:
            tokens[length : length + len_b], tokens[length + len_b] = seg_b, self.sep
            token_types[length : length + len_b + 1] = 1
            length += len_b + 1
        candidates = np.r_[1 : 1 + len_a, 2 + len_a : 2 + len_a + len_b]
        inputs, labels = mask_tokens(tokens, candidates, self.mask_prob, self.mask, self.random_ids, rng)
        attention = np.zeros(self.seq_length, dtype=np.int64)
        attention[:length] = 1
        item = {
            "input_ids": torch.from_numpy(inputs),
            "token_type_ids": torch.from_numpy(token_types),
            "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(labels),
        }
        if self.binary_head:
            item["next_sentence_label"] = torch.tensor(int(is_random), dtype=torch.int64)
        return item


def build_bert_train_valid_test_datasets(
    data_prefix: Sequence[str] | str,
    splits_string: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    tokenizer: Any,
    mask_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    binary_head: bool = True,
) -> tuple[Any, Any, Any]:
    """BERT train/valid/test datasets from one or more (weighted) prefixes; None for an empty split.

    ``--split`` divides each prefix's documents (``IndexedDataset.num_documents``), not its sentences."""
    check_bert_config(seq_length, mask_prob, short_seq_prob)
    blend = parse_data_path([data_prefix] if isinstance(data_prefix, str) else data_prefix)
    names = ("train", "valid", "test")
    options = {
        "seq_length": seq_length,
        "seed": seed,
        "tokenizer": tokenizer,
        "mask_prob": mask_prob,
        "short_seq_prob": short_seq_prob,
        "binary_head": binary_head,
    }
    indexed = {prefix: IndexedDataset(prefix) for _, prefix in blend}
    ranges = {prefix: split_ranges(ds.num_documents, splits_string) for prefix, ds in indexed.items()}
    out: list[Any] = []
    for i, (name, n) in enumerate(zip(names, train_valid_test_num_samples, strict=True)):
        if n <= 0:
            out.append(None)
            continue
        if len(blend) == 1:
            prefix = blend[0][1]
            dataset = BertDataset(indexed[prefix], prefix, name, ranges[prefix][i], n, **options)
            out.append(dataset if len(dataset) > 0 else None)
            continue
        parts, weights = [], []
        for weight, prefix in blend:
            doc_range = ranges[prefix][i]
            if doc_range[1] <= doc_range[0]:
                continue
            # A little more than each share, so the greedy interleaving never runs a dataset dry.
            share = int(math.ceil(weight * n * 1.005)) + 1
            parts.append(BertDataset(indexed[prefix], prefix, name, doc_range, share, **options))
            weights.append(weight)
        total = sum(weights)
        out.append(BlendedDataset(parts, [w / total for w in weights], n) if parts else None)
    return out[0], out[1], out[2]
