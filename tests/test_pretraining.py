"""``--task pretraining`` end to end: the embedded corpus, resume, Hugging Face causal models, errors."""

import json
import math

import pytest

from helpers import TINY, english_corpus, rapidlite_captured, read_metrics, write_tiny_corpus
from rapidlite.tasks import pretraining_demo

pytestmark = pytest.mark.slow


def train_records(save):
    return [r for r in read_metrics(save) if "split" not in r]


def test_embedded_corpus_pretraining_learns(tmp_path):
    """No --data-path: a 2-layer, 128-wide built-in GPT on the standard library's docstrings; 150 iterations
    take the validation loss below 0.6 ln(vocab) and well below the unigram entropy of the tokens."""
    save = tmp_path / "run"
    small = ["--num-layers", "2", "--hidden-size", "128", "--seq-length", "128", "--train-iters", "150"]
    proc = rapidlite_captured("--task", "pretraining", *small, "--eval-interval", "150", "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (validation,) = [r for r in read_metrics(save) if r.get("split") == "validation"]
    assert validation["loss"] < 0.6 * math.log(pretraining_demo.VOCAB_SIZE), validation
    stats = json.loads((pretraining_demo.demo_dir() / pretraining_demo.STATS).read_text())
    assert stats["tokens"] > 2_000_000  # a few MB of prose
    assert validation["loss"] < stats["unigram_entropy"] - 0.3, (validation, stats)
    assert "unigram" in proc.stderr
    assert (save / "latest").read_text().strip() == "150"
    assert train_records(save)[-1]["tokens_per_s"] > 0


def test_resume_continues_the_data_and_the_loss_curve(tmp_path):
    """A run stopped after its checkpoint at iteration 3 and resumed gives the uninterrupted run's losses:
    ``consumed_samples`` in the checkpoint places the data stream, the RNG states the dropout masks."""
    import shutil

    prefix = tmp_path / "tiny_text_document"
    write_tiny_corpus(prefix)
    data = ["--data-path", str(prefix), *TINY, "--train-iters", "6", "--save-interval", "3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert rapidlite_captured("--task", "pretraining", *data, "--save", str(full)).returncode == 0
    part.mkdir()
    shutil.copytree(full / "iter_0000003", part / "iter_0000003")
    (part / "latest").write_text("3")
    proc = rapidlite_captured("--task", "pretraining", *data, "--load", str(part), "--save", str(part), "--mmap-warmup")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    resumed = train_records(part)
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in train_records(full)[3:]]
    assert resumed[-1]["consumed_samples"] == 48


def test_hugging_face_causal_config(tmp_path):
    from transformers import GPT2Config

    prefix = tmp_path / "tiny_text_document"
    write_tiny_corpus(prefix)
    config_dir = tmp_path / "gpt2-tiny"
    GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=97, bos_token_id=96, eos_token_id=96
    ).save_pretrained(config_dir)
    save = tmp_path / "run"
    proc = rapidlite_captured(
        "--task", "pretraining", "--data-path", str(prefix), *TINY, "--train-iters", "40",
        "--pretrained-model-name-or-path", str(config_dir), "--save", str(save),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPT2LMHeadModel" in proc.stdout + proc.stderr
    losses = [r["loss"] for r in train_records(save)]
    assert losses[-1] < 0.8 * losses[0]  # counting sequences are easy to learn
    assert (save / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--data-path", "nowhere/data_text_document", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
         "nowhere/data_text_document"),
        (["--data-path", "x"], "--tokenizer-type"),
        (["--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
    ],
)  # fmt: skip
def test_bad_pretraining_input_is_one_line(argv, message):
    proc = rapidlite_captured("--task", "pretraining", "--train-iters", "2", *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_config_directory_without_a_tokenizer_is_one_line(tmp_path):
    """A model directory holding only config.json, as pretraining from a config has, names no tokenizer:
    transformers would build one of the special tokens alone and every data id would look foreign."""
    from transformers import Qwen2Config

    prefix = tmp_path / "tiny_text_document"
    write_tiny_corpus(prefix)
    config_dir = tmp_path / "qwen2-tiny"
    Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(config_dir)  # fmt: skip
    proc = rapidlite_captured(
        "--task", "pretraining", "--data-path", str(prefix), "--train-iters", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--pretrained-model-name-or-path", str(config_dir), "--save", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "holds no tokenizer files" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_heads_that_split_the_key_value_heads_unevenly_are_one_line(tmp_path):
    """--num-attention-heads reshapes a config trained from scratch (here the embedded run's 4 heads, as no
    --data-path is given); key/value heads that do not divide them would fail deep in attention."""
    from transformers import LlamaConfig

    config_dir = tmp_path / "llama"
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                num_key_value_heads=8).save_pretrained(config_dir)  # fmt: skip
    proc = rapidlite_captured("--task", "pretraining", "--pretrained-model-name-or-path", str(config_dir), "--dry-run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "rapidlite: error: --num-attention-heads 4: the model config's 8 key/value heads do not divide it; "
        "give a multiple of 8"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_pretraining_from_a_config(tmp_path, binary_head):
    """A BERT config selects masked LM + next-sentence prediction on sentence-split data (masked LM only
    with --no-binary-head); the loss falls and the model is exported."""
    from transformers import BertConfig

    from rapidlite.data.preprocess import preprocess
    from rapidlite.data.tokenizers import build_tokenizer, write_wordpiece_vocab

    docs = english_corpus(300, seed=0)
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    vocab = write_wordpiece_vocab(docs, 200, tmp_path / "vocab")
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    prefix = preprocess(source, tmp_path / "corpus", tokenizer, split_sentences=True, log=None)["text"]
    config_dir = tmp_path / "bert-tiny"
    BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    ).save_pretrained(config_dir)  # fmt: skip
    save = tmp_path / "run"
    proc = rapidlite_captured(
        "--task", "pretraining", "--pretrained-model-name-or-path", str(config_dir), "--data-path", prefix,
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab), "--seq-length", "48",
        "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "100", "--lr", "3e-3",
        "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "2", "--split", "90,10,0",
        "--save", str(save), *([] if binary_head else ["--no-binary-head"]),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("BertForPreTraining" if binary_head else "BertForMaskedLM") in proc.stdout + proc.stderr
    losses = [r["loss"] for r in train_records(save)]
    assert losses[-1] < losses[0] - 0.5, losses  # the template corpus leaves ~4 nats of real entropy
    assert (save / "hf" / "model.safetensors").is_file()
