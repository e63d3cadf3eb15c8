"""The export of a DeepSpeed bf16 run holds the fp32 master weights of what was trained, as the other
backends' exports and DeepSpeed's own checkpoint do, not the module's copies rounded to 16 bits."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import rapidlite
from rapidlite.checkpoint import read_model_tensors
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
