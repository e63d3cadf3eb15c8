"""Position limits of Hugging Face models: a learned absolute position table (GPT-2, OPT, BERT) ends at its
config's length, rotary models have none. Pretraining from a config grows the table to --seq-length; with
--load-pretrained-weights a longer --seq-length is one line before any step, not an index error mid-run."""

import pytest
import torch

from rapidlite.errors import ConfigError
from rapidlite.models.hf import position_limit
from rapidlite.resolve import parse_args
from rapidlite.tasks.pretraining import hf_causal_lm


def gpt2(positions: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=positions, n_embd=16, n_layer=1, n_head=2))


def pretraining_args(*argv: str):
    return parse_args(["--micro-batch-size", "1", "--train-iters", "1", *argv], require_task=False).sections


def test_decoder_position_tables():
    from transformers import LlamaConfig, OPTConfig

    assert position_limit(gpt2(64).config) == 64  # n_positions
    assert position_limit(OPTConfig(max_position_embeddings=40)) == 40
    assert position_limit(LlamaConfig(max_position_embeddings=32)) is None  # rotary: no table to run past


def test_pretraining_from_a_config_grows_the_position_table(tmp_path):
    gpt2(64).config.save_pretrained(tmp_path)
    args = pretraining_args("--pretrained-model-name-or-path", str(tmp_path), "--seq-length", "128")
    model = hf_causal_lm(args, vocab_size=50)
    assert position_limit(model.config) == 128
    model(input_ids=torch.zeros(1, 128, dtype=torch.long))  # ran past 64 before


def test_pretrained_weights_refuse_a_longer_sequence_in_one_line(tmp_path):
    gpt2(64).save_pretrained(tmp_path)
    weights = ["--pretrained-model-name-or-path", str(tmp_path), "--load-pretrained-weights"]
    with pytest.raises(ConfigError, match="--seq-length 128: .* learned position embeddings for 64 positions"):
        hf_causal_lm(pretraining_args(*weights, "--seq-length", "128"), vocab_size=50)
    assert position_limit(hf_causal_lm(pretraining_args(*weights, "--seq-length", "64"), vocab_size=50).config) == 64


def test_pretrained_weights_from_a_config_only_directory_is_one_line(tmp_path):
    gpt2(64).config.save_pretrained(tmp_path)
    weights = ["--pretrained-model-name-or-path", str(tmp_path), "--load-pretrained-weights"]
    args = pretraining_args(*weights, "--seq-length", "64")
    with pytest.raises(ConfigError, match="leave out --load-pretrained-weights to train from the config"):
        hf_causal_lm(args, vocab_size=50)
