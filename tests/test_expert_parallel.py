"""Expert parallelism (``--expert-model-parallel-size``, ``rapidlite.parallel.expert_parallel``) and pipeline
parallelism of the built-in MoE GPT: EP2 on 2 ranks, EP2 with ZeRO-1 (the experts stepped apart from
ZeroRedundancyOptimizer) and with ZeRO-3, EP2 x DP2, PP2 on 2 ranks and PP2 x EP2 with ZeRO-3 on 4 train as one
process (losses, gradient norms, router losses, loads: each stage's router loss reaches its gradients, the metrics
are the whole model's, the expert bias moves by its own stage's load), a checkpoint of EP2 resumes on one process,
on EP2 with ZeRO-1, on EP2 x DP2 and on PP2 continuing the same curve, and the export gathers the experts;
Qwen3-MoE's EP2 and EP2 x DP2 with ZeRO-3 train as one process; what is not built is one line."""

import pytest
import torch
from test_moe import args, build_assets
from test_moe_gpt import FLAGS

from helpers import (
    assert_same_metrics,
    layout_runs,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    stopped_copy,
    write_tiny_corpus,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# A router loss weight of 0.1 (its share of the gradients shows), a sample per micro-batch (the router loss is each
# micro-batch's: one process and N ranks then see the same micro-batches) and the expert bias on (moved by the
# load summed over the ranks).
RUN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--eval-interval", "2", "--moe-aux-loss-coeff", "0.1"]
RUN += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
EP2 = ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"]
LAYOUTS = {
    "single": [],
    "ep2": EP2,
    "ep2_zero3": [*EP2, "--zero-3-memory-optimization", "--moe-grouped-gemm"],
    "ep2_dp2_zero2": ["--nproc-per-node", "4", "--expert-model-parallel-size", "2", "--zero-2-memory-optimization"],
    "ep2_zero1": [*EP2, "--zero-1-memory-optimization"],
    "pp2": ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
    "pp2_ep2_zero3": [
        "--nproc-per-node", "4", "--pipeline-model-parallel-size", "2", *EP2[2:], "--zero-3-memory-optimization",
        "--moe-grouped-gemm", "--checkpoint-activations",
    ],
}  # fmt: skip
KEYS = ["loss", "grad_norm", "moe_aux_loss", "moe/load_max_over_mean"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny_corpus(prefix)
    return str(prefix)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    return layout_runs(tmp_path_factory.mktemp("runs"), [*FLAGS, "--data-path", corpus, *RUN], LAYOUTS)


@pytest.mark.parametrize("layout", ["ep2", "ep2_zero1", "ep2_zero3", "ep2_dp2_zero2", "pp2", "pp2_ep2_zero3"])
def test_expert_parallel_trains_as_one_process(runs, layout):
    keys = (
        KEYS
        if not layout.startswith("pp")
        else [*KEYS, "moe/layer_0/load_max_over_mean", "moe/layer_1/load_max_over_mean"]
    )
    assert_same_metrics(runs(layout), runs("single"), keys, rel=1e-5, at_least=20)


def test_the_experts_are_split_and_the_export_gathers_them(runs):
    from safetensors import safe_open

    from rapidlite.models.gpt import GPTModel

    whole = runs("single") / "iter_0000006"
    split = runs("ep2") / "iter_0000006"
    assert sorted(p.name for p in split.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (split / "__0_0.distcp").stat().st_size < 0.9 * (whole / "__0_0.distcp").stat().st_size
    # With the expert bias the export is rapidlite's format (Mixtral has none; test_moe_gpt checks Mixtral's).
    with safe_open(str(runs("ep2") / "hf" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.mlp.experts.gate_up_proj").shape[0] == 4  # every expert
    ids = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ours = GPTModel.from_pretrained(runs("ep2") / "hf").eval()(ids)
        reference = GPTModel.from_pretrained(runs("single") / "hf").eval()(ids)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_zero1_shards_the_shared_weights_state_and_keeps_each_ranks_experts(runs):
    """EP2 with ZeRO-1 against EP2 with DDP, on the same 2 ranks (measured): the optimizer state of the weights both
    ranks hold is split between them, that of the rank's own experts is whole there."""

    def state(layout):
        return next(r for r in read_metrics(runs(layout)) if r.get("split") == "model_state")

    ddp, zero1 = state("ep2"), state("ep2_zero1")
    experts = 2 * 2 * (48 * 32 + 32 * 24)  # 2 layers x this rank's 2 experts x (gate_up + down), in elements
    shared_state = ddp["optimizer_bytes"] - 8 * experts  # AdamW: two fp32 moments (and step counts)
    assert 8 * experts < zero1["optimizer_bytes"] <= ddp["optimizer_bytes"] - 0.3 * shared_state, (ddp, zero1)


@pytest.mark.parametrize("then", ["single", "ep2_zero1", "ep2_dp2_zero2", "pp2"])
def test_a_checkpoint_of_ep2_resumes_on_another_layout(runs, corpus, tmp_path, then):
    """EP2's checkpoint of iteration 3 resumed on one process and on EP2 x DP2 (ZeRO-2): iterations 4-6 are
    those of the uninterrupted run."""
    save = stopped_copy(runs("ep2"), tmp_path / "resumed", 3)
    argv = [*FLAGS, "--data-path", corpus, *RUN, *LAYOUTS[then], "--train-iters", "6", "--save-interval", "3"]
    run = rapidlite if LAYOUTS[then] else rapidlite_captured
    proc = run(*argv, "--load", str(save), "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert_same_metrics(save, runs("ep2"), KEYS, rel=1e-5, at_least=20)


BAD = {
    "experts not divisible": (
        ["--nproc-per-node", "4", "--expert-model-parallel-size", "4", "--num-experts", "6"],
        "--expert-model-parallel-size 4 does not divide the 6 experts of each layer (--num-experts)",
    ),
    "ep not dividing dp": (
        ["--nproc-per-node", "3", "--expert-model-parallel-size", "2", "--global-batch-size", "6"],
        "--expert-model-parallel-size 2 does not divide the 3 data-parallel ranks",
    ),
    "DeepSpeed": ([*EP2, "--deepspeed"], "--expert-model-parallel-size 2: DeepSpeed's engine does not split"),
    "a dense model": (
        [*EP2, "--num-experts", None, "--moe-ffn-hidden-size", None],
        "--expert-model-parallel-size 2: the built-in GPT is dense (no experts to split); add --num-experts N",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_is_not_built_is_one_line(corpus, case):
    extra, message = BAD[case]
    argv = [*FLAGS, "--data-path", corpus, "--train-iters", "1", "--micro-batch-size", "1"]
    for drop in [extra[i - 1] for i, a in enumerate(extra) if a is None]:  # a flag followed by None: left out
        i = argv.index(drop)
        argv, extra = argv[:i] + argv[i + 2 :], [a for a in extra if a not in (drop, None)]
    proc = rapidlite_captured(*argv, *extra)  # refused before any process starts
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------ a Hugging Face family
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("moe"))


HF_RUN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--moe-aux-loss-coeff", "0.1", "--train-iters", "3"]


@pytest.mark.parametrize(
    "layout",
    [EP2, ["--nproc-per-node", "4", "--expert-model-parallel-size", "2", "--zero-3-memory-optimization"]],
    ids=["ep2", "ep2_dp2_zero3"],
)
def test_a_hugging_face_moe_trains_as_one_process(assets, tmp_path, layout):
    """Qwen3-MoE's experts split over 2 ranks (its experts module's forward routed through the all-to-all)."""
    one = tmp_path / "one"
    proc = rapidlite_captured(*args(assets, "qwen3_moe", *HF_RUN, "--save", str(one)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = tmp_path / "split"
    proc = rapidlite(*args(assets, "qwen3_moe", *HF_RUN, *layout, "--save", str(split)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "expert parallel 2" in proc.stdout
    assert_same_metrics(split, one, ["loss", "grad_norm", "moe_aux_loss", "moe/load_max_over_mean"], 1e-5, 4)


def test_lora_on_split_experts_is_one_line(assets):
    proc = rapidlite(*args(assets, "qwen3_moe", *HF_RUN, *EP2, "--lora-rank", "4"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--expert-model-parallel-size 2 with LoRA on the experts: not built" in proc.stderr
