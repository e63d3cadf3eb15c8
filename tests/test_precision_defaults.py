"""Defaults that are right on every machine: mixed precision by what the CPU runs fast, TF32 on Ampere+ GPUs,
a warmup longer than the run caught before anything loads (or, when the length comes from the data, clamped)."""

from __future__ import annotations

import pytest
import torch

from helpers import ToyFinetuner, engine
from rapidlite import precision
from rapidlite.models.flops import device_peak_flops
from rapidlite.resolve import parse_args


@pytest.fixture
def cpu_kind(monkeypatch):
    """Pretend to be a CPU with (True) or without (False) a bf16 fast path."""

    def set_kind(fast: bool) -> None:
        monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: fast)

    return set_kind


def test_mixed_precision_on_a_cpu_without_bf16_fast_path_trains_fp32_and_says_so(cpu_kind, log_lines):
    cpu = torch.device("cpu")
    cpu_kind(False)
    policy, notice = precision.resolve_precision("auto", cpu)
    assert policy.name == "fp32" and "no bf16 fast path" in notice and "--bf16 forces" in notice
    policy, notice = precision.resolve_precision("bf16", cpu)  # explicit: obeyed, with a warning
    assert policy.name == "bf16" and "slower than fp32" in notice
    eng = engine("--mixed-precision")
    assert eng.precision.name == "fp32"
    assert any("no bf16 fast path" in line for line in log_lines)

    cpu_kind(True)
    assert precision.resolve_precision("auto", cpu) == (precision.Precision(torch.bfloat16, "cpu"), None)
    assert precision.resolve_precision("bf16", cpu)[1] is None
    assert precision.resolve_precision("fp32", cpu) == (precision.Precision(None, "cpu"), None)


def test_bf16_fast_path_is_read_from_the_instruction_sets_on_x86(monkeypatch):
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx, fast in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        precision.cpu_bf16_is_fast.cache_clear()
        assert precision.cpu_bf16_is_fast() is fast
    precision.cpu_bf16_is_fast.cache_clear()


def test_bf16_fast_path_elsewhere_is_measured(monkeypatch):
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for bf16_seconds, fast in ((0.001, True), (0.009, False), (0.04, False)):
        seconds = {torch.bfloat16: bf16_seconds, torch.float32: 0.01}
        monkeypatch.setattr(precision, "_probe_matmul_seconds", lambda dtype, s=seconds: s[dtype])
        precision.cpu_bf16_is_fast.cache_clear()
        assert precision.cpu_bf16_is_fast() is fast
    precision.cpu_bf16_is_fast.cache_clear()


@pytest.fixture
def restore_tf32():
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    yield
    matmul.fp32_precision, conv.fp32_precision = saved


def test_tf32_defaults_on_for_ampere_and_newer(monkeypatch, restore_tf32):
    cuda = torch.device("cuda", 0)
    assert precision.set_tf32(None, torch.device("cpu")) is None  # no TF32 off CUDA
    for capability, requested, expected in (
        ((8, 0), None, True),
        ((9, 0), None, True),
        ((7, 0), None, False),
        ((8, 0), False, False),
        ((7, 5), True, True),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert precision.set_tf32(requested, cuda) is expected
        assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if expected else "ieee")
    assert parse_args(["--no-tf32"], require_task=False).tf32 is False
    assert parse_args([], require_task=False).tf32 is None


def test_mfu_peak_follows_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    assert device_peak_flops(cuda, None, tf32=True) == 156e12
    assert device_peak_flops(cuda, None, tf32=False) == 19.5e12
    assert device_peak_flops(cuda, torch.bfloat16, tf32=True) == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert device_peak_flops(cuda, None, tf32=True) == 15.7e12  # no TF32 cores: the fp32 peak


def test_warmup_longer_than_a_known_run_is_clamped_before_anything_loads():
    args = parse_args(["--task", "pretraining", "--train-iters", "9", "--lr-warmup-iters", "100"])
    assert args.lr_warmup_iters == 9 and "--lr-warmup-iters 100 is longer than --train-iters 9" in args.notices[0]
    args = parse_args(["--train-iters", "90", "--lr-decay-iters", "50", "--lr-warmup-iters", "60"], require_task=False)
    assert args.lr_warmup_iters == 50 and "longer than --lr-decay-iters 50" in args.notices[0]
    for argv in (["--lr-decay-style", "constant"], []):  # nothing to decay, or no longer than the run
        args = parse_args(
            ["--train-iters", "9", "--lr-warmup-iters", "100" if argv else "9", *argv], require_task=False
        )
        assert args.notices == []


def test_warmup_longer_than_an_epoch_based_run_is_clamped_with_a_notice(log_lines):
    # 64 samples, micro batch 16, 2 epochs: 8 iterations, known only once the data is loaded.
    trainer = ToyFinetuner(engine("--micro-batch-size", "16", "--epochs", "2", "--lr-warmup-iters", "100"))
    trainer.train()
    assert trainer.iteration == 8
    assert any("--lr-warmup-iters 100 is longer than the run's 8 iterations" in line for line in log_lines)
    assert trainer.lr_scheduler.warmup_steps == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.args.lr)  # the peak, at the end
