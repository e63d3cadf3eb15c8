"""Mixture-of-experts models (``rapidlite.models.moe``, ``models/families/moe.py``): the router loss equals
transformers' for every family and reaches the gradients as transformers adds it, LoRA adapts the 3-D expert
tensors and exports them, two ranks train as one process, and what is not built is one line."""

import pytest
import torch

from helpers import assert_same_metrics, rapidlite, rapidlite_captured, read_metrics, write_jsonl
from helpers import engine as make_engine
from rapidlite.config.moe import MoEConfig
from rapidlite.models import moe
from rapidlite.models.flops import ModelFlops

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SMALL |= {"num_experts_per_tok": 2, "max_position_embeddings": 128}
FAMILIES = {
    "mixtral": {"intermediate_size": 48, "num_local_experts": 4},
    "qwen2_moe": {"intermediate_size": 48, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48},
    "qwen3_moe": {"intermediate_size": 48, "moe_intermediate_size": 24, "num_experts": 4, "head_dim": 8},
    "olmoe": {"intermediate_size": 24, "num_experts": 4},
    "deepseek_v3": {
        "intermediate_size": 48, "moe_intermediate_size": 24, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_key_value_heads": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    },
    "gpt_oss": {"intermediate_size": 24, "num_local_experts": 4, "head_dim": 8},
}  # fmt: skip
FAMILIES["qwen2_moe"]["num_experts"] = 4


def tiny(model_type, vocab_size=100, **ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES[model_type], "vocab_size": vocab_size, **ids})
    return AutoModelForCausalLM.from_config(config)


def penalty_and_metrics(model, *args, **kwargs):
    """One training forward through the router hooks: (the penalty, the reported metrics)."""
    hooks = moe.router_loss(model, MoEConfig(moe_z_loss_coeff=0.5), lambda dest: False, None)
    model.train()
    out = model(*args, **kwargs)
    penalty = hooks.penalty(None)
    metrics = {}
    hooks.report(lambda name, total, count: metrics.__setitem__(name, float(total) / count))
    hooks.remove()
    return out, penalty, metrics


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_router_loss_equals_transformers_aux_loss(family):
    """On a padded batch: the logged moe_aux_loss is transformers' aux_loss (DeepSeek-V3's model computes none:
    the function the others use, on its router logits), and the penalty is coefficient x it plus the z-loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = tiny(family)
    ids = torch.randint(0, 100, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = mask[2, 2:] = 0
    out, penalty, metrics = penalty_and_metrics(model, input_ids=ids, attention_mask=mask, output_router_logits=True)
    layout, config = moe.moe_layout(model), model.config
    expected = out.aux_loss
    if expected is None:
        logits = tuple(r for r in out.router_logits if r is not None)
        expected = load_balancing_loss_func(logits, layout.num_experts(config), layout.top_k(config), mask)
    assert metrics["moe_aux_loss"] == pytest.approx(expected.item(), abs=1e-6)
    logits = [r for r in out.router_logits if r is not None]
    z = moe.z_loss(logits, mask.reshape(-1).float())
    assert penalty.item() == pytest.approx(layout.aux_coeff(config) * expected.item() + 0.5 * z.item(), abs=1e-6)
    layers = [k for k in metrics if k.startswith("moe/layer_")]
    assert len(layers) == len(moe.routers(model)) and metrics["moe/load_max_over_mean"] >= 1


def test_the_router_loss_reaches_the_gradients_as_transformers_adds_it(tmp_path):
    """compose + one micro-batch through the strategy: every gradient equals transformers' own loss with labels and
    output_router_logits (language-model loss + router_aux_loss_coef x aux_loss), with a coefficient of 0.5."""
    reference, model = tiny("qwen3_moe", router_aux_loss_coef=0.5), tiny("qwen3_moe", router_aux_loss_coef=0.5)
    ids = torch.randint(0, 100, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    reference(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    engine = make_engine("--train-iters", "1", "--micro-batch-size", "2")
    composed, optimizer, _ = engine.compose(model)
    step = lambda: composed(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    engine.strategy.forward_backward(composed, optimizer, [step])
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_flops_count_the_active_experts():
    model = tiny("qwen3_moe")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = ModelFlops.of(tiny("qwen3_moe")).matmul_params
    total = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert dense == total - experts + experts * 2 // 4  # top 2 of 4 experts


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("moe"))


def build_assets(root):
    """The causal-LM demo's tokenizer and data, with a tiny Qwen3-MoE and Mixtral of its vocabulary."""
    from transformers import AutoTokenizer

    from rapidlite.tasks.causal_lm_demo import write_demo_assets

    model_dir, data_dir = write_demo_assets(root / "demo", seed=7, num_train=64, num_validation=8)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    out = {"data": str(data_dir)}
    for family in ("qwen3_moe", "mixtral"):
        tiny(family, vocab_size=len(tok), **ids).save_pretrained(root / family)
        tok.save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def args(assets, family, *extra):
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", assets[family], "--data-path", assets["data"],
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--log-interval", "1", "--lr", "1e-2", "--eval-iters", "1", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lora_adapts_the_experts_and_the_merged_export_gives_the_adapters_logits(assets, family, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    proc = rapidlite_captured(*args(assets, family, "--lora-rank", "4", "--merge-lora", "--save", str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if "LoRA: rank 4" in x)
    assert "and the experts' down_proj, gate_up_proj (trainable:" in line, line
    assert "router frozen" in proc.stdout
    assert all("moe_aux_loss" in r for r in read_metrics(tmp_path) if "split" not in r and "loss" in r)
    adapter = load_file(str(tmp_path / "hf" / "adapter" / "adapter_model.safetensors"))
    for layer in range(SMALL["num_hidden_layers"]):  # every expert tensor has its adapter
        assert sum(f"layers.{layer}.mlp.experts." in k and "lora_A" in k for k in adapter) == 2, sorted(adapter)
    ids = torch.randint(3, 60, (2, 11))
    base = AutoModelForCausalLM.from_pretrained(assets[family])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(input_ids=ids).logits
        untrained = AutoModelForCausalLM.from_pretrained(assets[family]).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert (adapted - untrained).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "extra",
    [["--zero-3-memory-optimization"], ["--lora-rank", "4", "--zero-3-memory-optimization"]],
    ids=["zero3", "lora_zero3"],
)
def test_two_ranks_train_as_one_process(assets, tmp_path, extra):
    """Accumulation 8 on one process against 4 on each of 2 ranks, a sample per micro-batch (the router loss is
    each micro-batch's: one process and two ranks then see the same micro-batches), and a router loss weight of
    0.1 (its share in the gradients shows): the losses, gradient norms and router losses agree."""
    extra = [*extra, "--micro-batch-size", "1", "--moe-aux-loss-coeff", "0.1"]
    one = tmp_path / "one"  # a process of its own: ZeRO-3 on one process starts a process group
    proc = rapidlite(*args(assets, "qwen3_moe", *extra, "--save", str(one)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    proc = rapidlite(*args(assets, "qwen3_moe", *extra, "--nproc-per-node", "2", "--save", str(two)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_metrics(two, one, ["loss", "grad_norm", "moe_aux_loss", "moe/load_max_over_mean"], rel=1e-5, at_least=3)


BAD = {
    "a dense model": (
        "llama",
        ["--moe-aux-loss-coeff", "0.1"],
        "--moe-aux-loss-coeff: Llama is not a mixture of experts",
    ),
    "4-bit experts": ("qwen3_moe", ["--lora-rank", "4", "--load-in-4bit"], "--load-in-4bit: bitsandbytes quantises"),
    "dropout on experts": ("qwen3_moe", ["--lora-rank", "4", "--lora-dropout", "0.1"], "--lora-dropout: peft adapts"),
    "tensor parallel": (
        "qwen3_moe",
        ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
        "--tensor-model-parallel-size: there is no tensor-parallel plan for Qwen3MoeForCausalLM",
    ),
    "a negative coefficient": ("qwen3_moe", ["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff -1.0: must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_is_not_built_is_one_line(assets, case, tmp_path):
    family, extra, says = BAD[case]
    if family == "llama":
        from rapidlite.tasks.causal_lm_demo import write_demo_assets

        assets = {**assets, "llama": str(write_demo_assets(tmp_path / "demo", seed=7, num_train=8)[0])}
    run = rapidlite if "--nproc-per-node" in extra else rapidlite_captured
    proc = run(*args(assets, family, *extra, "--save", str(tmp_path / "run")))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("rapidlite: error:")]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_freeze_router_keeps_the_router_and_the_z_loss_is_logged(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    argv = args(assets, "qwen3_moe", "--freeze-router", "--moe-z-loss-coeff", "0.01", "--save", str(tmp_path))
    proc = rapidlite_captured(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "z-loss x0.01 | router frozen" in proc.stdout
    records = [r for r in read_metrics(tmp_path) if "split" not in r and "loss" in r]
    assert records and all(r["moe_z_loss"] > 0 for r in records)
    before = AutoModelForCausalLM.from_pretrained(assets["qwen3_moe"]).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    gate, experts = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(before[gate], after[gate]) and not torch.equal(before[experts], after[experts])


@pytest.fixture(scope="module")
def plain(assets, tmp_path_factory):
    """One process, accumulation 4 of micro-batches holding different token counts, router loss weight 0.1."""
    save = tmp_path_factory.mktemp("plain")
    proc = rapidlite_captured(*args(assets, "qwen3_moe", "--moe-aux-loss-coeff", "0.1", "--save", str(save)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [["--checkpoint-activations"], ["--deepspeed", "--zero-2-memory-optimization"]], ids=["recompute", "ds"]
)
def test_one_process_layouts_weigh_the_router_loss_alike(assets, plain, tmp_path, extra):
    """Activation checkpointing recomputes the routers in the backward pass (counted once), and DeepSpeed divides
    the losses itself (the router loss is scaled with the summed loss): both train as the plain run."""
    proc = rapidlite(*args(assets, "qwen3_moe", *extra, "--moe-aux-loss-coeff", "0.1", "--save", str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_metrics(tmp_path, plain, ["loss", "grad_norm", "moe_aux_loss"], rel=1e-5, at_least=3)


def one_step_args(assets, family, lr):
    """One SGD step over every training row (64: one global batch), no router loss (peft's step has none)."""
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", assets[family], "--data-path", assets["data"],
        "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "64", "--train-iters", "1",
        "--lora-rank", "4", "--lora-alpha", "8", "--optimizer", "sgd", "--sgd-momentum", "0", "--lr", lr,
        "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0", "--moe-aux-loss-coeff", "0",
        "--log-interval", "1", "--merge-lora", "--no-progress",
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_lora_step_equals_peft_target_parameters_by_hand(assets, family, tmp_path):
    """The adapters rapidlite starts from (a step of learning rate 1e-30), then one step written with peft
    (target_modules for attention, target_parameters for the experts) on the same rows: its adapter and its
    logits equal rapidlite's exported adapter and merged model."""
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rapidlite import RapidliteEngine
    from rapidlite.resolve import parse_args
    from rapidlite.tasks.causal_lm import CausalLMFinetuner

    for name, lr in (("start", "1e-30"), ("step", "0.5")):
        proc = rapidlite_captured(*one_step_args(assets, family, lr), "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(assets[family]),
        str(tmp_path / "start" / "hf" / "adapter"),
        is_trainable=True,
    )
    config = model.peft_config["default"]
    assert set(config.target_parameters) == {"experts.gate_up_proj", "experts.down_proj"}
    assert isinstance(config, LoraConfig)
    assert {t.rsplit(".", 1)[-1] for t in config.target_modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainer = CausalLMFinetuner(RapidliteEngine(args=parse_args(one_step_args(assets, family, "0.5"))))
    train, _, _, collate = trainer.train_valid_test_datasets_provider()
    loss_sum, count = trainer.run_forward_step(collate([train[i] for i in range(len(train))]), model.train())
    (loss_sum / count).backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    got = load_file(str(tmp_path / "step" / "hf" / "adapter" / "adapter_model.safetensors"))
    want = get_peft_model_state_dict(model)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    probe = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "step" / "hf").eval()(probe).logits
        torch.testing.assert_close(merged, model.eval()(probe).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("task", ["dpo", "grpo"])
def test_preference_and_online_rl_add_the_router_loss(assets, task, tmp_path):
    """The router loss rides on each task's own forward (DPO's chosen and rejected, GRPO's scored completions);
    sampling adds nothing to it."""
    words = "red blue green fox cat dog".split()
    rows = [
        {"prompt": " ".join(words[i % 6 :] + words[: i % 6]), "chosen": "red fox", "rejected": "cat"} for i in range(8)
    ]
    write_jsonl(tmp_path / "data", "train", rows)
    (tmp_path / "reward.py").write_text(
        "def reward(prompts, completions, **kw):\n    return [float('red' in c) for c in completions]\n"
    )
    extra = [
        "--reward-funcs",
        f"{tmp_path / 'reward.py'}:reward",
        "--num-generations",
        "2",
        "--max-completion-length",
        "6",
    ]
    argv = [
        "--task", task, "--pretrained-model-name-or-path", assets["qwen3_moe"], "--data-path", str(tmp_path / "data"),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1",
        "--no-progress", "--save", str(tmp_path / "run"), *(extra if task == "grpo" else []),
    ]  # fmt: skip
    proc = rapidlite_captured(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for r in read_metrics(tmp_path / "run") if "split" not in r and "loss" in r]
    assert len(records) == 2 and all(1.0 <= r["moe_aux_loss"] < 4.0 for r in records), records
