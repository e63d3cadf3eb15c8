"""A tokenizer saved without a padding token (built with ``tokenizers`` by hand) still pads the encoder tasks'
batches: with the model's pad_token_id, else its end-of-sequence, separator or unknown token; none is one line."""

import json

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

from rapidlite.cli.main import main
from rapidlite.errors import ConfigError
from rapidlite.models.hf import ensure_pad_token

WORDS = ["<pad>", "<unk>", "<eos>", *"the movie was good bad john lives in paris".split()]


def tokenizer(**specials):
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=64, **specials)


def test_the_models_pad_id_then_eos_then_a_clear_refusal():
    tok = tokenizer(unk_token="<unk>")
    assert "the model's ('<pad>', id 0)" in ensure_pad_token(tok, BertConfig(pad_token_id=0), "m")
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    tok = tokenizer(unk_token="<unk>", eos_token="<eos>")
    assert "eos_token '<eos>'" in ensure_pad_token(tok, BertConfig(pad_token_id=None), "m")
    assert tok.pad_token_id == 2
    assert ensure_pad_token(tok, BertConfig(), "m") is None  # it has one now: left alone
    with pytest.raises(ConfigError, match="--pretrained-model-name-or-path m: the tokenizer has no padding token"):
        ensure_pad_token(tokenizer(), BertConfig(pad_token_id=None), "m")


@pytest.mark.parametrize("task", ["sequence_classification", "token_classification"])
def test_tasks_pad_with_the_models_pad_token(tmp_path, task):
    model_dir = tmp_path / "model"
    tokenizer(unk_token="<unk>").save_pretrained(model_dir)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    BertForMaskedLM(config).save_pretrained(model_dir)
    sentences = ["the movie was good", "john lives in paris and the movie was bad"] * 4
    rows = (
        [{"sentence": s, "label": i % 2} for i, s in enumerate(sentences)]
        if task == "sequence_classification"
        else [{"tokens": s.split(), "ner_tags": ["O"] * (len(s.split()) - 1) + ["B-X"]} for s in sentences]
    )
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = tmp_path / "run"
    argv = ["--task", task, "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data),
            "--split", "50,50", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-3", "--save", str(save)]  # fmt: skip
    assert main(argv) == 0  # batches of different lengths were padded
    assert AutoTokenizer.from_pretrained(save / "hf").pad_token == "<pad>"  # the export pads as the run did
