"""Model specs: each family declares its blocks, size and dropout keys and LoRA targets; lookups go through
the registry, and a model no family claims gets the generic guesses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.models.spec import find_blocks, largest_stack, spec_for_config, spec_of


def test_families_and_their_blocks():
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    gpt = GPTModel(GPTConfig(vocab_size=50, num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=8))
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    )
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16))
    bert = BertForSequenceClassification(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    )
    for model, family, stack in (
        (gpt, "gpt", gpt.layers),
        (llama, "llama", llama.model.layers),
        (gpt2, "gpt2", gpt2.transformer.h),
        (bert, "bert", bert.bert.encoder.layer),
    ):
        spec = spec_of(model)
        assert spec.family == family
        assert list(find_blocks(model)) == list(stack)
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        assert set(spec.lora_targets) - {"gate_proj"} <= names  # the default LoRA targets exist in the model
    assert spec_for_config(gpt2.config).size_keys["num_layers"] == ("n_layer",)
    assert spec_for_config(bert.config).hidden_dropout_keys == ("hidden_dropout_prob",)


def test_a_model_no_family_claims_gets_the_generic_guesses():
    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2)])
            self.big = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    tower = Tower()
    assert spec_of(tower).family == "generic"
    assert find_blocks(tower) is tower.big is largest_stack(tower)
    assert find_blocks(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("flag,value", [("--hidden-dropout", 0.0), ("--attention-dropout", 0.0)])
def test_dropout_flags_reach_the_keys_the_family_names(flag, value):
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import engine

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    engine(flag, str(value)).compose(model_obj=model, lr_scheduler_fn=lambda o: None)
    keys = ("resid_pdrop", "embd_pdrop") if flag == "--hidden-dropout" else ("attn_pdrop",)
    assert all(getattr(model.config, key) == value for key in keys)
    assert torch.is_tensor(next(model.parameters()))
