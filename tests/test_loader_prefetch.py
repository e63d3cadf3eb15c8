"""DeviceDataLoader's one-batch look-ahead (on by default on CUDA, forced here on the CPU) hands out exactly the
batches, padding rows and errors of the plain loader; training loaders with workers keep them across epochs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from rapidlite.data.loader import DeviceDataLoader, GatherTrim, build_data_loader

CPU = torch.device("cpu")


class Numbers(Dataset):
    """Sample i is ``{"x": [i], "id": i}``; asking for ``fail_at`` raises."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.fetched = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is broken")
        self.fetched += 1
        return {"x": torch.tensor([float(i)]), "id": torch.tensor(i)}


def ahead(loader: DeviceDataLoader) -> DeviceDataLoader:
    """The same loader (same DataLoader, sampler and trim) with the look-ahead forced on."""
    return DeviceDataLoader(loader.loader, CPU, loader.gather_trim, prefetch=True)


def ids(batch) -> list[int]:
    return batch["id"].tolist()


def test_prefetch_is_on_for_cuda_only():
    loader = DataLoader(Numbers(4), batch_size=2)
    assert DeviceDataLoader(loader, torch.device("cuda")).prefetch
    assert not DeviceDataLoader(loader, CPU).prefetch


def test_the_next_batch_is_fetched_while_the_current_one_is_in_use():
    for prefetch, fetched in ((False, 2), (True, 4)):
        data = Numbers(10)
        batches = iter(DeviceDataLoader(DataLoader(data, batch_size=2), CPU, prefetch=prefetch))
        next(batches)
        assert data.fetched == fetched


def test_training_batches_are_the_same_with_prefetch():
    plain = build_data_loader(Numbers(23), 4, CPU, shuffle=True, seed=3)
    prefetching = ahead(plain)
    for epoch, start_batch in ((0, 0), (1, 0), (2, 3)):
        runs = []
        for loader in (plain, prefetching):
            loader.set_epoch(epoch, start_batch=start_batch)
            runs.append([ids(b) for b in loader])
        assert runs[0] == runs[1]
        assert len(runs[1]) == len(prefetching) == len(plain)
    assert prefetching.batch_size == 4  # other attributes are the DataLoader's


@pytest.mark.parametrize("rank", [0, 1])
def test_padded_evaluation_batches_and_padding_rows_are_the_same_with_prefetch(rank):
    """World size 2, 11 samples, micro-batch 3: the last global batch is split 3 + 3 over 5 samples, so rank
    1's last batch ends with a padding row (a repeat), which ``padding_rows`` and the gather trim report."""
    trim = GatherTrim()
    plain = build_data_loader(Numbers(11), 3, CPU, shuffle=False, rank=rank, world_size=2, gather_trim=trim)

    def seen(loader: DeviceDataLoader) -> list[tuple]:
        out = []
        for batch in loader:
            out.append((ids(batch), loader.padding_rows, trim.rows, trim.padding, len(trim(batch["id"]))))
        assert loader.padding_rows == trim.rows == trim.padding == 0  # cleared when the loop ends
        return out

    expected, got = seen(plain), seen(ahead(plain))
    assert got == expected
    padding = [entry[1] for entry in expected]
    assert padding == ([0, 1] if rank == 1 else [0, 0])


def test_padding_rows_are_cleared_when_evaluation_stops_early():
    trim = GatherTrim()
    loader = ahead(build_data_loader(Numbers(11), 3, CPU, shuffle=False, rank=1, world_size=2, gather_trim=trim))
    batches = iter(loader)
    next(batches)
    assert (trim.rows, loader.padding_rows) == (3, 0)
    last = next(batches)
    assert ids(last) == [9, 10, 10] and loader.padding_rows == trim.padding == 1
    batches.close()
    assert loader.padding_rows == trim.rows == trim.padding == 0


@pytest.mark.parametrize("fail_at", [0, 5, 9])
def test_an_error_comes_after_the_batches_before_it(fail_at):
    def drain(prefetch: bool) -> tuple[list[list[int]], str]:
        loader = DeviceDataLoader(DataLoader(Numbers(10, fail_at), batch_size=2), CPU, prefetch=prefetch)
        received = []
        with pytest.raises(ValueError, match=f"sample {fail_at} is broken") as error:
            for batch in loader:
                received.append(ids(batch))
        return received, str(error.value)

    assert drain(prefetch=True) == drain(prefetch=False)
    assert len(drain(prefetch=True)[0]) == fail_at // 2


def test_training_loaders_keep_their_workers_and_still_reshuffle():
    loader = build_data_loader(Numbers(12), 4, CPU, shuffle=True, seed=5, num_workers=1)
    assert loader.persistent_workers
    evaluation = build_data_loader(Numbers(12), 4, CPU, shuffle=False, num_workers=1)
    assert not evaluation.persistent_workers
    reference = build_data_loader(Numbers(12), 4, CPU, shuffle=True, seed=5)
    orders = []
    for epoch, start_batch in ((0, 0), (1, 0), (1, 1)):
        loader.set_epoch(epoch, start_batch=start_batch)
        reference.set_epoch(epoch, start_batch=start_batch)
        order = [ids(b) for b in loader]
        assert order == [ids(b) for b in reference]
        orders.append(order)
    assert orders[0] != orders[1] and orders[2] == orders[1][1:]
