"""The built-in GPT in Hugging Face's layouts: GPT-2's for the default blocks, LLaMA's for RMSNorm + SwiGLU +
rope; ``transformers`` loads the saved model and its logits equal the built-in model's."""

from __future__ import annotations

import pytest
import torch

from rapidlite.errors import ConfigError
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.models.gpt_hf import hf_layout, hf_model

LLAMA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "bias": False}


def _model(**kw) -> GPTModel:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=100, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
        hidden_dropout=0.0, attention_dropout=0.0, **kw,
    )  # fmt: skip
    return GPTModel(config).eval()


@pytest.mark.parametrize(
    ("kw", "layout", "cls"),
    [
        ({}, "gpt2", "GPT2LMHeadModel"),
        ({"untie_embeddings_and_output_weights": True}, "gpt2", "GPT2LMHeadModel"),
        ({**LLAMA, "rotary_base": 500.0}, "llama", "LlamaForCausalLM"),
        ({**LLAMA, "untie_embeddings_and_output_weights": True}, "llama", "LlamaForCausalLM"),
        ({**LLAMA, "bias": True}, "llama", "LlamaForCausalLM"),  # what the flags build: biases on
    ],
)
def test_transformers_loads_the_built_in_gpt_with_equal_logits(tmp_path, kw, layout, cls):
    from transformers import AutoModelForCausalLM

    model = _model(**kw)
    assert hf_layout(model.config) == layout
    hf_model(model, {"eos_token_id": 3}).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == cls and loaded.config.eos_token_id == 3
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_a_mixed_layout_is_refused_in_one_line():
    model = _model(normalization="RMSNorm")  # RMSNorm with a GELU MLP and learned positions
    assert hf_layout(model.config) is None
    with pytest.raises(ConfigError, match="has no Hugging Face layout"):
        hf_model(model)


def test_megatron_tokenizers_export_as_transformers_tokenizers(tmp_path):
    """What pretraining tokenized with, AutoTokenizer loads from the export: same ids, same special tokens."""
    from transformers import AutoTokenizer

    from rapidlite.data.tokenizers import (
        BertWordPieceTokenizer,
        GPT2BPETokenizer,
        train_byte_level_bpe,
        write_wordpiece_vocab,
    )

    texts = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 20
    text = "the lazy fox packs five jugs"
    gpt2 = GPT2BPETokenizer(*train_byte_level_bpe(texts, 300, tmp_path / "bpe"))
    bert = BertWordPieceTokenizer(write_wordpiece_vocab(texts, 120, tmp_path / "wp"))
    for name, tok in (("gpt2", gpt2), ("bert", bert)):
        tok.hf_tokenizer().save_pretrained(tmp_path / name)
        loaded = AutoTokenizer.from_pretrained(tmp_path / name)
        assert loaded.encode(text, add_special_tokens=False) == tok.tokenize(text), name
    assert AutoTokenizer.from_pretrained(tmp_path / "gpt2").eos_token_id == gpt2.eod
    assert AutoTokenizer.from_pretrained(tmp_path / "bert").mask_token_id == bert.mask


@pytest.mark.parametrize("kw", [{}, LLAMA], ids=["gpt2", "llama"])
def test_the_export_of_a_built_in_gpt_is_a_transformers_model(tmp_path, kw):
    """What pretraining writes to DIR/hf: transformers loads it (and its tokenizer), GPTModel.from_pretrained too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rapidlite.checkpoint.export import export_hf
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    tok = GPT2BPETokenizer(*train_byte_level_bpe(["the quick brown fox"] * 20, 280, tmp_path / "bpe"))
    model = _model(**kw)
    export_hf(model, tmp_path / "hf", tok.hf_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("the fox") == tok.tokenize("the fox")
    again = GPTModel.from_pretrained(tmp_path / "hf").eval()
    assert again.config == model.config
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_a_built_in_gpt_without_a_transformers_layout_is_exported_in_its_own_format_with_a_line(tmp_path, log_lines):
    from rapidlite.checkpoint.export import export_hf

    model = _model(normalization="RMSNorm")
    export_hf(model, tmp_path / "hf")
    assert any("has no Hugging Face layout" in line and "rapidlite's own format" in line for line in log_lines)
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(GPTModel.from_pretrained(tmp_path / "hf")(ids), model(ids), rtol=0, atol=0)
