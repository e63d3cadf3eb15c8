"""The DeepSpeed backend on 2 processes (gloo, DeepSpeed's CPU accelerator), compared with one process
without DeepSpeed. Skipped when the ``[deepspeed]`` extra is not installed. No DeepSpeed op is compiled: the
shared-memory all-reduce its torch backend would build is for inference alone."""

import json

import pytest
import torch

from helpers import DP_COMMON as COMMON
from helpers import DP_ONE as ONE
from helpers import DP_TWO as TWO
from helpers import PRETRAIN, REPO, assert_close_lists, rapidlite, read_metrics, stopped_copy, train_losses
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.checkpoint.integrity import verify_checkpoint

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]

ZERO3_OFFLOAD_JSON = str(REPO / "examples" / "deepspeed_zero3_offload.json")
LAYOUTS = {
    "single": ONE,  # the reference: one process, no DeepSpeed
    "ds_zero1": TWO + ["--deepspeed", "--zero-1-memory-optimization"],
    "ds_zero2": TWO + ["--deepspeed", "--zero-2-memory-optimization"],
    "ds_zero3": TWO + ["--deepspeed", "--zero-3-memory-optimization"],
    "ds_zero3_offload_json": TWO + ["--deepspeed-config", ZERO3_OFFLOAD_JSON],
    # One process, as on a single GPU: no launcher sets LOCAL_RANK, which DeepSpeed asserts on.
    "ds_zero3_offload_one_process": ONE + ["--deepspeed-config", ZERO3_OFFLOAD_JSON],
}


def train(save, layout, *extra):
    proc = rapidlite("--user-script", PRETRAIN, *COMMON, *LAYOUTS[layout], *extra, "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout trained once for 6 iterations, with a checkpoint at 3 and 6."""
    root = tmp_path_factory.mktemp("deepspeed")
    done = {}

    def get(name):
        if name not in done:
            proc = train(root / name, name, "--train-iters", "6", "--save-interval", "3")
            done[name] = (root / name, proc)
        return done[name][0]

    get.output = lambda name: done[name][1]
    return get


@pytest.mark.parametrize(
    "layout", ["ds_zero1", "ds_zero2", "ds_zero3", "ds_zero3_offload_json", "ds_zero3_offload_one_process"]
)
def test_deepspeed_trains_like_one_process(runs, layout):
    reference, run = runs("single"), runs(layout)
    assert len(train_losses(run)) == 6
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)
    expected = read_model_tensors(reference / "iter_0000006")
    actual = read_model_tensors(run / "iter_0000006")  # DeepSpeed's partitions consolidated by zero_to_fp32
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


def test_config_file_is_applied_and_reported(runs):
    """The seeds-style ZeRO-3 + offload file: its stage and offload are used, its optimizer/scheduler
    sections are replaced by the flags' (with a notice), and parameters and optimizer state are sharded."""
    run = runs("ds_zero3_offload_json")
    (record,) = [r for r in read_metrics(run) if r.get("split") == "model_state"]
    assert record["strategy"] == "DeepSpeed ZeRO-3 + CPU offload"
    output = runs.output("ds_zero3_offload_json")
    assert "'optimizer' and 'scheduler' left out" in output.stdout + output.stderr
    (zero1,) = [r for r in read_metrics(runs("ds_zero1")) if r.get("split") == "model_state"]
    full = zero1["param_bytes"]  # ZeRO-1 keeps whole fp32 parameters on every rank
    # On 2 ranks: AdamW's two moments over half the parameters (the bytes of all parameters) and the fp32 master
    # copy of that half, which DeepSpeed steps even when the model trains in fp32.
    assert zero1["optimizer_bytes"] == pytest.approx(1.5 * full, rel=0.1)
    assert record["param_bytes"] == pytest.approx(full / 2, rel=0.1)
    assert record["optimizer_bytes"] == pytest.approx(1.5 * full, rel=0.1)


def test_flags_win_over_the_file_with_a_notice(runs, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.25, "zero_optimization": {"stage": 2}})
    )
    # The micro batch comes from the file (the flag is not given); --clip-grad is given and wins.
    argv = ["--nproc-per-node", "2"]
    proc = rapidlite(
        "--user-script", PRETRAIN, *COMMON, *argv, "--deepspeed-config", str(config), "--clip-grad", "1.0",
        "--train-iters", "6", "--save", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{config}: gradient_clipping 0.25 replaced by --clip-grad 1.0" in proc.stdout + proc.stderr
    assert_close_lists(train_losses(tmp_path / "run"), train_losses(runs("single")), rtol=1e-5)
    (record,) = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "model_state"]
    assert record["strategy"] == "DeepSpeed ZeRO-2"


def test_resume_under_deepspeed_is_bit_exact(runs, tmp_path):
    save = stopped_copy(runs("ds_zero2"), tmp_path / "resumed", 3)
    train(save, "ds_zero2", "--train-iters", "6", "--load", str(save))
    assert train_losses(save) == train_losses(runs("ds_zero2"))
    for k, v in read_model_tensors(runs("ds_zero2") / "iter_0000006").items():
        assert torch.equal(v, read_model_tensors(save / "iter_0000006")[k]), k
    # DeepSpeed's files are in the manifest (each rank hashed its own partition) and verify
    files = json.loads((save / "iter_0000006" / "manifest.json").read_text())["files"]
    assert {n for n in files if "zero_pp_rank_" in n} == {
        f"deepspeed/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    }, files
    assert verify_checkpoint(save / "iter_0000006") is None


@pytest.mark.parametrize("first,then", [("ds_zero2", "single"), ("single", "ds_zero3")])
def test_weights_cross_backends(runs, tmp_path, first, then):
    """A checkpoint of one backend resumes under the other from its weights and schedule; the optimizer
    state does not carry over, so that needs --no-load-optim, and without it the error says so."""
    source = stopped_copy(runs(first), tmp_path / "source", 3)
    target = tmp_path / "target"
    refused = rapidlite(
        "--user-script", PRETRAIN, *COMMON, *LAYOUTS[then], "--train-iters", "6", "--load", str(source),
        "--save", str(target),
    )  # fmt: skip
    assert refused.returncode == 2
    assert "add --no-load-optim" in refused.stderr and "Traceback" not in refused.stderr
    train(target, then, "--train-iters", "6", "--load", str(source), "--no-load-optim")
    resumed = train_losses(target)
    assert len(resumed) == 3
    # Iteration 4's loss is computed with the weights of iteration 3, before any update.
    assert resumed[0] == pytest.approx(train_losses(runs("single"))[3], rel=1e-5)


def test_black_box_zero3_exports_the_trained_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    save, ops = tmp_path / "run", tmp_path / "torch_extensions"
    proc = rapidlite(
        "--task", "sequence_classification", "--demo", "--train-iters", "4", "--nproc-per-node", "2",
        "--deepspeed", "--zero-3-memory-optimization", "--save", str(save), env={"TORCH_EXTENSIONS_DIR": str(ops)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not ops.exists()  # DeepSpeed compiled nothing (its shared-memory op took a minute of g++)
    exported = AutoModelForSequenceClassification.from_pretrained(save / "hf").state_dict()
    trained = read_model_tensors(next(save.glob("iter_*")))
    for k, v in trained.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_planned_zero_states_are_the_engines(stage):
    """--dry-run's DeepSpeed rules (rapidlite.planning.deepspeed) against the engine's own buffers after a step:
    the parameters a rank holds (ZeRO-3: partitions, and whole tensors under the persistence threshold) and the
    fp32 master partition it steps."""
    import subprocess
    import sys

    script = REPO / "tests" / "scripts" / "deepspeed_states.py"
    argv = ["--nproc-per-node", "2", "--deepspeed", f"--zero-{stage}-memory-optimization", "--micro-batch-size", "2"]
    argv += ["--global-batch-size", "4", "--train-iters", "1"]
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    for name, (planned, engine) in pairs.items():
        assert planned == engine, (name, planned, engine)
    assert pairs["master"][0] == 4 * pairs["stepped"][0] > 0
