"""Hugging Face models are built with SDPA attention where their class has it, through the tasks' own code."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, GPT2Config, LlamaConfig, OpenAIGPTConfig

from rapidlite.config.settings import Sections
from rapidlite.errors import ConfigError
from rapidlite.models.hf import load_hf_model
from rapidlite.tasks.pretraining import hf_bert_pretraining, hf_causal_lm
from rapidlite.tasks.sequence_classification import load_classifier

VOCAB = 64
TINY = {
    "gpt2": GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB),
    "llama": LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    ),
    "bert": BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    ),
    # No SDPA path in any supported transformers release: the fallback case.
    "openai-gpt": OpenAIGPTConfig(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=VOCAB),
}


def task_args(directory, **overrides):
    """The flags ``hf_causal_lm`` / ``hf_bert_pretraining`` read, as ``--task pretraining`` sets them."""
    values = {
        "pretrained_model_name_or_path": str(directory),
        "load_pretrained_weights": False,
        "num_layers": None,
        "hidden_size": None,
        "num_attention_heads": None,
        "ffn_hidden_size": None,
        "binary_head": True,
        "seq_length": 16,
    }
    return Sections.of({**values, **overrides})


def saved_config(tmp_path, name):
    directory = tmp_path / name
    TINY[name].save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_lm_from_a_config_uses_sdpa(tmp_path, name):
    model = hf_causal_lm(task_args(saved_config(tmp_path, name)), VOCAB)
    assert model.config._attn_implementation == "sdpa"
    logits = model(input_ids=torch.randint(0, VOCAB, (2, 8))).logits
    assert logits.shape == (2, 8, model.config.vocab_size)


def test_causal_lm_with_pretrained_weights_uses_sdpa(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "weights"
    AutoModelForCausalLM.from_config(TINY["gpt2"]).save_pretrained(directory)
    model = hf_causal_lm(task_args(directory, load_pretrained_weights=True), VOCAB)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_pretraining_uses_sdpa(tmp_path, binary_head):
    model = hf_bert_pretraining(task_args(saved_config(tmp_path, "bert"), binary_head=binary_head), VOCAB)
    assert type(model).__name__ == ("BertForPreTraining" if binary_head else "BertForMaskedLM")
    assert model.config._attn_implementation == "sdpa"


def test_sequence_classifier_uses_sdpa(tmp_path):
    from transformers import BertForMaskedLM

    directory = tmp_path / "encoder"
    BertForMaskedLM(TINY["bert"]).save_pretrained(directory)
    model = load_classifier(str(directory), 3, {0: "a", 1: "b", 2: "c"})
    assert model.config._attn_implementation == "sdpa"
    assert model.config.id2label == {0: "a", 1: "b", 2: "c"}


def test_a_class_without_sdpa_falls_back_to_the_default(tmp_path):
    """The refused request must not stick to the config (transformers 5 writes it there before refusing), or the
    retry would be refused too."""
    from transformers import OpenAIGPTLMHeadModel

    directory = saved_config(tmp_path, "openai-gpt")
    model = hf_causal_lm(task_args(directory), VOCAB)
    assert isinstance(model, OpenAIGPTLMHeadModel)
    assert model.config._attn_implementation != "sdpa"
    model(input_ids=torch.randint(0, VOCAB, (1, 4)))

    model.save_pretrained(directory)  # and from saved weights, through the fine-tuning task's loader
    classifier = load_classifier(str(directory), 2, {0: "no", 1: "yes"})
    assert classifier.config._attn_implementation != "sdpa"


def test_other_errors_are_not_taken_for_a_refusal(tmp_path):
    def broken(source, **kwargs):
        raise ValueError("vocab_size must be positive")

    with pytest.raises(ValueError, match="vocab_size"):
        load_hf_model(broken, "anything")
    with pytest.raises(ConfigError, match="cannot load the model"):
        load_classifier(str(tmp_path / "missing"), 2, {0: "no", 1: "yes"})
