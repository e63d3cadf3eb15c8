"""Data loaders that shard across ranks and hand batches to the model on its device."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from rapidlite.data.samplers import EpochSampler


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
    """(samples, tokens) of a batch; tokens are the attention-mask ones when there is a mask."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        for key in ("input_ids", "text", "tokens", "labels"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.ndim >= 1:
                samples = value.shape[0]
                if isinstance(mask, torch.Tensor) and mask.ndim == 2:
                    return samples, int(mask.sum())
                return samples, value.numel() if value.ndim >= 2 else None
        batch = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.ndim >= 1:
        integer = not batch.is_floating_point()
        return batch.shape[0], batch.numel() if integer and batch.ndim >= 2 else None
    return 0, None


class DeviceDataLoader:
    """Any batch iterable (usually a ``DataLoader``) whose batches arrive on ``device``. ``set_epoch``
    reshuffles and can skip ahead; other attributes are the wrapped loader's."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if isinstance(sampler, EpochSampler):
            sampler.set_epoch(epoch, start=start_batch * (self.loader.batch_size or 1))

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)


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
) -> DeviceDataLoader:
    """Shard ``dataset`` over data-parallel ranks (a seeded shuffle per epoch) and batch it.

    Training loaders pad the last shard so ranks stay in step (``pad`` defaults to ``shuffle``);
    evaluation loaders do not, so every sample is counted exactly once.
    """
    sampler = EpochSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        pad=shuffle if pad is None else pad,
    )
    # A private generator: creating an iterator must not draw from the global RNG (dropout), or a resumed
    # run would diverge from an uninterrupted one.
    generator = torch.Generator()
    generator.manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        drop_last=drop_last,
        generator=generator,
        persistent_workers=False,
    )
    return DeviceDataLoader(loader, device)
