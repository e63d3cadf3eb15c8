"""Data loaders that shard across ranks and hand batches to the model on its device."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from rapidlite.data.collate import PadCollator, packed_sample_count
from rapidlite.data.samplers import EpochSampler, EvalBatchSampler
from rapidlite.errors import DataError


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch; pinned host memory makes the CUDA copy asynchronous."""
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_stats(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch; tokens are the attention-mask ones when there is a mask. A padding-free
    batch (one row with position ids and no mask, ``FlatteningCollator``) holds as many samples as its positions
    restart."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        positions = batch.get("position_ids")
        if mask is None and isinstance(positions, torch.Tensor) and positions.ndim == 2 and positions.shape[0] == 1:
            # A sample of several sequences (a preference pair) packs them all (``sequences_per_sample``).
            per_sample = int(batch.get("sequences_per_sample", 1))
            return packed_sample_count(positions) // per_sample, positions.numel()
        for key in ("input_ids", "text", "tokens", "labels"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.ndim >= 1:
                samples = value.shape[0]
                if isinstance(mask, torch.Tensor) and mask.ndim >= 2:  # [samples, (sequences,) length]
                    return samples, int(mask.sum())
                if key == "text" and value.ndim == 2:  # Megatron's GPT samples: seq + 1 tokens, inputs and shift
                    return samples, samples * (value.shape[1] - 1)
                return samples, value.numel() if value.ndim >= 2 else None
        batch = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.ndim >= 1:
        integer = not batch.is_floating_point()
        return batch.shape[0], batch.numel() if integer and batch.ndim >= 2 else None
    return 0, None


class GatherTrim:
    """Which rows of the batch being evaluated are padding (see ``RapidliteEngine.gather``)."""

    def __init__(self) -> None:
        self.rows = 0
        self.padding = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.padding and tensor.ndim > 0 and tensor.shape[0] == self.rows:
            return tensor[: self.rows - self.padding]
        return tensor


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


class _Copier:
    """Host-to-device copies issued ahead of use. On CUDA they run on a side stream, so batch i+1's copy
    overlaps the step on batch i; ``ready`` makes the compute stream wait for a batch's own copy only."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def issue(self, batch: Any) -> tuple[Any, torch.cuda.Event | None]:
        """``(moved batch, event its copy records)``; the copy is asynchronous from pinned memory."""
        if self.stream is None:
            return to_device(batch, self.device), None
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return moved, copied

    def ready(self, batch: Any, copied: torch.cuda.Event | None) -> Any:
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            # Memory allocated on the side stream and freed after use on the compute stream must not be reused
            # before that use has run.
            for tensor in _tensors(batch):
                if tensor.device.type == "cuda":
                    tensor.record_stream(compute)
        return batch


class DeviceDataLoader:
    """Any batch iterable (usually a ``DataLoader``) whose batches arrive on ``device``. ``set_epoch``
    reshuffles and can skip ahead; ``padding_rows`` is the number of padding rows at the tail of the batch
    last yielded (evaluation loaders over several ranks); other attributes are the wrapped loader's.

    On CUDA batches come one ahead (``prefetch``, default: on for CUDA only): while the caller runs its step
    on batch i, batch i+1 has been fetched and its host-to-device copy issued on a side stream. The CPU has
    nothing to overlap, so there each batch is fetched when asked for; ``prefetch=True`` forces the
    look-ahead anywhere (tests). Either way the batches, their order, ``padding_rows`` and errors are the same:
    an error fetching batch i+1 is raised when the caller asks for it, after batch i."""

    def __init__(
        self, loader: Any, device: torch.device, gather_trim: GatherTrim | None = None, prefetch: bool | None = None
    ) -> None:
        self.loader = loader
        self.device = device
        self.gather_trim = gather_trim
        self.prefetch = device.type == "cuda" if prefetch is None else prefetch
        self.padding_rows = 0
        self.on_batch: Callable[[], Any] | None = None  # called when the caller is done with a batch (a progress bar)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=start_batch * (self.loader.batch_size or 1))

    def _one_ahead(self) -> Iterator[Any]:
        copier = _Copier(self.device)
        batches = iter(self.loader)
        try:
            current = copier.issue(next(batches))
        except StopIteration:
            return
        while True:
            try:
                upcoming = copier.issue(next(batches))
            except StopIteration:
                break
            except Exception:
                yield copier.ready(*current)  # the batch before the failing one first, then the error
                raise
            yield copier.ready(*current)
            current = upcoming
        yield copier.ready(*current)

    def _batches(self) -> Iterator[Any]:
        if self.prefetch:
            return self._one_ahead()
        return (to_device(batch, self.device) for batch in self.loader)

    def __iter__(self) -> Iterator[Any]:
        batches = self._handed_out()
        try:
            for batch in batches:
                yield batch
                if self.on_batch is not None:  # the caller asked for the next batch: this one is done
                    self.on_batch()
        finally:
            batches.close()  # a caller that stops early resets padding_rows now, not when collected

    def _handed_out(self) -> Iterator[Any]:
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        if not isinstance(batch_sampler, EvalBatchSampler):  # training and one-rank loaders: nothing padded
            yield from self._batches()
            return
        trim = self.gather_trim or GatherTrim()
        try:
            # Padding is that of the batch being handed out (the i-th yielded), not of the one fetched ahead.
            for i, batch in enumerate(self._batches()):
                trim.rows, trim.padding = batch_sampler.rows(i)
                self.padding_rows = trim.padding
                yield batch
        finally:
            self.padding_rows = trim.rows = trim.padding = 0

    def __len__(self) -> int:
        return len(self.loader)


def slice_batch(batch: Any, rows: int) -> Any:
    """The first ``rows`` samples of a batch (tensors with a leading batch dimension, nested)."""
    if isinstance(batch, torch.Tensor):
        return batch[:rows] if batch.ndim > 0 else batch
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, rows) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, rows) for v in batch)
    return batch


def unpadded_batches(loader: Any) -> Iterator[Any]:
    """The batches of an evaluation loader without the repeats that even out the ranks' batch counts (its
    ``padding_rows``, at a batch's tail); a batch of repeats only is skipped."""
    for batch in loader:
        padding = getattr(loader, "padding_rows", 0)
        if padding:
            rows = batch_stats(batch)[0] - padding
            if rows <= 0:
                continue
            batch = slice_batch(batch, rows)
        yield batch


def require_map_style(dataset: Any, what: str) -> None:
    """Refuse in one line a dataset the loaders cannot shard, shuffle and resume: one without ``len()`` and
    indexing (an ``IterableDataset``, a streaming ``datasets.IterableDataset``, a generator)."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)  # may define __len__; never indexed
    if not iterable and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return
    raise DataError(
        f"{what} is a {type(dataset).__name__}, which has no length or indexing: rapidlite's loaders shard, "
        "shuffle and resume map-style datasets (a datasets.Dataset, a list, a torch Dataset with __len__ and "
        "__getitem__); materialise it first (list(...), datasets.Dataset.from_generator(...), or load_dataset "
        "without streaming=True)"
    )


def build_data_loader(
    dataset: Dataset,
    micro_batch_size: int,
    device: torch.device,
    *,
    shuffle: bool = True,
    collate_fn: Callable | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    drop_last: bool = False,
    pad: bool | None = None,
    gather_trim: GatherTrim | None = None,
    lengths: Sequence[int] | None = None,
    group_size: int | None = None,
) -> DeviceDataLoader:
    """Shard ``dataset`` over data-parallel ranks and batch it.

    Training loaders (``shuffle``) take a seeded shuffle per epoch, strided over ranks and padded by
    wrapping around so ranks stay in step. Evaluation loaders keep the order (``EvalBatchSampler``):
    equal batch counts on every rank, padding only in the last batches, and ``gather_trim`` told which
    rows are padding. ``pad=False`` gives each rank its exact share instead (batch counts may differ);
    ``pad=True`` without ``shuffle`` is a training loader reading the data in its order.
    Without ``collate_fn``, dict samples of token lists are padded to the longest in the batch
    (``PadCollator``); anything else is collated as torch's ``default_collate`` does. ``lengths`` (one per
    sample, training loaders): the shuffle is grouped by length in megabatches of global batches of
    ``group_size`` samples (``EpochSampler``), so a micro-batch pads little.
    """
    require_map_style(dataset, "the dataset given to build_data_loader")
    if collate_fn is None:  # tokenized rows of different lengths are padded, not refused
        collate_fn = PadCollator()
    # A private generator: creating an iterator must not draw from the global RNG (dropout), or a resumed
    # run would diverge from an uninterrupted one.
    generator = torch.Generator()
    generator.manual_seed(seed)
    common = {
        "collate_fn": collate_fn,
        "num_workers": num_workers,
        "pin_memory": device.type == "cuda",
        "generator": generator,
        # A training loader is iterated once per epoch: its workers stay up instead of restarting each time.
        # Reshuffling still works, as the sampler runs in this process and is re-iterated each epoch.
        "persistent_workers": shuffle and num_workers > 0,
    }
    if not shuffle and pad is None and world_size > 1:
        batches = EvalBatchSampler(len(dataset), micro_batch_size, rank=rank, world_size=world_size)
        return DeviceDataLoader(DataLoader(dataset, batch_sampler=batches, **common), device, gather_trim)
    sampler = EpochSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        pad=shuffle if pad is None else pad,
        lengths=lengths if shuffle else None,
        group_size=group_size,
    )
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=drop_last, **common)
    return DeviceDataLoader(loader, device, gather_trim)
