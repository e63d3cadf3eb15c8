"""The mmap files against Megatron-LM's own reader and writer (megatron-core), in both directions."""

import numpy as np
import pytest
import torch

from rapidlite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset", reason="megatron-core is not installed")

DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [[1], [2, 3], [4]]]  # documents of sentences


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_what_rapidlite_writes(tmp_path, dtype):
    prefix = str(tmp_path / "ours")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in DOCS:
        for sentence in doc:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    theirs = megatron.IndexedDataset(prefix)
    assert [theirs[i].tolist() for i in range(len(theirs))] == [s for d in DOCS for s in d]
    assert theirs.document_indices.tolist() == [0, 2, 3, 6]
    assert theirs.index.dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_rapidlite_reads_what_megatron_writes(tmp_path, dtype):
    prefix = str(tmp_path / "theirs")
    builder = megatron.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in DOCS:
        for sentence in doc:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    ours = IndexedDataset(prefix)
    assert [ours[i].tolist() for i in range(len(ours))] == [s for d in DOCS for s in d]
    assert ours.document_indices.tolist() == [0, 2, 3, 6]
    assert ours.dtype == np.dtype(dtype)
    ours_prefix = str(tmp_path / "ours")
    mine = IndexedDatasetBuilder(f"{ours_prefix}.bin", dtype=dtype)
    for doc in DOCS:
        for sentence in doc:
            mine.add_item(sentence)
        mine.end_document()
    mine.finalize(f"{ours_prefix}.idx")
    for suffix in (".bin", ".idx"):  # byte for byte the same files
        assert open(prefix + suffix, "rb").read() == open(ours_prefix + suffix, "rb").read()
