"""A model's position table bounds --seq-length for every encoder task, also when its tokenizer does not know the
limit (a tokenizer saved with the default 512 beside a smaller model): the default is lowered to it, a larger
--seq-length is one line, and nothing runs past the table."""

import json

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, DebertaV2Config, ModernBertConfig, RobertaConfig, T5Config

from rapidlite.cli.main import main
from rapidlite.errors import ConfigError
from rapidlite.models.hf import position_limit, sequence_length
from rapidlite.tasks.demo_build import build_wordpiece_tokenizer

WORDS = "the movie was good bad john lives in paris where does ?".split()
POSITIONS = 16


def test_position_limit_of_each_kind_of_position_embedding():
    assert position_limit(BertConfig(max_position_embeddings=32)) == 32
    assert position_limit(RobertaConfig(max_position_embeddings=130, pad_token_id=1)) == 128  # 514 rows hold 512
    assert position_limit(ModernBertConfig()) is None  # rotary
    assert position_limit(DebertaV2Config(position_biased_input=False, relative_attention=True)) is None
    assert position_limit(DebertaV2Config(position_biased_input=True)) == 512
    assert position_limit(T5Config()) is None  # relative buckets, no max_position_embeddings


def test_sequence_length_takes_the_smaller_of_tokenizer_and_position_table():
    tokenizer = type("Tok", (), {"model_max_length": 512})()
    config = BertConfig(max_position_embeddings=32)
    assert sequence_length(None, tokenizer, 128, config) == 32
    assert sequence_length(128, tokenizer, 128, config, explicit=False) == 32  # a task's default is lowered
    assert sequence_length(24, tokenizer, 128, config) == 24
    with pytest.raises(ConfigError, match=r"--seq-length 64: the model takes at most 32 tokens \(its position table"):
        sequence_length(64, tokenizer, 128, config)
    assert sequence_length(None, tokenizer, 128) == 128  # without a config: the tokenizer's limit, as before


@pytest.fixture(scope="module")
def small_table_model(tmp_path_factory):
    """A BERT with 16 positions whose tokenizer claims 512, and data far longer than 16 tokens."""
    root = tmp_path_factory.mktemp("positions")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    model_dir = root / "model"
    build_wordpiece_tokenizer(root / "vocab.txt", model_max_length=512).save_pretrained(model_dir)
    config = BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=POSITIONS,
    )
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(model_dir)
    long = " ".join(["the movie was good"] * 10)
    rows = {
        "sequence_classification": [{"sentence": long, "label": i % 2} for i in range(8)],
        "token_classification": [{"tokens": long.split(), "ner_tags": ["O"] * 39 + ["B-X"]} for _ in range(8)],
        "question_answering": [
            {
                "id": str(i),
                "question": "where does john live ?",
                "context": long + " john lives in paris",
                "answers": {"text": ["paris"], "answer_start": [len(long) + 15]},
            }
            for i in range(8)
        ],
    }
    files = {}
    for task, task_rows in rows.items():
        files[task] = root / f"{task}.jsonl"
        files[task].write_text("".join(json.dumps(r) + "\n" for r in task_rows))
    return model_dir, files


@pytest.mark.parametrize("task", ["sequence_classification", "token_classification", "question_answering"])
def test_tasks_stay_inside_a_small_position_table(small_table_model, tmp_path, capsys, task):
    model_dir, files = small_table_model
    argv = ["--task", task, "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(files[task]),
            "--split", "50,50", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-3", *(["--doc-stride", "4"] if task == "question_answering" else [])]  # fmt: skip
    assert (
        main([*argv, "--save", str(tmp_path / "run")]) == 0
    )  # the default --seq-length (128, 384) lowered to the model's 16 positions
    capsys.readouterr()
    assert main([*argv, "--save", str(tmp_path / "too-long"), "--seq-length", "64"]) == 2
    err = capsys.readouterr().err
    assert "--seq-length 64: the model takes at most 16 tokens" in err and err.count("\n") == 1, err
    assert not (tmp_path / "too-long").exists() or not any((tmp_path / "too-long").iterdir())


def test_causal_lm_length_follows_a_learned_position_table():
    """causal_lm: the default 512 is lowered to GPT-2's 64 positions, a --seq-length past them is one line;
    a rotary model takes any length (its tokenizer's model_max_length does not bound it)."""
    from transformers import GPT2Config, LlamaConfig

    from rapidlite.tasks.causal_lm import causal_seq_length

    gpt2 = GPT2Config(n_positions=64)
    assert causal_seq_length(512, gpt2, explicit=False) == 64
    assert causal_seq_length(48, gpt2) == 48
    with pytest.raises(ConfigError, match="--seq-length 128: the model's learned positions end at 64 tokens"):
        causal_seq_length(128, gpt2)
    assert causal_seq_length(4096, LlamaConfig(max_position_embeddings=64)) == 4096
    assert causal_seq_length(None, None, explicit=False) == 512
