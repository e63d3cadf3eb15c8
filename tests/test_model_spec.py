"""Model specs: each family declares its blocks, size and dropout keys and LoRA targets; lookups go through
the registry, and a model no family claims gets the generic guesses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapidlite.errors import ConfigError
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
        # The default LoRA targets exist in the model, but for the ones only some family members have (Phi-3's fused
        # qkv_proj and gate_up_proj, the built-in GPT's experts with --num-experts).
        assert set(spec.lora_targets) - {"gate_proj", "qkv_proj", "gate_up_proj", "experts"} <= names
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


class Tower(nn.Module):
    """A model no built-in family claims."""

    def __init__(self, config=None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


class Split:
    """A stand-in pipeline split (the registry only hands it over)."""

    name = "tower"

    def unsupported(self, model):
        return None if len(model.blocks) > 1 else "it needs two blocks"


@pytest.fixture
def tower_family(monkeypatch):
    """A family registered the way a user's module would, removed again after the test."""
    from rapidlite.models import spec

    monkeypatch.setattr(spec, "_REGISTRY", list(spec._REGISTRY))
    applied = []
    return applied, spec.register(
        spec.ModelSpec(
            family="tower",
            matches=lambda model: isinstance(model, Tower),
            blocks=lambda model: model.blocks,
            tensor_parallel=lambda model, mesh, sp: applied.append((model, mesh, sp)),
            pipeline=Split(),
            flops_dims=lambda config: (config.depth, config.width),
        )
    )


def test_a_registered_family_is_used_for_blocks_tensor_and_pipeline_parallelism_and_flops(tower_family):
    import types

    from rapidlite.models.flops import ModelFlops
    from rapidlite.parallel.pipeline import family_of
    from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

    applied, spec = tower_family
    model, mesh = Tower(types.SimpleNamespace(depth=7, width=16)), object()
    assert spec_of(model) is spec and find_blocks(model) is model.blocks
    assert apply_tensor_parallel(model, mesh, True) is model and applied == [(model, mesh, True)]
    assert family_of(model) is spec.pipeline
    flops = ModelFlops.of(model)
    assert (flops.num_layers, flops.hidden_size) == (7, 16)
    model.blocks = model.blocks[:1]
    with pytest.raises(ConfigError, match="the tower family's pipeline split cannot take Tower: it needs two blocks"):
        family_of(model)


def test_the_generic_family_refuses_tensor_and_pipeline_parallelism_in_one_line():
    from rapidlite.parallel.pipeline import PipelineRunner
    from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

    model = Tower()
    assert spec_of(model).family == "generic"
    with pytest.raises(ConfigError, match="no tensor-parallel plan for Tower: its model family declares none") as tp:
        apply_tensor_parallel(model, object(), False)
    with pytest.raises(ConfigError, match=r"no pipeline split for Tower \(the generic model family\); the families "
                       "with one: bert, gpt, gpt2, llama") as pp:  # fmt: skip
        PipelineRunner(model, None, 0, 2, torch.device("cpu"), "1f1b")
    assert "\n" not in str(tp.value) + str(pp.value)


def test_a_family_without_a_plan_is_refused_with_the_families_that_have_one(tower_family, monkeypatch):
    import dataclasses

    from rapidlite.models import spec
    from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

    _, tower = tower_family
    spec._REGISTRY[-1] = dataclasses.replace(tower, tensor_parallel=None)
    with pytest.raises(ConfigError, match=r"no tensor-parallel plan for Tower \(the tower model family\); the "
                       "families with one: bert, gpt, gpt2, llama$"):  # fmt: skip
        apply_tensor_parallel(Tower(), object(), False)


def test_pipeline_splits_refuse_what_they_would_get_wrong_in_one_line():
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Gemma2Config,
        Gemma2ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from rapidlite.parallel.pipeline import family_of

    bert = BertForSequenceClassification(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    )
    with pytest.raises(ConfigError, match="the bert family's pipeline split cannot take BertForSequenceClassification"):
        family_of(bert)
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, head_dim=8,
        )
    )  # fmt: skip
    with pytest.raises(ConfigError, match="final logit soft-capping would be skipped"):
        family_of(gemma2)
    qwen2 = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        )
    )  # fmt: skip
    with pytest.raises(ConfigError, match="its sliding_attention layers would be masked as full causal attention"):
        family_of(qwen2)


def test_flops_read_the_size_keys_of_the_family():
    import types

    from rapidlite.models.flops import ModelFlops

    t5_like = ModelFlops.of(Tower(types.SimpleNamespace(num_layers=3, d_model=8)))  # the generic family's keys
    assert (t5_like.num_layers, t5_like.hidden_size) == (3, 8)
    assert ModelFlops.of(Tower()).describe().startswith("6 N (")


def test_model_knowledge_is_not_keyed_by_class_names():
    """Families are looked up through the registry: no ``type(x).__name__ == ...`` in the models, the FLOPs count,
    or the parallelism that applies the families' plans."""
    import ast

    from helpers import REPO

    package = REPO / "rapidlite"
    paths = [*(package / "models").rglob("*.py")]  # models/flops.py among them
    paths += [package / "parallel" / name for name in ("tensor_parallel.py", "pipeline.py", "recompute.py")]
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Attribute) and o.attr in ("__name__", "__qualname__") for o in operands):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert len(paths) > 10 and found == []


def test_the_decoder_split_masks_a_sliding_window_as_the_model_does():
    """One stage holding the whole Mistral-style model (window 4, sequence 12) computes the model's logits."""
    import types

    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, sliding_window=4,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    split = spec_of(model).pipeline
    assert split.unsupported(model) is None
    ids = torch.randint(0, 50, (1, 12))
    layers = nn.ModuleDict({str(i): block for i, block in enumerate(split.blocks(model))})
    stage = types.SimpleNamespace(
        first=True, last=True, config=model.config, layers=layers, **split.stage_parts(model, True, True)
    )
    with torch.no_grad():
        logits = split.run(stage, ids, split.bind(model, (ids,), {}))
        torch.testing.assert_close(logits, model(ids).logits)
