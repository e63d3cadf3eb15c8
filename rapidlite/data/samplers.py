"""Samplers that shard across data-parallel ranks and resume exactly where a checkpoint left off.

Both draw only from their own seeded generators, never the global RNG, so a resumed run sees
the same data order and the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler


def _tokens(value: Any) -> int:
    """Tokens of one sample's field: its length, or for nested rows (multiple choice: one row per choice) the sum
    of the rows' lengths."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if len(value) and isinstance(value[0], (list, tuple, torch.Tensor)):
        return sum(len(row) for row in value)
    return len(value)


def sample_lengths(dataset: Any, key: str = "input_ids") -> list[int] | None:
    """The token count of every sample of a map-style ``dataset`` (the length of its ``key`` field; summed over the
    rows of a nested field), or None when its samples have no such field. A ``datasets.Dataset`` is read from its
    Arrow column without decoding rows."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and hasattr(dataset, "with_format"):  # a datasets.Dataset (selections included)
        if key not in columns:
            return None
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        column = dataset.with_format("arrow")[key]
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if pa.types.is_list(column.type.value_type) or pa.types.is_large_list(column.type.value_type):
            inner = pc.list_value_length(pc.list_flatten(column)).to_numpy(zero_copy_only=False)
            parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
            return np.bincount(parents, weights=inner, minlength=len(column)).astype(int).tolist()
        return [int(n) for n in pc.list_value_length(column).to_pylist()]
    if len(dataset) == 0:
        return []
    first = dataset[0]
    if not isinstance(first, dict) or key not in first:
        return None
    return [_tokens(dataset[i][key]) for i in range(len(dataset))]


class EpochSampler(Sampler[int]):
    """Map-style datasets, epoch by epoch: a seeded shuffle per epoch (``seed + epoch``), this rank's
    share of it, starting ``start`` samples into the share (to resume mid-epoch).

    With ``pad=True`` (training) the permutation is padded by wrapping around so every rank gets the
    same number of samples; with ``pad=False`` (evaluation) each sample appears exactly once overall.

    With ``lengths`` (one per sample) and ``group_size`` (the global batch) the shuffle is grouped by length as
    the Hugging Face Trainer's ``LengthGroupedSampler`` groups it (its ``get_length_grouped_indices``, on the
    same seeded generator): the permutation is cut into megabatches of ``min(50, samples // (4 x group_size))``
    global batches, each sorted by length, longest first, with the longest sample of all moved to the front.
    A global batch is ``group_size`` consecutive samples of that order, and each rank's micro-batches are its
    strided share of them, so every rank's micro-batch holds samples of about the same length and a resumed
    run (``start``) continues the same order.
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
        lengths: Sequence[int] | None = None,
        group_size: int | None = None,
    ) -> None:
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size, self.pad = rank, world_size, pad
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        if lengths is not None and not (group_size and group_size > 0):
            raise ValueError("grouping by length needs the global batch size (group_size)")
        self.lengths = None if lengths is None else list(lengths)
        self.group_size = group_size
        self.epoch = 0
        self.start = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order): a grouped order is sorted once per epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _shuffled(self) -> list[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.lengths is None:
            return torch.randperm(self.num_samples, generator=g).tolist()
        if self._order is None or self._order[0] != self.epoch:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            self._order = (self.epoch, get_length_grouped_indices(self.lengths, self.group_size, generator=g))
        return list(self._order[1])

    def _indices(self) -> list[int]:
        if self.shuffle:
            order = self._shuffled() if self.num_samples else []
        else:
            order = list(range(self.num_samples))
        if self.pad and self.world_size > 1 and self.num_samples % self.world_size:
            extra = self.world_size - self.num_samples % self.world_size
            order += (order * (extra // max(len(order), 1) + 1))[:extra]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        return max(len(self._indices()) - self.start, 0)


class EvalBatchSampler:
    """Evaluation order over data-parallel ranks, with every rank running the same number of batches.

    Global batch ``k`` holds samples ``[k*G, (k+1)*G)`` (``G`` = micro-batch x ranks); rank ``r`` takes
    its ``r``-th micro-batch slice, so gathering a batch over ranks in rank order gives the samples in
    order. The last global batch is split evenly and padded with repeats of the last sample to a multiple
    of the ranks; padding rows sit at the tail of a rank's batch, and ``padding_rows(i)`` says how many
    the ``i``-th batch of this rank has.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples, self.micro_batch_size = num_samples, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self._batches = self._plan()

    def _plan(self) -> list[tuple[list[int], int]]:
        n, m, w, r = self.num_samples, self.micro_batch_size, self.world_size, self.rank
        full = n // (m * w)
        batches = [(list(range(k * m * w + r * m, k * m * w + (r + 1) * m)), 0) for k in range(full)]
        rest = n - full * m * w
        if rest:
            share = -(-rest // w)  # ceil: every rank gets the same count, the overflow is padding
            first = full * m * w + r * share
            indices = [min(i, n - 1) for i in range(first, first + share)]
            batches.append((indices, max(0, first + share - n)))
        return batches

    def rows(self, index: int) -> tuple[int, int]:
        """(rows, padding rows) of this rank's ``index``-th batch."""
        indices, padding = self._batches[index]
        return len(indices), padding

    def __iter__(self) -> Iterator[list[int]]:
        return iter([indices for indices, _ in self._batches])

    def __len__(self) -> int:
        return len(self._batches)


class PretrainingBatchSampler:
    """Megatron's pretraining sampler: consecutive global batches from ``consumed_samples`` on, this
    rank's micro-batch slice of each; wraps around the dataset (datasets are usually sized for the run)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if total_samples <= 0:
            raise ValueError("the dataset is empty")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed_samples
        step = self.micro_batch_size * self.world_size
        while True:
            first = position + self.rank * self.micro_batch_size
            yield [(first + j) % self.total_samples for j in range(self.micro_batch_size)]
            position += step


def padded_share(
    lengths: Sequence[int], micro_batch_size: int, group_size: int, grouped: bool = True, seed: int = 0
) -> float:
    """The share of the token slots of an epoch's micro-batches that is padding when each is padded to its longest
    sample: the epoch shuffled plainly, or grouped by length (``EpochSampler``) with global batches of
    ``group_size``. One rank's view; ranks' micro-batches of a grouped order are alike."""
    if not lengths:
        return 0.0
    sampler = EpochSampler(len(lengths), seed=seed, lengths=lengths if grouped else None, group_size=group_size)
    order = list(sampler)
    slots = sum(
        max(lengths[i] for i in order[k : k + micro_batch_size]) * len(order[k : k + micro_batch_size])
        for k in range(0, len(order), micro_batch_size)
    )
    return 1 - sum(lengths) / slots if slots else 0.0
