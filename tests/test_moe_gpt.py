"""The built-in GPT as a mixture of experts (``--num-experts``, ``rapidlite.models.gpt_moe``): the grouped matmul
equals the per-expert loop, the router losses are Megatron's, the expert bias balances the load, the export
is a Mixtral that transformers loads with the same logits, two ranks train as one process, and what is not
built is one line."""

import dataclasses

import pytest
import torch

from helpers import assert_same_metrics, rapidlite, rapidlite_captured, read_metrics, write_tiny_corpus
from rapidlite.config.moe import MoEConfig
from rapidlite.models import moe
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.models.gpt_moe import within_capacity

LLAMA_STYLE = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "bias": False}
CONFIG = GPTConfig(
    vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, num_experts=4,
    moe_ffn_hidden_size=24, hidden_dropout=0.0, attention_dropout=0.0, **LLAMA_STYLE,
)  # fmt: skip
FLAGS = [
    "--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2",
    "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
    "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--num-experts", "4", "--moe-ffn-hidden-size", "24", "--swiglu", "--normalization",
    "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny_corpus(prefix)
    return str(prefix)


def model_of(**changes):
    torch.manual_seed(0)
    return GPTModel(dataclasses.replace(CONFIG, **changes))


@pytest.mark.parametrize("swiglu", [True, False], ids=["swiglu", "gelu"])
def test_the_grouped_matmul_equals_the_loop(swiglu):
    """The same weights through torch._grouped_mm and through one matmul per expert: logits and gradients."""
    ids = torch.randint(0, 64, (3, 16))
    results = []
    for grouped in (False, True):
        model = model_of(moe_grouped_gemm=grouped, swiglu=swiglu, moe_shared_expert_intermediate_size=16)
        loss, _ = model(ids, labels=ids)
        loss.backward()
        results.append((model(ids).detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loop_logits, loop_grads), (grouped_logits, grouped_grads) = results
    torch.testing.assert_close(grouped_logits, loop_logits, rtol=0, atol=1e-6)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("first_call", ["checkpointed", "no_grad"])
def test_the_grouped_matmuls_probe_leaves_no_trace_in_its_first_forward(first_call):
    """The probe of whether torch._grouped_mm runs is made by the first forward: inside activation checkpointing it
    saves nothing the recomputation would not (it raised CheckpointError), and under no_grad it still finds that
    the grouped matmul runs (it answered no for the whole process)."""
    from rapidlite.models import gpt_moe

    model = model_of(moe_grouped_gemm=True)
    ids = torch.randint(0, 64, (2, 16))
    gpt_moe.grouped_mm_runs.cache_clear()
    try:
        if first_call == "no_grad":
            with torch.no_grad():
                model(ids)
            assert gpt_moe.grouped_mm_runs("cpu", torch.float32)
            return
        layer = model.layers[0].mlp
        x = torch.randn(2, 16, 32, requires_grad=True)
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
        assert x.grad is not None
    finally:
        gpt_moe.grouped_mm_runs.cache_clear()


@pytest.mark.parametrize("policy,kept", [("probs", [False, True, True, True]), ("position", [True, True, False, True])])
def test_a_capacity_keeps_each_experts_best_pairs(policy, kept):
    """4 tokens, top-1 of 2 experts, factor 1: each expert takes ceil(4 / 2) = 2; expert 0, chosen thrice, drops
    its lowest-probability pair (probs) or its latest token (position)."""
    chosen = torch.tensor([[0], [0], [0], [1]])
    weights = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    keep = within_capacity(chosen, weights, experts=2, factor=1.0, policy=policy)
    assert keep.reshape(-1).tolist() == kept


def test_a_capacity_drops_the_pairs_over_it_in_training_only():
    """A layer with capacity factor 0.5: its training output is every kept (token, choice) pair's expert output
    times its unchanged routing weight, written out here expert by expert; its share dropped is recorded; in
    evaluation nothing is dropped (the dropless layer's output, the same weights)."""
    model = model_of(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    layer = model.layers[0].mlp
    x = torch.randn(2, 16, 32)
    y = layer(x)
    _, weights, chosen = layer.router(x)
    keep = within_capacity(chosen, weights, 4, 0.5, "probs")
    flat = x.reshape(-1, 32)
    first, down = layer.experts.gate_up_proj, layer.experts.down_proj
    expected = torch.zeros_like(flat)
    for t, c in keep.nonzero().tolist():
        e = int(chosen[t, c])
        gate, up = (first[e] @ flat[t]).chunk(2)
        expected[t] += weights[t, c] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(y.reshape(-1, 32), expected, rtol=1e-5, atol=1e-6)
    assert 0 < float(layer.dropped) == pytest.approx(1 - keep.float().mean().item())
    dropless = model_of()  # the same seed: the same weights
    model.eval(), dropless.eval()
    torch.testing.assert_close(layer(x), dropless.layers[0].mlp(x), rtol=0, atol=0)


def megatron_aux(probs, routing_map, top_k, experts):
    """Megatron-Core's ``switch_load_balancing_loss_func`` (coefficient 1), as its code writes it."""
    num_tokens = probs.shape[0]
    tokens_per_expert = routing_map.sum(0).float()
    aggregated = probs.sum(0)
    return (aggregated * tokens_per_expert).sum() * experts / (num_tokens * num_tokens * top_k)


def megatron_seq_aux(probs, routing_map, top_k, experts, batch):
    """Megatron-Core's ``sequence_load_balancing_loss_func`` (coefficient 1), on ``[batch * seq]`` tokens."""
    seq = probs.shape[0] // batch
    probs, routing_map = probs.view(batch, seq, experts), routing_map.view(batch, seq, experts)
    cost = routing_map.sum(1).float() / (seq * top_k / experts)
    return (cost * probs.mean(1)).sum(-1).mean()


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "none"])
def test_the_router_losses_are_megatrons(balancing):
    """Each layer's loss as Megatron computes it from the router's probabilities and routing map, summed over
    the layers, plus the z-loss (each layer's mean squared log-sum-exp, summed)."""
    model = model_of(moe_router_load_balancing_type=balancing)
    hooks = moe.router_loss(model, MoEConfig(moe_z_loss_coeff=0.5), lambda dest: False, None)
    logits = []
    handles = [layer.mlp.router.register_forward_hook(lambda m, a, out: logits.append(out)) for layer in model.layers]
    model.train()
    ids = torch.randint(0, 64, (3, 16))
    model(ids, labels=ids)
    penalty = hooks.penalty(None)
    metrics = {}
    hooks.report(lambda name, total, count: metrics.__setitem__(name, float(total) / count))
    for h in handles:
        h.remove()
    aux = z = 0.0
    for router_logits, _, chosen in logits:
        probs = router_logits.float().softmax(-1)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, chosen, True)
        if balancing == "aux_loss":
            aux += megatron_aux(probs, routing_map, 2, 4)
        elif balancing == "seq_aux_loss":
            aux += megatron_seq_aux(probs, routing_map, 2, 4, batch=3)
        z += router_logits.float().logsumexp(-1).square().mean()
    if balancing == "none":
        assert "moe_aux_loss" not in metrics
        torch.testing.assert_close(penalty, 0.5 * z, rtol=1e-6, atol=1e-7)
    else:
        assert metrics["moe_aux_loss"] == pytest.approx(float(aux.detach()), rel=1e-6)
        torch.testing.assert_close(penalty, 1e-2 * aux + 0.5 * z, rtol=1e-6, atol=1e-7)
    assert metrics["moe_z_loss"] == pytest.approx(float(z.detach()), rel=1e-6)


def test_the_expert_bias_chooses_and_moves_towards_the_experts_that_got_fewer_tokens():
    """The bias changes which experts are chosen, not their weights (the probabilities, renormalised); after a
    step each bias moves by the rate towards the experts below the mean load."""
    model = model_of(moe_router_enable_expert_bias=True)
    router = model.layers[0].mlp.router
    x = torch.randn(10, 32)
    with torch.no_grad():
        router.expert_bias[3] = 10.0  # expert 3 is in every token's top 2
        logits, weights, chosen = router(x)
    assert (chosen == 3).any(-1).all()
    probs = logits.softmax(-1).gather(-1, chosen)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
    hooks = moe.router_loss(model, MoEConfig(moe_router_bias_update_rate=0.25), lambda dest: False, None)
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids)
    loads = [torch.bincount(c.reshape(-1), minlength=4).float() for c in hooks._chosen]
    before = [layer.mlp.router.expert_bias.clone() for layer in model.layers]
    hooks.penalty(None)
    hooks.update_expert_bias()
    for layer, load, old in zip(model.layers, loads, before, strict=True):
        expected = old + 0.25 * torch.sign(load.mean() - load)
        torch.testing.assert_close(layer.mlp.router.expert_bias, expected)
    assert (model.layers[0].mlp.router.expert_bias[3] < 10.0).item()  # the overloaded expert's bias went down


def test_a_run_exports_a_mixtral_that_transformers_loads_with_the_same_logits(corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    argv = [*FLAGS, "--data-path", corpus, "--global-batch-size", "2", "--train-iters", "3", "--moe-grouped-gemm"]
    proc = rapidlite_captured(*argv, "--moe-router-topk", "1", "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixture of experts: 4 experts, top 1, routed in 2 of 2 blocks | aux_loss x0.01" in proc.stdout
    assert all("moe_aux_loss" in r for r in read_metrics(tmp_path) if "split" not in r and "loss" in r)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_experts_per_tok == 1
    ours = GPTModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_a_shared_expert_has_no_hugging_face_layout_and_is_saved_in_rapidlites(corpus, tmp_path):
    argv = [*FLAGS, "--data-path", corpus, "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "1"]
    proc = rapidlite_captured(*argv, "--moe-shared-expert-intermediate-size", "16", "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "the built-in mixture of experts with a shared expert has no Hugging Face layout" in proc.stdout + proc.stderr
    )
    assert GPTModel.from_pretrained(tmp_path / "hf").layers[0].mlp.shared_experts is not None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "extra",
    [
        ["--moe-router-enable-expert-bias", "--moe-grouped-gemm", "--moe-router-bias-update-rate", "0.05"],
        ["--zero-3-memory-optimization", "--moe-router-load-balancing-type", "seq_aux_loss",
         "--moe-z-loss-coeff", "0.1"],
        ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0"],
    ],
    ids=["ddp_expert_bias", "zero3_seq_aux", "ep2_capacity"],
)  # fmt: skip
def test_two_ranks_train_as_one_process(corpus, tmp_path, extra):
    """Accumulation 2 on one process against 2 ranks, with a router loss weight of 0.1 (its share in the
    gradients shows): losses, gradient norms, router losses and loads agree (the expert bias, moved by the load
    summed over the ranks, chooses the same experts on both)."""
    argv = [*FLAGS, "--data-path", corpus, "--global-batch-size", "4", "--train-iters", "4", "--moe-aux-loss-coeff"]
    argv += ["0.1", *extra]
    one = tmp_path / "one"  # a process of its own: ZeRO-3 on one process starts a process group
    single = list(argv)
    if "--expert-model-parallel-size" in single:  # one process holds every expert
        i = single.index("--expert-model-parallel-size")
        del single[i : i + 2]
    proc = rapidlite(*single, "--save", str(one))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    proc = rapidlite(*argv, "--nproc-per-node", "2", "--save", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = ["loss", "grad_norm", "moe_aux_loss", "moe/load_max_over_mean"]
    if "--moe-expert-capacity-factor" in extra:  # each rank drops over its own tokens, as one process per micro-batch
        keys.append("moe/dropped_tokens")
        dropped = [r["moe/dropped_tokens"] for r in read_metrics(one) if "moe/dropped_tokens" in r]
        assert len(dropped) == 4 and all(0 < d < 1 for d in dropped), dropped
    assert_same_metrics(two, one, keys, rel=1e-5, at_least=8)


BAD = {
    "top-k above the experts": (
        ["--moe-router-topk", "5"], "--moe-router-topk 5: must be between 1 and --num-experts 4"
    ),
    "an expert flag on a dense model": (
        ["--num-experts", None, "--moe-router-topk", "1"],
        "--moe-router-topk: the built-in GPT is dense; add --num-experts N",
    ),
    "a capacity of 0": (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor 0: must be > 0"),
    "a drop policy without a capacity": (
        ["--moe-token-drop-policy", "position"],
        "--moe-token-drop-policy: no token is dropped without --moe-expert-capacity-factor",
    ),
    "tensor parallelism": (
        ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
        "--tensor-model-parallel-size 2: the built-in GPT's experts (--num-experts) are not split that way",
    ),
    "a Hugging Face model": (  # its config's sizes, the built-in's architecture flags dropped
        ["--pretrained-model-name-or-path", "gpt2-like", "--num-experts", "8"],
        "--num-experts shapes the built-in GPT's experts; a Hugging Face model's come from its config.json",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_what_is_not_built_is_one_line(corpus, case):
    extra, message = BAD[case]
    argv = [*FLAGS, "--data-path", corpus, "--train-iters", "1"]
    if "--pretrained-model-name-or-path" in extra:
        argv = argv[: argv.index("--swiglu")] + ["--data-path", corpus, "--train-iters", "1"]
    if None in extra:  # drop the flag named before it
        drop = extra[extra.index(None) - 1]
        i = argv.index(drop)
        argv, extra = argv[:i] + argv[i + 2 :], [a for a in extra if a not in (drop, None)]
    proc = rapidlite_captured(*argv, *extra, "--dry-run")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
