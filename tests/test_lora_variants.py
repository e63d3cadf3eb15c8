"""LoRA variants through peft (``--use-dora``, ``--use-rslora``, ``--loraplus-lr-ratio``, ``--lora-init``): one
optimizer step of each equals the same step written by hand with peft (its model, its LoRA+ optimizer), in the
exported adapter and the merged model's logits; ZeRO-3 on 2 ranks equals one process."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import rapidlite, rapidlite_here
from rapidlite import RapidliteEngine
from rapidlite.models import lora
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import CausalLMFinetuner
from rapidlite.tasks.causal_lm_demo import write_demo_assets

peft = pytest.importorskip("peft")

ROWS = 16  # one global batch of every row: the step does not depend on the order the rows come in
VARIANTS = {
    "dora": ["--use-dora"],
    "rslora": ["--use-rslora"],
    "loraplus": ["--loraplus-lr-ratio", "4"],
    "gaussian": ["--lora-init", "gaussian"],
    "pissa": ["--lora-init", "pissa"],
    "olora": ["--lora-init", "olora"],
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_demo_assets(tmp_path_factory.mktemp("variants"), seed=3, num_train=ROWS, num_validation=4)


def argv(assets, *extra, lr="0.5"):
    model_dir, data_dir = assets
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "8", "--global-batch-size", str(ROWS), "--seq-length", "64", "--train-iters", "1",
        "--lora-rank", "4", "--lora-alpha", "8", "--optimizer", "sgd", "--sgd-momentum", "0", "--lr", lr,
        "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--merge-lora", *extra,
    ]  # fmt: skip


def peft_config(variant):
    flags = VARIANTS[variant]
    init = flags[1] if flags[0] == "--lora-init" else True
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM", init_lora_weights=init,
                           use_dora=variant == "dora", use_rslora=variant == "rslora")  # fmt: skip


def by_hand(assets, variant, start):
    """One SGD step written with peft: the same rows in one batch, the same loss (rapidlite's token-exact sum),
    peft's LoRA+ optimizer for LoRA+. ``start``: the adapter directory rapidlite started from (a random init),
    or None (an init computed from the weights)."""
    base = lora_base(assets)
    if start is None:
        model = peft.get_peft_model(base, peft_config(variant))
    else:
        model = peft.PeftModel.from_pretrained(base, str(start), is_trainable=True)
    trainer = CausalLMFinetuner(RapidliteEngine(args=parse_args(argv(assets))))
    train, _, _, collate = trainer.train_valid_test_datasets_provider()
    batch = collate([train[i] for i in range(len(train))])
    assert len(train) == ROWS
    if variant == "loraplus":
        from peft.optimizers import create_loraplus_optimizer

        optimizer = create_loraplus_optimizer(model, torch.optim.SGD, lr=0.5, loraplus_lr_ratio=4.0)
    else:
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss_sum, count = trainer.run_forward_step(batch, model)
    (loss_sum / count).backward()
    optimizer.step()
    return model.eval()


def lora_base(assets):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.float32)
    lora.keep_training_kernel(base)
    return base


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    root, done = tmp_path_factory.mktemp("variant_runs"), {}

    def get(variant, layout="one"):
        if (variant, layout) not in done:
            save = root / f"{variant}-{layout}"
            if layout == "one":
                assert rapidlite_here(*argv(assets, *VARIANTS[variant]), "--save", str(save)) == 0
            elif layout == "start":  # the adapters as the run starts them: a step of learning rate 1e-30
                assert rapidlite_here(*argv(assets, *VARIANTS[variant], lr="1e-30"), "--save", str(save)) == 0
            else:
                two = ["--nproc-per-node", "2", "--micro-batch-size", "4", "--zero-3-memory-optimization"]
                proc = rapidlite(*argv(assets, *VARIANTS[variant]), *two, "--save", str(save))
                assert proc.returncode == 0, proc.stderr[-3000:]
            done[variant, layout] = save
        return done[variant, layout]

    return get


PROBE = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_variants_step_equals_peft_by_hand(assets, runs, variant):
    from transformers import AutoModelForCausalLM

    mutating = variant in lora.MUTATING_INITS
    reference = by_hand(assets, variant, None if mutating else runs(variant, "start") / "hf" / "adapter")
    run = runs(variant)
    with torch.no_grad():
        want = reference(PROBE).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
        torch.testing.assert_close(merged(PROBE).logits, want, rtol=1e-4, atol=1e-4)
        # The exported adapter on the original base (PiSSA and OLoRA's converted to a plain LoRA of rank 8).
        adapted = peft.PeftModel.from_pretrained(lora_base(assets), str(run / "hf" / "adapter")).eval()
        torch.testing.assert_close(adapted(PROBE).logits, want, rtol=1e-4, atol=1e-4)
        assert (want - lora_base(assets)(PROBE).logits).abs().max() > 1e-3  # the step moved the model
    config = adapted.peft_config["default"]
    assert config.r == (8 if mutating else 4) and config.use_dora == (variant == "dora")
    assert config.use_rslora == (variant == "rslora")
    if not mutating:  # the adapters themselves, tensor by tensor
        got = load_file(run / "hf" / "adapter" / "adapter_model.safetensors")
        want_state = peft.get_peft_model_state_dict(reference)
        assert got.keys() == want_state.keys()
        for name, value in want_state.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["dora", "loraplus", "pissa"])
def test_zero3_on_two_ranks_equals_one_process(runs, variant):
    one, two = runs(variant), runs(variant, "zero3")
    for path in ("hf/model.safetensors", "hf/adapter/adapter_model.safetensors"):
        want, got = load_file(one / path), load_file(two / path)
        # ZeRO-3's gathered export also writes the output layer tied to the embedding, which one process drops.
        assert want.keys() <= got.keys() and set(got) - set(want) <= {"lm_head.weight"}
        for name, value in want.items():
            torch.testing.assert_close(got[name].float(), value.float(), rtol=1e-4, atol=1e-5, msg=name)


def test_variant_flags_need_a_rank_and_sane_values(assets, capsys):
    from rapidlite.cli.main import main

    cases = [
        (["--use-dora"], "--use-dora configures LoRA adapters: add --lora-rank"),
        (["--loraplus-lr-ratio", "0", "--lora-rank", "4"], "--loraplus-lr-ratio 0: must be positive"),
        (["--lora-init", "pissa", "--lora-rank", "4", "--load-in-4bit"], "--lora-init pissa rewrites the base"),
    ]
    model_dir, data_dir = assets
    for flags, message in cases:
        base = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir)]
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
