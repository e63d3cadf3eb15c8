"""The BERT dataset over sentence-split mmap data: masking, segments, NSP, determinism, caching and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import english_corpus
from rapidlite.data.bert_dataset import (
    IGNORE_INDEX,
    BertDataset,
    build_bert_train_valid_test_datasets,
    build_samples_mapping,
    truncate_segments,
    truncation_counts,
)
from rapidlite.data.gpt_dataset import BlendedDataset
from rapidlite.data.indexed_dataset import IndexedDataset
from rapidlite.data.preprocess import preprocess
from rapidlite.data.tokenizers import build_tokenizer, write_wordpiece_vocab
from rapidlite.errors import ConfigError, DataError

SEQ = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Vocabulary, tokenizer and the corpus preprocessed with and without --split-sentences."""
    root = tmp_path_factory.mktemp("bert")
    docs = english_corpus(160, seed=0)
    source = root / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    vocab = write_wordpiece_vocab(docs, 200, root / "vocab")
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    sentences = preprocess(source, root / "corpus", tokenizer, split_sentences=True, log=None)["text"]
    documents = preprocess(source, root / "corpus", tokenizer, split_sentences=False, log=None)["text"]
    return {"root": root, "tokenizer": tokenizer, "sentences": sentences, "documents": documents}


def make(corpus: dict, num_samples: int = 500, seed: int = 1, binary_head: bool = True, **kw) -> BertDataset:
    indexed = IndexedDataset(corpus["sentences"])
    doc_range = kw.pop("document_range", (0, indexed.num_documents))
    return BertDataset(
        indexed,
        corpus["sentences"],
        kw.pop("name", "train"),
        doc_range,
        num_samples,
        kw.pop("seq_length", SEQ),
        seed,
        corpus["tokenizer"],
        binary_head=binary_head,
        **kw,
    )


def specials(tokenizer) -> set[int]:
    return {tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad, tokenizer.unk}


def segments(item: dict, tokenizer) -> tuple[list[int], list[int]]:
    """The original (unmasked) A and B segments of an item, rebuilt from its inputs and labels."""
    inputs, labels = item["input_ids"].numpy(), item["labels"].numpy()
    original = np.where(labels != IGNORE_INDEX, labels, inputs)
    seps = np.flatnonzero(original == tokenizer.sep)
    return original[1 : seps[0]].tolist(), original[seps[0] + 1 : seps[1]].tolist()


def segments_single(item: dict) -> list[int]:
    """The original text of a one-segment item (no binary head)."""
    labels, inputs = item["labels"].numpy(), item["input_ids"].numpy()
    original = np.where(labels != IGNORE_INDEX, labels, inputs)
    return original[1 : int(item["attention_mask"].sum()) - 1].tolist()


def find(haystack: list[int], needle: list[int]) -> int:
    """Start of ``needle`` in ``haystack`` (-1 when absent)."""
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


def test_items_have_the_bert_layout(corpus):
    tok, ds = corpus["tokenizer"], make(corpus, num_samples=200)
    assert len(ds) == 200
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
        assert all(t.dtype == torch.int64 for t in item.values())
        assert item["next_sentence_label"].shape == () and item["next_sentence_label"].item() in (0, 1)
        keys = ("input_ids", "token_type_ids", "attention_mask", "labels")
        ids, types, attn, labels = (item[k].numpy() for k in keys)
        assert len(ids) == len(types) == len(attn) == len(labels) == SEQ
        length = int(attn.sum())
        assert attn[:length].all() and not attn[length:].any()  # 1 for real tokens, then padding
        assert ids[0] == tok.cls and (ids[length:] == tok.pad).all()
        seps = np.flatnonzero(ids == tok.sep)
        assert len(seps) == 2 and seps[1] == length - 1 and 1 < seps[0] < length - 2  # A and B non-empty
        expected_types = np.r_[np.zeros(seps[0] + 1), np.ones(length - seps[0] - 1), np.zeros(SEQ - length)]
        assert np.array_equal(types, expected_types)
        special_positions = np.r_[0, seps, np.arange(length, SEQ)]
        assert (labels[special_positions] == IGNORE_INDEX).all()
        predicted = labels != IGNORE_INDEX
        assert predicted.any() and not np.isin(labels[predicted], list(specials(tok))).any()
        assert (labels[predicted] < tok.vocab_size).all()


def test_segments_come_from_the_samples_sentences_in_order_or_swapped(corpus):
    tok, ds = corpus["tokenizer"], make(corpus, num_samples=300)
    indexed = IndexedDataset(corpus["sentences"])
    for i in range(len(ds)):
        first, end, target = (int(v) for v in ds.samples_mapping[i])
        assert end - first >= 2 and 2 <= target <= SEQ - 3
        stream = np.concatenate([indexed[s] for s in range(first, end)]).tolist()
        item = ds[i]
        seg_a, seg_b = segments(item, tok)
        assert len(seg_a) + len(seg_b) <= target
        at_a, at_b = find(stream, seg_a), find(stream, seg_b)
        assert at_a >= 0 and at_b >= 0  # truncation only trims the ends of a segment
        if item["next_sentence_label"].item() == 0:
            assert at_a + len(seg_a) <= at_b  # B follows A
        else:
            assert at_b + len(seg_b) <= at_a  # Megatron's random next: the two segments swapped


def test_masking_statistics(corpus):
    tok, ds = corpus["tokenizer"], make(corpus, num_samples=600)
    text_tokens = predicted = masked = random = kept = 0
    for i in range(len(ds)):
        item = ds[i]
        ids, labels, attn = item["input_ids"].numpy(), item["labels"].numpy(), item["attention_mask"].numpy()
        text_tokens += int(attn.sum()) - 3  # minus [CLS] and two [SEP]
        chosen = labels != IGNORE_INDEX
        predicted += int(chosen.sum())
        masked += int((ids[chosen] == tok.mask).sum())
        kept += int((ids[chosen] == labels[chosen]).sum())
        replaced = chosen & (ids != tok.mask) & (ids != labels)
        random += int(replaced.sum())
        assert not np.isin(ids[replaced], list(specials(tok))).any()  # random ids are word pieces
    assert abs(predicted / text_tokens - 0.15) < 0.02
    assert abs(masked / predicted - 0.8) < 0.05
    assert abs(random / predicted - 0.1) < 0.05
    assert abs(kept / predicted - 0.1) < 0.05


def test_next_sentence_labels_are_balanced(corpus):
    ds = make(corpus, num_samples=800)
    fraction = float(np.mean([ds[i]["next_sentence_label"].item() for i in range(len(ds))]))
    assert abs(fraction - 0.5) < 0.05


def test_items_depend_on_seed_and_index_only(corpus):
    ds = make(corpus, num_samples=60)
    forward = [ds[i] for i in range(len(ds))]
    order = np.random.default_rng(3).permutation(len(ds))
    shuffled = {int(i): ds[int(i)] for i in order}
    again = make(corpus, num_samples=60)
    for i, item in enumerate(forward):
        for key, value in item.items():
            assert torch.equal(value, shuffled[i][key]) and torch.equal(value, again[i][key])
    other = make(corpus, num_samples=60, seed=2)
    assert not all(torch.equal(forward[i]["input_ids"], other[i]["input_ids"]) for i in range(len(ds)))


def test_samples_mapping_is_cached_and_reused(corpus):
    cache = Path(f"{corpus['sentences']}_cache")
    before = set(cache.glob("*.npy")) if cache.is_dir() else set()
    built = make(corpus, num_samples=123, seed=7)
    assert not built.cache_hit
    assert len(set(cache.glob("*.npy")) - before) == 1
    cached = make(corpus, num_samples=123, seed=7)
    assert cached.cache_hit and np.array_equal(cached.samples_mapping, built.samples_mapping)
    assert all(torch.equal(cached[i]["input_ids"], built[i]["input_ids"]) for i in range(len(built)))
    assert not make(corpus, num_samples=123, seed=7, short_seq_prob=0.2).cache_hit  # other parameters


def test_samples_mapping_covers_every_epoch_once():
    # Three documents: 4 sentences, 1 sentence (skipped with the binary head), 3 sentences.
    documents = np.array([0, 4, 5, 8])
    lengths = np.array([5, 5, 5, 5, 9, 4, 4, 4])
    mapping = build_samples_mapping(lengths, documents, (0, 3), 9, 10, 0.0, seed=0)
    assert mapping.shape == (9, 3)
    epoch = {tuple(row) for row in mapping[:3].tolist()}
    assert epoch == {(0, 2, 10), (2, 4, 10), (5, 8, 10)}  # a group never leaves a single sentence behind
    assert [{tuple(r) for r in mapping[k : k + 3].tolist()} for k in (3, 6)] == [epoch, epoch]
    single = build_samples_mapping(lengths, documents, (0, 3), 4, 10, 0.0, seed=0, min_sentences=1)
    assert (4, 5, 10) in {tuple(r) for r in single.tolist()}
    short = build_samples_mapping(lengths, documents, (0, 3), 500, 10, 1.0, seed=0)
    assert short[:, 2].min() >= 2 and short[:, 2].max() <= 10 and len(set(short[:, 2].tolist())) > 5


def test_truncation_removes_from_the_longer_segment():
    rng = np.random.default_rng(0)
    assert truncation_counts(10, 3, 9) == (4, 0)
    assert truncation_counts(6, 6, 8) == (2, 2)
    assert truncation_counts(3, 10, 20) == (0, 0)
    seg_a, seg_b = np.arange(20), np.arange(100, 104)
    a, b = truncate_segments(seg_a, seg_b, 12, rng)
    assert len(a) == 8 and b.tolist() == [100, 101, 102, 103]
    assert find(seg_a.tolist(), a.tolist()) >= 0  # a contiguous piece of A


def test_without_binary_head_one_segment_and_no_nsp_label(corpus):
    tok = corpus["tokenizer"]
    ds = make(corpus, num_samples=100, binary_head=False)
    indexed = IndexedDataset(corpus["sentences"])
    singles = [i for i in range(len(ds)) if ds.samples_mapping[i][1] - ds.samples_mapping[i][0] == 1]
    assert singles  # one-sentence documents are used without NSP
    for i in range(len(ds)):
        item = ds[i]
        assert "next_sentence_label" not in item  # BertForMaskedLM takes no NSP label
        ids, types, attn = item["input_ids"].numpy(), item["token_type_ids"].numpy(), item["attention_mask"].numpy()
        length = int(attn.sum())
        assert ids[0] == tok.cls and np.flatnonzero(ids == tok.sep).tolist() == [length - 1]
        assert not types.any() and length <= SEQ
        first, end, _ = (int(v) for v in ds.samples_mapping[i])
        stream = np.concatenate([indexed[s] for s in range(first, end)]).tolist()
        assert find(stream, segments_single(item)) >= 0
    # Data without sentence splitting works for masked LM only.
    docs = IndexedDataset(corpus["documents"])
    plain = BertDataset(docs, corpus["documents"], "train", (0, docs.num_documents), 20, SEQ, 1, tok, binary_head=False)
    assert len(plain) == 20 and "next_sentence_label" not in plain[0]


def test_errors_are_one_line(corpus):
    tok = corpus["tokenizer"]
    docs = IndexedDataset(corpus["documents"])
    with pytest.raises(DataError, match="--split-sentences or pass --no-binary-head") as error:
        BertDataset(docs, corpus["documents"], "train", (0, docs.num_documents), 20, SEQ, 1, tok)
    assert "\n" not in str(error.value) and corpus["documents"] in str(error.value)
    with pytest.raises(DataError, match="--split-sentences"):
        build_bert_train_valid_test_datasets([corpus["documents"]], "1", [10, 0, 0], SEQ, 1, tok)
    with pytest.raises(ConfigError, match="--seq-length 7"):
        make(corpus, seq_length=7)
    with pytest.raises(ConfigError, match="--mask-prob"):
        make(corpus, mask_prob=1.5)
    gpt_like = build_tokenizer("NullTokenizer", vocab_size=100)
    with pytest.raises(ConfigError, match="BertWordPieceLowerCase"):
        build_bert_train_valid_test_datasets([corpus["sentences"]], "1", [10, 0, 0], SEQ, 1, gpt_like)


def test_splits_divide_documents_and_blend(corpus):
    tok, prefix = corpus["tokenizer"], corpus["sentences"]
    indexed = IndexedDataset(prefix)
    train, valid, test = build_bert_train_valid_test_datasets([prefix], "80,20,0", [50, 20, 0], SEQ, 1, tok)
    assert test is None and len(train) == 50 and len(valid) == 20
    boundary = int(indexed.document_indices[round(0.8 * indexed.num_documents)])  # first valid sentence
    assert (np.asarray(train.samples_mapping)[:, 1] <= boundary).all()
    assert (np.asarray(valid.samples_mapping)[:, 0] >= boundary).all()
    blended, _, _ = build_bert_train_valid_test_datasets(["0.7", prefix, "0.3", prefix], "1", [40, 0, 0], SEQ, 1, tok)
    assert isinstance(blended, BlendedDataset) and len(blended) == 40
    assert blended[39]["input_ids"].shape == (SEQ,)


def test_a_batch_goes_straight_into_bert_for_pretraining(corpus):
    from transformers import BertConfig, BertForPreTraining

    tok, ds = corpus["tokenizer"], make(corpus, num_samples=8)
    batch = torch.utils.data.default_collate([ds[i] for i in range(4)])
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    loss = BertForPreTraining(config)(**batch).loss
    assert torch.isfinite(loss) and loss.item() > 0
