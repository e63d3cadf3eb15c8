"""``--streaming``: training data read, tokenized and packed as it is consumed, never all in memory.

A source is a JSON-lines file, a parquet file, a ``datasets`` dataset saved with ``save_to_disk``, or a directory
holding a ``train.*`` file (and a held-out ``validation.*`` one) of those kinds (``stream_source``). Its rows are
read in file order, pass after pass, and dealt round-robin to the data-parallel ranks: row ``g`` of a pass is rank
``g % world_size``'s. A rank's rows are numbered on (``k`` = 0, 1, ... over all passes), and its loader workers
encode them round-robin: worker ``w`` of ``W`` encodes the rows ``k`` with ``(k - start) % W == w`` and yields one
item per row, skipped rows included, so torch's ``DataLoader``, which takes its workers' items in turn, hands them
back in ``k`` order whatever ``W`` is (``_EncodedRows``). Packing then happens in the main process, in that order
(``TokenStream``): the samples a rank trains are the same with 0, 1 or 2 workers.

A ``TokenStream``'s ``state_dict`` is its position between micro-batches: the next row ``k`` to take, the samples
made but not yet batched, and the packer's unfinished pack. A checkpoint keeps every rank's; a resumed stream
starts its workers at row ``k`` (the rows before it are read past, not encoded) and continues with the next unseen
row, so the resumed run sees the samples the uninterrupted one would.

Encoding is the task's own (``rapidlite.data.instruction.encode_row`` for ``--task causal_lm``, a document's ids
and EOD for ``--task pretraining``), and so is packing (``packing.Packer``, ``gpt_dataset.SampleCutter``).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from rapidlite.data.documents import iter_documents
from rapidlite.errors import DataError

STREAM_EXTENSIONS = ("jsonl", "json", "parquet")
_SPLIT_STEMS = {"train": ("train",), "validation": ("validation", "val", "dev", "valid")}


@dataclass(frozen=True)
class StreamSource:
    """Where a streaming run reads: its training rows, and a held-out validation file (or saved split), if any."""

    train: str
    validation: str | None = None


def _saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _stream_file(path: str) -> bool:
    return path.rsplit(".", 1)[-1].lower() in STREAM_EXTENSIONS


def stream_source(path: str) -> StreamSource:
    """``--data-path`` for ``--streaming``: a file (no validation: hold rows out in a file of their own), a saved
    ``datasets`` dataset (its ``validation`` split where it is a saved DatasetDict), or a directory of split files
    (``train.jsonl`` and ``validation.jsonl``, say)."""
    if os.path.isfile(path):
        if not _stream_file(path):
            raise DataError(
                f"--data-path {path} --streaming: streams JSON lines (.jsonl/.json), parquet or a saved datasets "
                "directory; convert the file or drop --streaming"
            )
        return StreamSource(path)
    if not os.path.isdir(path):
        raise DataError(
            f"--data-path {path} --streaming: no such file or directory (streaming reads local data: hub datasets "
            "need a network; save one with save_to_disk and name that directory)"
        )
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = {
            name: os.path.join(path, name) for name in os.listdir(path) if _saved_dataset(os.path.join(path, name))
        }
        valid = next((splits[s] for s in _SPLIT_STEMS["validation"] if s in splits), None)
        if "train" not in splits:
            raise DataError(f"--data-path {path} --streaming: the saved DatasetDict has no train split")
        return StreamSource(splits["train"], valid)
    if _saved_dataset(path):
        return StreamSource(path)
    found = {}
    for split, stems in _SPLIT_STEMS.items():
        files = [f"{stem}.{ext}" for stem in stems for ext in STREAM_EXTENSIONS]
        hits = [os.path.join(path, f) for f in files if os.path.isfile(os.path.join(path, f))]
        if len(hits) > 1:
            raise DataError(f"--data-path {path}: several {split} files ({', '.join(hits)}); keep only one")
        found[split] = hits[0] if hits else None
    if found["train"] is None:
        raise DataError(
            f"--data-path {path} --streaming: no train.jsonl, train.json or train.parquet there (nor a dataset saved "
            "with save_to_disk)"
        )
    return StreamSource(found["train"], found["validation"])


def iter_rows(path: str) -> Iterator[Any]:
    """The rows of ``path`` in order, each a dict or a JSON line's text (``as_row`` parses it: only the rows a
    worker encodes are parsed). Parquet is read a record batch at a time, a saved dataset through its memory map."""
    if os.path.isdir(path):
        import datasets

        yield from datasets.load_from_disk(path)
    elif path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from batch.to_pylist()
    else:
        for _, line in iter_documents(path, "jsonl"):  # blank lines are no rows, as for the map-style reader
            yield line


def as_row(item: Any, path: str = "") -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    try:
        row = json.loads(item)
    except ValueError:
        row = None
    if not isinstance(row, dict):
        raise DataError(f"{path}: a line is not a JSON object: {item[:80]!r}; fix or remove it")
    return row


def first_row(path: str) -> dict[str, Any]:
    """The first row of ``path`` (its columns tell the row format); an empty source is one line."""
    item = next(iter_rows(path), None)
    if item is None:
        raise DataError(f"{path}: no rows; give it rows")
    return as_row(item, path)


def validation_rows(source: StreamSource) -> Any:
    """The held-out validation rows as a ``datasets.DatasetDict`` with one ``validation`` split, or None: a
    validation set is small, so it is read whole and evaluated whole, as a map-style run's is."""
    if source.validation is None:
        return None
    import datasets

    if os.path.isdir(source.validation):
        rows = datasets.load_from_disk(source.validation)
    else:
        from rapidlite.data.tabular import _load_file

        rows = _load_file(source.validation)
    return datasets.DatasetDict({"validation": rows})


def _identity(item: Any) -> Any:
    return item


class _EncodedRows(IterableDataset):
    """This rank's rows from ``start`` on, as ``(k, pass, encode(row))``, endlessly (pass after pass); a pass with
    no row for this rank ends it. See the module docstring for the worker split."""

    def __init__(self, path: str, encode: Callable[[dict[str, Any]], Any], rank: int, world_size: int, start: int):
        self.path, self.encode, self.rank, self.world_size, self.start = path, encode, rank, world_size, start

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        k = 0
        for epoch in itertools.count():
            mine = 0
            for g, item in enumerate(iter_rows(self.path)):
                if g % self.world_size != self.rank:
                    continue
                mine += 1
                if k >= self.start and (k - self.start) % workers == worker:
                    yield k, epoch, self.encode(as_row(item, self.path))
                k += 1
            if not mine:
                return


class TokenStream:
    """A rank's endless stream of collated micro-batches from a streamed source. ``encode(row)`` returns the row's
    samples-to-be (a list, empty for a row that yields none); ``packer`` turns them into samples (``add(piece) ->
    samples``, with ``state_dict``/``load_state_dict``); ``collate`` batches ``micro_batch_size`` samples."""

    def __init__(
        self,
        path: str,
        encode: Callable[[dict[str, Any]], list[Any]],
        packer: Any,
        micro_batch_size: int,
        collate: Callable[[list[Any]], Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
    ) -> None:
        self.path, self.encode, self.packer = path, encode, packer
        self.micro_batch_size, self.collate = micro_batch_size, collate
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.next_row = 0
        self.pending: collections.deque[Any] = collections.deque()

    def state_dict(self) -> dict[str, Any]:
        """The position between micro-batches: the next row, samples made but not batched, the unfinished pack."""
        return {"row": self.next_row, "pending": list(self.pending), "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_row = int(state["row"])
        self.pending = collections.deque(state["pending"])
        self.packer.load_state_dict(state["packer"])

    def rows(self) -> DataLoader:
        """The encoded rows from ``next_row`` on, ``num_workers`` processes encoding them."""
        rows = _EncodedRows(self.path, self.encode, self.rank, self.world_size, self.next_row)
        # A private generator: starting the loader must not draw from the global RNG (dropout), or an evaluation's
        # stream, started mid-run, would shift the training run's masks from a resumed run's.
        generator = torch.Generator()
        return DataLoader(
            rows, batch_size=None, num_workers=self.num_workers, collate_fn=_identity, generator=generator
        )

    def __iter__(self) -> Iterator[Any]:
        first_pass, pieces_in_pass = None, {}
        for k, epoch, pieces in self.rows():
            if k != self.next_row:  # the workers' items came back out of order: a bug, not the user's
                raise RuntimeError(f"streamed row {k} arrived where row {self.next_row} was due")
            if first_pass is None:
                first_pass = epoch
            if epoch - 1 > first_pass and not pieces_in_pass.get(epoch - 1):  # a whole pass read, nothing made
                raise DataError(
                    f"--streaming: no row of {self.path} for data-parallel rank {self.rank} gives a training sample "
                    "(each lacks its fields or keeps no trained token within --seq-length); fix the data"
                )
            pieces_in_pass[epoch] = pieces_in_pass.get(epoch, 0) + len(pieces)
            self.next_row += 1
            for piece in pieces:
                self.pending.extend(self.packer.add(piece))
            while len(self.pending) >= self.micro_batch_size:
                yield self.collate([self.pending.popleft() for _ in range(self.micro_batch_size)])
        raise DataError(
            f"--streaming: {self.path} has no row for data-parallel rank {self.rank} of {self.world_size}; give it "
            "at least as many rows as ranks"
        )


class Unpacked:
    """The packer of unpacked samples: each encoded row (or window) is a sample of its own."""

    def add(self, piece: Any) -> list[dict[str, list[int]]]:
        return [{"input_ids": piece.input_ids, "labels": piece.labels}]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def gathered_states(stream: TokenStream) -> list[dict[str, Any]]:
    """Every rank's stream state, in global rank order (a collective under torch.distributed)."""
    import torch.distributed as dist

    state = stream.state_dict()
    if not dist.is_initialized():
        return [state]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    return gathered


def restore_state(stream: TokenStream, states: list[dict[str, Any]]) -> None:
    """This rank's entry of ``gathered_states``; a resume under another number of ranks is one line."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(states) != world:
        raise DataError(
            f"--streaming: the checkpoint's data position is {len(states)} ranks' streams and this run has {world} "
            f"ranks: each rank read its round-robin share of the rows (row g of a pass went to rank g % "
            f"{len(states)}) and holds samples and a partial pack of its own, which cannot be dealt to {world} ranks "
            "without repeating or skipping rows; resume a streaming run with the number of ranks it was saved with"
        )
    stream.load_state_dict(states[dist.get_rank() if dist.is_initialized() else 0])


def stack_samples(samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Fixed-length samples (``gpt_dataset.SampleCutter``'s) as one batch of tensors."""
    return {key: torch.tensor([s[key] for s in samples], dtype=torch.int64) for key in samples[0]}
