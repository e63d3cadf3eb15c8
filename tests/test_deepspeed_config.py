"""How a DeepSpeed config file and the flags combine (torch-free, no DeepSpeed needed), and the errors."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, run_cli
from rapidlite.errors import ConfigError
from rapidlite.parallel.deepspeed_config import build_config
from rapidlite.resolve import parse_args

BASE = ["--task", "sequence_classification", "--demo"]


def write(tmp_path, config):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(path)


def test_file_fills_what_the_flags_leave_open(tmp_path):
    path = write(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
            "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        },
    )
    args = parse_args(BASE + ["--deepspeed-config", path])
    assert args.deepspeed and args.micro_batch_size == 4 and args.gradient_accumulation_steps == 3
    assert args.global_batch_size == 12 and args.clip_grad == 0.5 and args.precision == "bf16"
    assert args.zero_3_memory_optimization and args.cpu_offload
    config = build_config(args.sections, "bf16", 3, True)
    assert config["train_batch_size"] == 12 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "reduce_bucket_size" not in config["zero_optimization"]  # "auto": DeepSpeed's default
    assert "optimizer" not in config  # the flags own the optimizer
    assert [n for n in args.deepspeed_notices if "'optimizer' left out" in n]


def test_flags_given_win_with_a_notice(tmp_path):
    path = write(
        tmp_path,
        {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 64, "zero_optimization": {"stage": 1}},
    )
    args = parse_args(
        BASE
        + ["--deepspeed-config", path, "--micro-batch-size", "2", "--global-batch-size", "8"]
        + ["--zero-2-memory-optimization", "--fp16", "--loss-scale-window", "50"]
    )
    assert args.micro_batch_size == 2 and args.global_batch_size == 8 and args.gradient_accumulation_steps == 4
    assert f"{path}: train_micro_batch_size_per_gpu 4 replaced by --micro-batch-size 2" in args.deepspeed_notices
    assert f"{path}: train_batch_size 64 replaced by --global-batch-size 8" in args.deepspeed_notices
    assert f"{path}: zero_optimization.stage 1 replaced by --zero-2-memory-optimization" in args.deepspeed_notices
    config = build_config(args.sections, "fp16", 2, False)
    assert config["zero_optimization"]["stage"] == 2
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 50,
        "hysteresis": 2,
        "min_loss_scale": 1.0,
    }
    assert config["gradient_accumulation_steps"] == 4 and config["train_batch_size"] == 8


def test_plain_deepspeed_flag_maps_every_setting():
    args = parse_args(BASE + ["--deepspeed", "--zero-1-memory-optimization", "--clip-grad", "0"])
    config = build_config(args.sections, "fp32", 1, False)
    assert config["zero_optimization"] == {"stage": 1} and config["gradient_clipping"] == 0.0
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["zero_allow_untested_optimizer"] and not config["zero_force_ds_cpu_optimizer"]


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "file not found"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"train_micro_batch_size_per_gpu": 0}', "must be a positive integer"),
        ('{"zero_optimization": {"stage": 4}}', "must be 0, 1, 2 or 3"),
    ],
)
def test_bad_config_file_is_one_line(tmp_path, content, message):
    path = str(tmp_path / "missing.json") if content is None else write(tmp_path, content)
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + ["--deepspeed-config", path])
    proc = run_cli(*BASE, "--deepspeed-config", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--deepspeed", "--fsdp-memory-optimization"], "use --zero-3-memory-optimization"),
        (["--deepspeed", "--no-save-optim"], "drop the flag under --deepspeed"),
    ],
)
def test_contradictions_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + flags)


def test_missing_deepspeed_names_the_extra(tmp_path):
    """Where DeepSpeed is not importable, --deepspeed fails with one line naming the extra to install."""
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'deepspeed'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"}
    script = str(REPO / "examples" / "pretrain_custom_model.py")
    proc = subprocess.run(
        [sys.executable, "-m", "rapidlite", "--user-script", script, "--train-iters", "1", "--deepspeed"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install 'rapidlite[deepspeed]'" in proc.stderr and "Traceback" not in proc.stderr
