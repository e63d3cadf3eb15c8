"""The built-in GPT (``rapidlite.models.gpt``): shapes, causality, init, loss, variants, reset masks,
safetensors round trips, learning, activation checkpointing, bf16 autocast and config errors."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rapidlite.errors import CheckpointError, ConfigError
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.models.spec import find_blocks
from rapidlite.parallel.recompute import apply_activation_checkpointing

TINY = dict(vocab_size=100, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
LLAMA.update(untie_embeddings_and_output_weights=True, bias=False)


def make(seed: int = 0, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    config = {**TINY, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides}
    return GPTModel(GPTConfig(**config)).eval()


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_padded_vocab_and_parameter_count():
    model = make()
    c = model.config
    assert c.padded_vocab_size == 128 and c.ffn_hidden_size == 128 and c.max_position_embeddings == 16
    assert model(tokens()).shape == (2, 16, 128)
    assert model.output.weight is model.embedding.word_embeddings.weight
    assert find_blocks(model) is model.layers
    v, p, h, f, n = 128, 16, 32, 128, 2
    block = 2 * 2 * h + 4 * (h * h + h) + (h * f + f) + (f * h + h)  # two LayerNorms, q/k/v/out, MLP
    expected = v * h + p * h + n * block + 2 * h
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - v * h - p * h
    assert model.flops_per_token() == 6 * (expected - p * h) + 12 * n * h * 16
    assert GPTConfig(**{**TINY, "make_vocab_size_divisible_by": 1}).padded_vocab_size == 100


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_causal(position):
    model = make(position_embedding_type=position)
    x = tokens()
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 100
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9], b[:, 9])


def test_init_std():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=1000, num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=16))
    layer = model.layers[0]
    for weight in (layer.attention.q_proj.weight, layer.mlp.up_proj.weight, model.embedding.word_embeddings.weight):
        assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    for weight in (layer.attention.out_proj.weight, layer.mlp.down_proj.weight):
        assert weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(layer.attention.q_proj.bias == 0) and torch.all(layer.mlp.down_proj.bias == 0)
    assert torch.all(layer.input_norm.weight == 1) and torch.all(model.final_norm.bias == 0)


def test_loss_matches_logits_and_respects_masks():
    model = make()
    x, labels = tokens(), tokens(seed=2)
    logits = model(x)
    loss_sum, count = model(x, labels=labels)
    assert isinstance(count, int) and count == 32 and loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, F.cross_entropy(logits.flatten(0, 1), labels.flatten()) * count)

    loss_mask = torch.ones(2, 16)
    loss_mask[0, :5] = 0
    labels[1, -3:] = -100
    loss_sum, count = model(x, labels=labels, loss_mask=loss_mask)
    keep = (loss_mask > 0) & (labels != -100)
    assert count == 32 - 5 - 3
    expected = F.cross_entropy(logits[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    _, count = model(x, labels=labels, loss_mask=loss_mask.bool())
    assert count == 24


def test_llama_variant_has_no_bias_and_expected_size():
    model = make(**LLAMA)
    c = model.config
    assert c.ffn_hidden_size == 128  # int(8 * 32 / 3) = 85, rounded up to a multiple of 64
    assert (
        GPTConfig(**{**TINY, "hidden_size": 4096, "num_attention_heads": 32, "swiglu": True}).ffn_hidden_size == 10944
    )
    assert model.embedding.position_embeddings is None
    assert model.output.weight is not model.embedding.word_embeddings.weight
    assert isinstance(model.final_norm, torch.nn.RMSNorm)
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    v, h, f, n = 128, 32, 128, 2
    assert model.num_parameters() == 2 * v * h + n * (2 * h + 4 * h * h + 3 * h * f) + h
    loss_sum, count = model(tokens(), labels=tokens(seed=2))
    assert torch.isfinite(loss_sum) and count == 32
    loss_sum.backward()


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_reset_attention_mask_and_position_ids_isolate_documents(position):
    model = make(position_embedding_type=position)
    x = tokens(batch=1)
    mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    mask[6:, :6] = False  # documents [0, 6) and [6, 16)
    position_ids = torch.cat([torch.arange(6), torch.arange(10)])[None]
    together = model(x, position_ids=position_ids, attention_mask=mask[None, None])
    torch.testing.assert_close(together[:, :6], model(x[:, :6]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[:, 6:], model(x[:, 6:]), atol=1e-5, rtol=1e-5)
    # Without the reset the second document sees the first one.
    assert not torch.allclose(model(x)[:, 6:], model(x[:, 6:]), atol=1e-3)


@pytest.mark.parametrize("variant", [{}, LLAMA], ids=["tied", "untied"])
def test_save_and_load_round_trip(tmp_path, variant):
    model = make(**variant)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_layers"] == 2 and config["model_type"] == "rapidlite-gpt"
    stored = load_file(tmp_path / "model.safetensors")
    assert ("output.weight" in stored) == bool(variant)
    loaded = GPTModel.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    assert (loaded.output.weight is loaded.embedding.word_embeddings.weight) == (not variant)
    x = tokens()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_save_with_explicit_state_dict(tmp_path):
    """The exporter passes full weights gathered elsewhere (both tied keys present, separate copies)."""
    target, other = make(seed=0), make(seed=1)
    full = {k: v.clone() for k, v in other.state_dict().items()}
    assert "output.weight" in full
    target.save_pretrained(tmp_path, state_dict=full, safe_serialization=True)
    loaded = GPTModel.from_pretrained(tmp_path).eval()
    x = tokens()
    torch.testing.assert_close(loaded(x), other(x), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="not found"):
        GPTModel.from_pretrained(tmp_path / "missing")


def test_learns_a_repeating_pattern():
    model = make().train()
    x = torch.arange(17).remainder(8).repeat(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss_sum, count = model(x[:, :-1], labels=x[:, 1:])
        loss = loss_sum / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 4.0 and losses[-1] < 0.5, losses


@pytest.mark.parametrize("granularity", ["full", "selective"])
@pytest.mark.parametrize("variant", [{}, LLAMA], ids=["gpt", "llama"])
def test_activation_checkpointing_gives_identical_gradients(granularity, variant):
    plain = make(**variant).train()
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, granularity, None) == 2
    x, labels = tokens(), tokens(seed=2)
    mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))[None, None]
    results = []
    for model in (plain, checkpointed):
        loss_sum, _ = model(x, attention_mask=mask, labels=labels)
        loss_sum.backward()
        results.append((loss_sum, {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_bf16_autocast_on_cpu():
    model = make(**LLAMA)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens())
        loss_sum, _ = model(tokens(), labels=tokens(seed=2))
    assert logits.dtype == torch.bfloat16 and loss_sum.dtype == torch.float32
    assert torch.isfinite(loss_sum)
    loss_sum.backward()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"hidden_size": 100, "num_attention_heads": 3},
            "--hidden-size 100 is not divisible by --num-attention-heads 3",
        ),
        ({"normalization": "BatchNorm"}, "--normalization BatchNorm"),
        ({"position_embedding_type": "alibi"}, "--position-embedding-type alibi"),
        ({"position_embedding_type": "rope", "hidden_size": 36, "num_attention_heads": 4}, "even head size"),
        ({"seq_length": 32, "max_position_embeddings": 16}, "--seq-length 32 exceeds --max-position-embeddings 16"),
        ({"num_layers": 0}, "--num-layers 0"),
        ({"ffn_hidden_size": -1}, "--ffn-hidden-size -1"),
        ({"make_vocab_size_divisible_by": 0}, "--make-vocab-size-divisible-by 0"),
        ({"init_method_std": 0.0}, "--init-method-std 0.0"),
        ({"hidden_dropout": 1.0}, "--hidden-dropout 1.0"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        GPTConfig(**{**TINY, **overrides})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_rope_allows_longer_sequences_than_learned_positions():
    GPTConfig(**{**TINY, "position_embedding_type": "rope", "seq_length": 32, "max_position_embeddings": 16})
    with pytest.raises(ConfigError, match="--max-position-embeddings 16"):
        make()(tokens(length=20))


def test_dropout_flags_reach_the_attention_of_a_model_built_by_the_user():
    """A white-box GPTModel built from its own config: --hidden-dropout/--attention-dropout still apply."""
    from rapidlite.models.gpt import GPTConfig, GPTModel
    from rapidlite.strategies.base import set_dropout as _set_dropout

    model = GPTModel(GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16))
    assert model.layers[0].attention.dropout > 0  # the config's default
    _set_dropout(model, 0.0, 0.0)
    assert all(layer.attention.dropout == 0.0 for layer in model.layers)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
