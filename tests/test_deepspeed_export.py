"""DeepSpeed across layouts: the export of a bf16 run holds the fp32 master weights of what was trained (as the
other backends' exports and DeepSpeed's own checkpoint do), and a ZeRO checkpoint resumes on another number of
ranks from its weights or refuses in one line."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import rapidlite, read_metrics
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.tasks.causal_lm_demo import write_demo_assets

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


@pytest.mark.parametrize("stage", ["2", "3"])
def test_bf16_lora_adapter_is_exported_from_the_fp32_master_weights(tmp_path, stage):
    model_dir, data_dir = write_demo_assets(tmp_path / "assets", seed=5, num_train=24, num_validation=8)
    save = tmp_path / "run"
    proc = rapidlite(
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "64",
        "--epochs", "1", "--bf16", "--lora-rank", "4", "--deepspeed", f"--zero-{stage}-memory-optimization",
        "--save", str(save),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = load_file(save / "hf" / "adapter" / "adapter_model.safetensors")
    trained = read_model_tensors(next(save.glob("iter_*")))  # DeepSpeed's fp32 partitions, consolidated
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}
    for name, value in adapter.items():
        assert torch.equal(value, trained[name.replace(".weight", ".default.weight")]), name


def _lora_run(model_dir, data_dir, save, *extra):
    return rapidlite(
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "64",
        "--log-interval", "1", "--bf16", "--lora-rank", "4", "--deepspeed", "--zero-2-memory-optimization",
        "--save", str(save), *extra,
    )  # fmt: skip


@pytest.mark.distributed
def test_a_two_rank_zero_checkpoint_resumes_on_one_rank_with_its_weights_or_refuses_in_one_line(tmp_path):
    """DeepSpeed cannot repartition ZeRO's optimizer state over another number of ranks (a traceback deep in
    its load_checkpoint): the resume says so up front, and --no-load-optim continues from the weights."""
    model_dir, data_dir = write_demo_assets(tmp_path / "assets", seed=5, num_train=24, num_validation=8)
    first = _lora_run(model_dir, data_dir, tmp_path / "two", "--epochs", "1", "--nproc-per-node", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    refused = _lora_run(model_dir, data_dir, tmp_path / "one", "--epochs", "2", "--load", str(tmp_path / "two"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and "partitioned over 2 data-parallel ranks" in refused.stderr
    assert "--no-load-optim" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "one").exists()
    resumed = _lora_run(
        model_dir, data_dir, tmp_path / "one", "--epochs", "2", "--load", str(tmp_path / "two"), "--no-load-optim"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert [r["iteration"] for r in read_metrics(tmp_path / "one") if "split" not in r][0] == 4
