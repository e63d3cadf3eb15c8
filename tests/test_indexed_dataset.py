"""Megatron mmap indexed dataset: round trips, byte compatibility with the spec, corrupt files."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch

from rapidlite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from rapidlite.errors import DataError

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def make_docs(seed=0, num_docs=12, high=60000):
    """Documents as lists of sequences (1..4 sentences of 0..20 tokens)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, rng.integers(0, 21)) for _ in range(rng.integers(1, 5))] for _ in range(num_docs)]


def write(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for sequence in doc:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def hand_written(prefix, sequences, doc_ends, dtype):
    """``PREFIX.idx``/``.bin`` assembled from the format description with struct and numpy only."""
    dtype = np.dtype(dtype)
    lengths = [len(s) for s in sequences]
    pointers = [sum(lengths[:i]) * dtype.itemsize for i in range(len(lengths))]
    documents = [0, *doc_ends]
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype.type])
    idx += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(documents))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(documents)}q", *documents)
    data = b"".join(np.asarray(s, dtype=dtype.newbyteorder("<")).tobytes() for s in sequences)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(data)
    return idx, data


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_with_sentence_grouping(tmp_path, dtype):
    docs = make_docs(high=60000 if dtype == np.uint16 else 2**31 - 1)
    ds = IndexedDataset(write(tmp_path / "d", docs, dtype))
    sequences = [s for doc in docs for s in doc]
    assert len(ds) == len(sequences) and ds.dtype == dtype
    for got, want in zip(ds, sequences, strict=True):
        assert got.dtype == dtype and np.array_equal(got, want)
    assert ds.sequence_lengths.tolist() == [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    assert ds.sequence_pointers.tolist() == [sum(len(s) for s in sequences[:i]) * itemsize for i in range(len(ds))]
    assert ds.document_indices.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    assert ds.num_documents == len(docs)
    assert IndexedDataset.exists(tmp_path / "d") and not IndexedDataset.exists(tmp_path / "nope")


def test_items_are_zero_copy_views_of_the_memory_map(tmp_path):
    ds = IndexedDataset(write(tmp_path / "d", make_docs()))
    item = ds[3]
    assert item.base is not None and not item.flags.writeable
    assert isinstance(ds.bin_buffer_mmap, np.memmap) and np.shares_memory(item, ds.bin_buffer_mmap)
    assert np.shares_memory(ds.get(3, offset=1), ds.bin_buffer_mmap)
    in_memory = IndexedDataset(str(tmp_path / "d"), mmap=False)
    assert all(np.array_equal(a, b) for a, b in zip(in_memory, ds, strict=True))


def test_get_offsets_slices_and_bounds(tmp_path):
    docs = [[np.arange(10)], [np.arange(100, 105), np.arange(200, 203)]]
    ds = IndexedDataset(write(tmp_path / "d", docs))
    assert ds.get(0, offset=2, length=3).tolist() == [2, 3, 4]
    assert ds.get(0, offset=7).tolist() == [7, 8, 9]
    assert ds.get(np.int64(1), length=2).tolist() == [100, 101]
    assert ds[-1].tolist() == [200, 201, 202]
    assert [a.tolist() for a in ds[1:3]] == [[100, 101, 102, 103, 104], [200, 201, 202]]
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(IndexError):
        ds.get(0, offset=8, length=3)
    # A dataset pickles by path (DataLoader workers) and reopens its maps.
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[2].tolist() == [200, 201, 202]


def test_add_index_merge_equals_writing_everything_at_once(tmp_path):
    docs = make_docs(num_docs=9)
    write(tmp_path / "all", docs)
    for i, part in enumerate((docs[:4], docs[4:4], docs[4:])):  # an empty part merges too
        write(tmp_path / f"part{i}", part)
    merged = IndexedDatasetBuilder(tmp_path / "merged.bin", dtype=np.uint16)
    for i in range(3):
        merged.add_index(tmp_path / f"part{i}")
    merged.finalize(tmp_path / "merged.idx")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"all{suffix}").read_bytes()
    write(tmp_path / "wide", docs[:2], np.int32)
    other = IndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.uint16)
    with pytest.raises(DataError, match="dtype"):
        other.add_index(tmp_path / "wide")


def test_hand_assembled_files_read_back_and_match_the_builder(tmp_path):
    sequences = [[5, 6, 7], [], [65535, 0], [1], [2, 3, 4, 5]]
    doc_ends = [2, 3, 3, 5]  # documents of 2, 1, 0 and 2 sequences
    idx, data = hand_written(tmp_path / "hand", sequences, doc_ends, np.uint16)
    ds = IndexedDataset(tmp_path / "hand")
    assert [s.tolist() for s in ds] == sequences
    assert ds.document_indices.tolist() == [0, *doc_ends] and ds.dtype == np.uint16

    builder = IndexedDatasetBuilder(tmp_path / "built.bin", dtype=np.uint16)
    builder.add_document([5, 6, 7], [3, 0])
    builder.add_item(np.array([65535, 0]))
    builder.end_document()
    builder.end_document()
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), [1, 4])
    builder.finalize(tmp_path / "built.idx")
    assert (tmp_path / "built.idx").read_bytes() == idx
    assert (tmp_path / "built.bin").read_bytes() == data

    idx, data = hand_written(tmp_path / "wide", [[70000, -1], [3]], [2], np.int32)
    assert [s.tolist() for s in IndexedDataset(tmp_path / "wide")] == [[70000, -1], [3]]


def test_empty_dataset_and_builder_edge_cases(tmp_path):
    write(tmp_path / "empty", [])
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.document_indices.tolist() == [0] and ds[0:5] == []
    assert (tmp_path / "empty.bin").stat().st_size == 0
    # finalize closes a last document left open, so the index stays valid
    builder = IndexedDatasetBuilder(tmp_path / "open.bin", dtype=np.int32)
    builder.add_item([1, 2])
    builder.finalize(tmp_path / "open.idx")
    assert IndexedDataset(tmp_path / "open").document_indices.tolist() == [0, 1]
    builder = IndexedDatasetBuilder(tmp_path / "small.bin", dtype=np.uint16)
    with pytest.raises(DataError, match="does not fit uint16"):
        builder.add_item([1, 70000])
    assert best_dtype(50257) == np.uint16 and best_dtype(65500) == np.int32 and best_dtype(None) == np.int32


def _patch(offset, data):
    def corrupt(prefix):
        raw = bytearray(prefix.with_suffix(".idx").read_bytes())
        raw[offset : offset + len(data)] = data
        prefix.with_suffix(".idx").write_bytes(bytes(raw))

    return corrupt


def _resize(suffix, size=None, extra=b""):
    def corrupt(prefix):
        path = prefix.with_suffix(suffix)
        path.write_bytes(path.read_bytes()[:size] + extra)

    return corrupt


DOCS = 34 + 5 * 12  # offset of document_indices in the index of the 5-sequence dataset below
CORRUPTIONS = {
    "bad magic": (_patch(0, b"XXXX"), "d.idx", "bad magic"),
    "not an index": (_resize(".idx", 0, b"hello"), "d.idx", "bad magic"),
    "version": (_patch(9, struct.pack("<Q", 2)), "d.idx", "version 2"),
    "dtype code": (_patch(17, b"\x09"), "d.idx", "dtype code 9"),
    "header only": (_resize(".idx", 20), "d.idx", "truncated"),
    "truncated idx": (_resize(".idx", -8), "d.idx", "truncated"),
    "docs start": (_patch(DOCS, struct.pack("<q", 1)), "d.idx", "not 0"),
    "docs order": (_patch(DOCS + 8, struct.pack("<q", 6)), "d.idx", "decreases"),
    "docs end": (_patch(DOCS + 16, struct.pack("<q", 4)), "d.idx", "ends at 4"),
    "bin short": (_resize(".bin", -2), "d.bin", "18 bytes"),
    "bin long": (_resize(".bin", None, b"\0"), "d.bin", "describes 20"),
    "no idx": (lambda prefix: prefix.with_suffix(".idx").unlink(), "d.idx", "rapidlite-preprocess"),
    "no bin": (lambda prefix: prefix.with_suffix(".bin").unlink(), "d.bin", "rapidlite-preprocess"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_or_missing_files_are_one_line_data_errors(tmp_path, case):
    # 5 sequences of 2 uint16 tokens = 20 bytes; document_indices [0, 2, 5]
    write(tmp_path / "d", [[[1, 2], [3, 4]], [[5, 6], [7, 8], [9, 10]]])
    corrupt, filename, expected = CORRUPTIONS[case]
    corrupt(tmp_path / "d.x")
    with pytest.raises(DataError) as err:
        IndexedDataset(tmp_path / "d")
    message = str(err.value)
    assert "\n" not in message and filename in message and expected in message, message


def test_a_pointer_outside_the_bin_file_errors_on_open(tmp_path):
    write(tmp_path / "d", [[[1, 2], [3, 4]], [[5, 6], [7, 8], [9, 10]]])
    _patch(34 + 5 * 4 + 8, struct.pack("<q", 1 << 40))(tmp_path / "d.x")  # pointer of sequence 1
    with pytest.raises(DataError, match="sequence pointers do not follow the sequence lengths"):
        IndexedDataset(tmp_path / "d")  # every pointer is checked against the lengths on open
