"""The GPT dataset over mmap data: packing, determinism, index caches, splits and blending."""

import numpy as np
import pytest
import torch

from rapidlite.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    gpt_batch,
    parse_data_path,
    parse_split,
    split_ranges,
)
from rapidlite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from rapidlite.errors import ConfigError

EOD = 0


def write_corpus(prefix, num_docs=40, seed=0, offset=1):
    """Documents of 5..60 tokens (ids >= 1), each ending with EOD; returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(offset, offset + 500, rng.integers(5, 60)), EOD) for _ in range(num_docs)]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return docs


def dataset(prefix, num_samples=50, seq=16, seed=1, shuffle=True, doc_range=None):
    indexed = IndexedDataset(str(prefix))
    return GPTDataset(indexed, str(prefix), "train", doc_range or (0, len(indexed)), num_samples, seq, seed, shuffle)


def test_unshuffled_samples_reproduce_the_document_stream(tmp_path):
    docs = write_corpus(tmp_path / "c")
    ds = dataset(tmp_path / "c", num_samples=200, shuffle=False)  # more than one epoch of tokens
    samples = [ds[i]["text"].numpy() for i in range(len(ds))]
    assert len(ds) == 200 and all(len(s) == 17 for s in samples)
    stream = np.concatenate(docs * 10)
    joined = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])  # consecutive samples share a token
    assert np.array_equal(joined, stream[: len(joined)])


def test_order_depends_on_the_seed_only(tmp_path):
    write_corpus(tmp_path / "c")
    first = [dataset(tmp_path / "c", seed=1)[i]["text"] for i in range(20)]
    again = [dataset(tmp_path / "c", seed=1)[i]["text"] for i in range(20)]
    other = [dataset(tmp_path / "c", seed=2)[i]["text"] for i in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_index_cache_is_written_and_reused(tmp_path):
    write_corpus(tmp_path / "c")
    built = dataset(tmp_path / "c")
    assert not built.cache_hit
    assert len(list((tmp_path / "c_cache").glob("*.npy"))) == 3
    cached = dataset(tmp_path / "c")
    assert cached.cache_hit
    assert all(torch.equal(cached[i]["text"], built[i]["text"]) for i in range(len(built)))
    assert not dataset(tmp_path / "c", num_samples=51).cache_hit  # other parameters, another index


def test_splits_divide_documents():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(100, "80,10,10") == [(0, 80), (80, 90), (90, 100)]
    assert split_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ConfigError, match="--split"):
        parse_split("a,b")


def test_train_valid_test_use_disjoint_documents(tmp_path):
    docs = write_corpus(tmp_path / "c", num_docs=50)
    train, valid, test = build_train_valid_test_datasets([str(tmp_path / "c")], "80,20,0", [30, 10, 0], 16, 1)
    assert test is None and len(train) == 30 and len(valid) == 10
    valid_tokens = {int(t) for i in range(len(valid)) for t in valid[i]["text"]} - {EOD}
    assert valid_tokens <= {int(t) for d in docs[40:] for t in d}


def test_blend_follows_the_weights(tmp_path):
    write_corpus(tmp_path / "a", seed=1, offset=1)
    write_corpus(tmp_path / "b", seed=2, offset=1000)  # b's tokens are >= 1000
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_data_path(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    train, _, _ = build_train_valid_test_datasets(
        ["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], "1", [2000, 0, 0], 8, 1
    )
    assert len(train) == 2000
    from_b = sum(int(train[i]["text"].max() >= 1000) for i in range(len(train)))
    assert abs(from_b / 2000 - 0.3) < 0.01


def test_batch_masks_follow_eod():
    text = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 3, 4]])
    batch = gpt_batch(text, EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert batch["input_ids"].tolist() == [[5, 6, EOD, 7, 8, 9, EOD, 3]]
    assert batch["labels"].tolist() == [[6, EOD, 7, 8, 9, EOD, 3, 4]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    mask = batch["attention_mask"][0, 0]
    assert mask[3, 2].item() is False and mask[3, 3].item() is True and mask[2, 0].item() is True
    assert mask[7, 6].item() is False and not mask[0, 1].item()
    plain = gpt_batch(text, EOD)
    assert plain["attention_mask"] is None and plain["position_ids"].tolist() == [list(range(8))]


def test_blending_keeps_every_prefix_within_one_sample_of_its_share():
    from rapidlite.data.gpt_dataset import build_blending_index

    weights = [0.6, 0.3, 0.1]
    datasets, numbers = build_blending_index(weights, 20000)
    for j, w in enumerate(weights):
        served = np.cumsum(datasets == j)
        assert np.abs(served - w * np.arange(1, 20001)).max() <= 1.0
        assert np.array_equal(numbers[datasets == j], np.arange(served[-1]))  # each dataset's samples in order
