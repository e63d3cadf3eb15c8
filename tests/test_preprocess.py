"""rapidlite-preprocess and the Megatron tokenizers: determinism across workers, EOD, sentences, errors."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO
from rapidlite.cli.preprocess import main
from rapidlite.data.documents import SentenceSplitter
from rapidlite.data.indexed_dataset import IndexedDataset
from rapidlite.data.preprocess import preprocess
from rapidlite.data.tokenizers import build_tokenizer, train_byte_level_bpe, write_wordpiece_vocab
from rapidlite.errors import ConfigError, DataError

WORDS = "the river light stone house music garden winter north early quiet bright paper window".split()
WORDS += ["naïve", "café", "über", "日本", "2024", "x-ray", "it's"]


def make_documents(num_docs=60, seed=0):
    """Documents of 1..5 sentences (some with newlines and non-ASCII text), one of them empty."""
    rng = random.Random(seed)

    def sentence():
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice([".", "!", "?"])

    docs = [rng.choice([" ", "\n"]).join(sentence() for _ in range(rng.randint(1, 5))) for _ in range(num_docs)]
    docs[7] = ""
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = make_documents()
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"text": doc, "title": f"Doc {i}", "id": i}, ensure_ascii=False) + "\n")
    vocab, merges = train_byte_level_bpe(docs, 400, root)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    return {"root": root, "docs": docs, "jsonl": str(root / "docs.jsonl"), "tokenizer": tokenizer}


def read_bytes(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


def test_gpt2_bpe_tokenizer_round_trips_text(corpus):
    tokenizer = corpus["tokenizer"]
    text = "The café by the river, naïve & über-quiet.\n\n  日本 2024!"
    ids = tokenizer.tokenize(text)
    assert ids and all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.detokenize(ids) == text
    assert all(tokenizer.detokenize(tokenizer.tokenize(doc)) == doc for doc in corpus["docs"])
    vocab = json.loads((corpus["root"] / "vocab.json").read_text(encoding="utf-8"))
    assert tokenizer.eod == vocab["<|endoftext|>"] and tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod not in tokenizer.tokenize("a <|endoftext|> b")  # not special inside text, as in Megatron


def test_output_is_identical_for_any_workers_and_partitions(corpus, tmp_path):
    outputs = []
    for name, workers, partitions in (("w1", 1, 1), ("w2", 2, 1), ("p2", 2, 2), ("p3", 1, 3)):
        prefixes = preprocess(
            corpus["jsonl"], tmp_path / name, corpus["tokenizer"], append_eod=True, workers=workers,
            partitions=partitions, log=None,
        )  # fmt: skip
        assert prefixes == {"text": f"{tmp_path / name}_text_document"}
        outputs.append(read_bytes(prefixes["text"]))
    assert all(output == outputs[0] for output in outputs[1:])
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{n}_text_document.{s}" for n in ("w1", "w2", "p2", "p3") for s in "bin idx".split()
    )


def test_documents_hold_their_tokens_and_end_with_eod(corpus, tmp_path):
    tokenizer, docs = corpus["tokenizer"], corpus["docs"]
    nonempty = [doc for doc in docs if doc]
    ds = IndexedDataset(preprocess(corpus["jsonl"], tmp_path / "eod", tokenizer, append_eod=True, log=None)["text"])
    assert len(ds) == len(nonempty) == len(docs) - 1  # the empty document is skipped
    assert ds.document_indices.tolist() == list(range(len(nonempty) + 1)) and ds.dtype == np.uint16
    for tokens, doc in zip(ds, nonempty, strict=True):
        assert tokens.tolist() == tokenizer.tokenize(doc) + [tokenizer.eod]
    plain = IndexedDataset(preprocess(corpus["jsonl"], tmp_path / "plain", tokenizer, log=None)["text"])
    assert plain.sequence_lengths.tolist() == [len(tokenizer.tokenize(doc)) for doc in nonempty]
    assert tokenizer.eod not in np.concatenate(list(plain))


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_sentence_mode_groups_sentences_into_documents(corpus, tmp_path, keep_newlines):
    tokenizer, docs = corpus["tokenizer"], [doc for doc in corpus["docs"] if doc]
    prefixes = preprocess(
        corpus["jsonl"], tmp_path / "s", tokenizer, split_sentences=True, keep_newlines=keep_newlines,
        append_eod=True, workers=2, log=None,
    )  # fmt: skip
    ds = IndexedDataset(prefixes["text"])
    assert prefixes["text"].endswith("s_text_sentence")
    assert len(ds.document_indices) == len(docs) + 1 and len(ds) > len(docs)
    splitter = SentenceSplitter(keep_newlines=keep_newlines)
    bounds = ds.document_indices
    for d, doc in enumerate(docs):
        sentences = splitter.split(doc)
        got = [ds[i].tolist() for i in range(bounds[d], bounds[d + 1])]
        want = [tokenizer.tokenize(s) for s in sentences]
        assert got == want[:-1] + [want[-1] + [tokenizer.eod]]
        if keep_newlines:  # sentences keep the whitespace between them: they concatenate back to the document
            assert "".join(sentences) == doc
        assert got[-1][-1] == tokenizer.eod


def test_regex_sentence_splitter():
    splitter = SentenceSplitter()
    if splitter.kind.startswith("nltk"):
        pytest.skip("nltk punkt is installed; the regex rule is the fallback")
    text = 'Mr. Smith met Dr. J. Doe at 5 p.m. today. "Really?" she asked. Yes!  It was 3.5 km.\nThe end'
    assert splitter.split(text) == [
        "Mr. Smith met Dr. J. Doe at 5 p.m. today.",
        '"Really?" she asked.',
        "Yes!",
        "It was 3.5 km.",
        "The end",
    ]
    kept = SentenceSplitter(keep_newlines=True).split(text)
    assert "".join(kept) == text and kept[-2] == "It was 3.5 km.\n"


def test_text_inputs_and_several_json_keys(corpus, tmp_path):
    tokenizer = corpus["tokenizer"]
    (tmp_path / "para.txt").write_text("First doc line one.\nline two.\n\n\nSecond doc.\n", encoding="utf-8")
    ds = IndexedDataset(preprocess(tmp_path / "para.txt", tmp_path / "para", tokenizer, log=None)["text"])
    assert [tokenizer.detokenize(s) for s in ds] == ["First doc line one.\nline two.", "Second doc."]
    (tmp_path / "lines.txt").write_text("one doc\n\nanother doc\n", encoding="utf-8")
    prefixes = preprocess(tmp_path / "lines.txt", tmp_path / "lines", tokenizer, text_format="lines", log=None)
    assert [tokenizer.detokenize(s) for s in IndexedDataset(prefixes["text"])] == ["one doc", "another doc"]
    prefixes = preprocess(corpus["jsonl"], tmp_path / "multi", tokenizer, json_keys=("text", "title"), log=None)
    assert set(prefixes) == {"text", "title"}
    titles = IndexedDataset(prefixes["title"])
    assert [tokenizer.detokenize(s) for s in titles] == [f"Doc {i}" for i in range(len(corpus["docs"]))]


def test_bert_wordpiece_tokenizers(corpus, tmp_path):
    vocab_file = write_wordpiece_vocab(corpus["docs"], 300, tmp_path)
    vocab = [line.rstrip("\n") for line in open(vocab_file, encoding="utf-8")]
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file)
    assert (lower.cls, lower.sep, lower.mask, lower.pad) == tuple(
        vocab.index(t) for t in "[CLS] [SEP] [MASK] [PAD]".split()
    )
    assert lower.eod == lower.sep and lower.vocab_size == len(vocab)
    ids = lower.tokenize("The RIVER house quiet.")
    assert ids and lower.cls not in ids and lower.sep not in ids
    assert lower.detokenize(ids) == "the river house quiet."
    cased = build_tokenizer("BertWordPieceCase", vocab_file=vocab_file)
    assert cased.tokenize("RIVER") != ids[1:2]
    ds = IndexedDataset(preprocess(corpus["jsonl"], tmp_path / "bert", lower, append_eod=True, log=None)["text"])
    assert all(seq[-1] == lower.sep for seq in ds)


def test_huggingface_tokenizer_from_a_local_directory(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    backend = corpus["tokenizer"]._backend
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "hf")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    text = corpus["docs"][0]
    assert tokenizer.tokenize(text) == corpus["tokenizer"].tokenize(text) and tokenizer.tokenize(text)
    assert tokenizer.eod == corpus["tokenizer"].eod and tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_null_tokenizer_follows_megatron(tmp_path):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.tokenize("3 14\n15 ") == [3, 14, 15] and tokenizer.detokenize([3, 14]) == "3 14"
    (tmp_path / "ids.txt").write_text("1 2 3\n\n4 5\n", encoding="utf-8")
    prefixes = preprocess(tmp_path / "ids.txt", tmp_path / "ids", tokenizer, append_eod=True, log=None)
    assert [s.tolist() for s in IndexedDataset(prefixes["text"])] == [[1, 2, 3, 100], [4, 5, 100]]
    (tmp_path / "bad.txt").write_text("1 2\n\n3 x\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.txt:3: NullTokenizer: 'x' is not an integer"):
        preprocess(tmp_path / "bad.txt", tmp_path / "bad", tokenizer, log=None)
    assert not (tmp_path / "bad_text_document.bin").exists()  # no half-written output is left behind


def test_tokenizer_flag_errors(corpus):
    cases = [
        (("Word2Vec",), "NullTokenizer"),
        (("GPT2BPETokenizer",), "needs --vocab-file"),
        (("GPT2BPETokenizer", "/no/vocab.json", "/no/merges.txt"), "--vocab-file /no/vocab.json: no such file"),
        (("BertWordPieceCase",), "needs --vocab-file"),
        (("HuggingFaceTokenizer",), "needs --tokenizer-model"),
        (("NullTokenizer",), "needs --vocab-size"),
        (("SentencePieceTokenizer",), "needs --tokenizer-model"),
    ]
    for args, expected in cases:
        with pytest.raises(ConfigError, match=expected.replace(".", r"\.")) as err:
            build_tokenizer(*args)
        assert "\n" not in str(err.value)
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install sentencepiece"):
            build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["jsonl"])


def test_bad_json_lines_name_the_file_and_line(corpus, tmp_path):
    tokenizer = corpus["tokenizer"]
    cases = {
        "broken.jsonl": ('{"text": "ok"}\n{"text": "cut\n', "broken.jsonl:2: not valid JSON"),
        "nokey.jsonl": ('{"text": "ok"}\n\n{"body": "x"}\n', "nokey.jsonl:3: no key 'text' (keys: body)"),
        "notstr.jsonl": ('{"text": 5}\n', "notstr.jsonl:1: 'text' is a JSON int"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
        for workers in (1, 2):
            with pytest.raises(DataError) as err:
                preprocess(tmp_path / name, tmp_path / "out", tokenizer, workers=workers, log=None)
            assert expected in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DataError, match="--input .*missing.jsonl: no such file"):
        preprocess(tmp_path / "missing.jsonl", tmp_path / "out", tokenizer, log=None)
    assert main(["--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                 "NullTokenizer", "--vocab-size", "5", "--dataset-impl", "lazy"]) == 2  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_without_text_is_one_line_and_writes_nothing(corpus, tmp_path, workers):
    """An empty (or blank) file, and one whose documents are all empty, wrote an empty .bin/.idx and exited 0."""
    tokenizer = corpus["tokenizer"]
    cases = {
        "empty.jsonl": ("", "empty.jsonl: the file is empty; nothing to preprocess (nothing written)"),
        "blank.txt": ("\n  \n\n", "blank.txt: the file is empty; nothing to preprocess (nothing written)"),
        "no_text.jsonl": ('{"text": ""}\n{"text": ""}\n', "no_text.jsonl: none of its 2 documents has text"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(DataError, match=re.escape(expected)):
            preprocess(tmp_path / name, tmp_path / "out", tokenizer, workers=workers, partitions=workers, log=None)
        assert not list(tmp_path.glob("out*")), name


def run_preprocess(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rapidlite.cli.preprocess", *argv],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=120,
    )  # fmt: skip


def test_cli(corpus, tmp_path):
    root = corpus["root"]
    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer"]
    tokenizer_flags += ["--vocab-file", str(root / "vocab.json"), "--merge-file", str(root / "merges.txt")]
    result = run_preprocess(
        "--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "cli"), *tokenizer_flags, "--append-eod",
        "--workers", "2", "--log-interval", "20", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Processed 20 documents" in result.stderr and "docs/s" in result.stderr and "MB/s" in result.stderr
    python = preprocess(corpus["jsonl"], tmp_path / "py", corpus["tokenizer"], append_eod=True, log=None)
    assert read_bytes(tmp_path / "cli_text_document") == read_bytes(python["text"])

    result = run_preprocess(
        "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "x"), *tokenizer_flags,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rapidlite-preprocess: error: --input {tmp_path / 'nope.jsonl'}: no such file"
    ]


def test_an_output_prefix_under_a_file_is_one_line(corpus, tmp_path):
    """A prefix whose directory is an existing file: one line naming it (it was makedirs' FileExistsError
    traceback), the file untouched and nothing written beside it."""
    a_file = tmp_path / "notes"
    a_file.write_text("mine")
    result = run_preprocess(
        "--input", corpus["jsonl"], "--output-prefix", str(a_file / "corpus"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "300", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"rapidlite-preprocess: error: --output-prefix {a_file / 'corpus'}: {a_file} is a file, not a directory; "
        "pass a directory for the .bin/.idx files"
    ]
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
