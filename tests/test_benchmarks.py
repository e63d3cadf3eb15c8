"""The benchmark scripts run (quick mode: a few steps of a tiny model; nothing is asserted about speed; one
thread per process, as the tests run everything)."""

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO


def run_quick(script: str, *extra: str, timeout: float, env: dict[str, str] | None = None):
    """``benchmarks/SCRIPT --quick EXTRA``, offline, which must succeed (its output in the failure message)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc


@pytest.mark.distributed
def test_data_parallel_benchmark_quick():
    proc = run_quick("data_parallel.py", timeout=600)
    rows = [line.split()[0] for line in proc.stdout.splitlines()[1:6]]
    assert rows == ["1", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"], proc.stdout


@pytest.mark.slow
def test_data_pipeline_benchmark_quick():
    proc = run_quick("data_pipeline.py", timeout=300, env={"OMP_NUM_THREADS": "1"})
    rows = [" ".join(line.split()[:2]) for line in proc.stdout.splitlines()]
    for row in ("preprocess workers=1", "preprocess workers=2", "read HF", "read mmap", "train step", "fetch in"):
        assert row in rows, proc.stdout
    assert "check preprocess outputs byte-identical (workers 1 and 2): ok" in proc.stdout
    assert "check mmap and datasets samples identical: ok" in proc.stdout
    for target in ("preprocess workers 2 vs 1: x", "mmap vs datasets read: x", "data path: "):
        assert any(line.startswith(target) for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.distributed
def test_model_parallel_benchmark_quick():
    proc = run_quick("model_parallel.py", timeout=600)
    lines = proc.stdout.splitlines()
    labels = ["1 rank", "tp2"]
    rows = [line[:18].strip() for line in lines[1:3]]
    assert rows == labels, proc.stdout
    assert any(line.startswith("check per-iteration losses") and line.endswith(": ok") for line in lines), proc.stdout
    assert any(line.startswith("tp2 parameter bytes per rank: ") for line in lines), proc.stdout
    assert any(line.startswith("pp2 interleaved m=4 ") for line in lines), proc.stdout  # the pipeline table


@pytest.mark.slow
def test_speed_benchmark_quick():
    """Nine contenders interleaved step by step (in two processes: --quick groups them); the loss curves agree
    before any speed is printed; the table and every target line are there (met or not: nothing is asserted on
    speed)."""
    proc = run_quick("speed.py", "--threads", "1", timeout=900)
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if "max relative loss difference" in line]
    assert len(checks) == 10 and all(line.endswith(": ok") for line in checks), proc.stdout
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "contender" not in line]
    assert rows == [
        "plain loop",
        "HF Trainer",
        "rapidlite",
        "rapidlite --torch-compile",
        "rapidlite --checkpoint-activations",
        "plain loop bf16 autocast",
        "rapidlite --mixed-precision",
        "rapidlite --torch-compile --mixed-precision",
        "plain loop, again (noise floor)",
    ], proc.stdout
    for target in (
        "rapidlite vs plain loop",
        "rapidlite MFU / measured fp32 matmul peak",
        "rapidlite vs HF Trainer",
        "rapidlite --torch-compile vs plain loop",
        "rapidlite --mixed-precision vs fp32 plain loop",
        "--checkpoint-activations extra time",
        "--checkpoint-activations memory cut",
    ):
        assert any(line.startswith(target + ": ") for line in lines), (target, proc.stdout)


def test_peak_benchmark_quick():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peak", "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[1].split() == ["precision", "GFLOP/s", "at", "size"]
    assert "pass --peak-flops" in proc.stdout


@pytest.mark.slow
def test_packing_benchmark_quick():
    """Packed, padded and the Trainer's padded batches train the same per-token loss curve (checked before any
    speed is printed); the table and the ratio lines are there (nothing is asserted on speed)."""
    proc = run_quick("packing.py", timeout=600)
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if line.startswith("check loss ") and " vs " in line]
    assert len(checks) == 3 and all(line.endswith(": ok") for line in checks), proc.stdout
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "contender" not in line]
    assert rows == ["rapidlite --packing", "rapidlite padded", "HF Trainer"], proc.stdout
    for ratio in ("packing vs padded useful tokens/s: x", "packing vs HF Trainer useful tokens/s: x"):
        assert any(line.startswith(ratio) for line in lines), proc.stdout


@pytest.mark.slow
def test_step_time_benchmark_quick():
    """A torchtitan row, a Megatron-LM row and the mixture-of-experts row planned from their published set-ups
    and predicted (the calibration row lands on its published figure by construction; the MoE row, counted as
    Megatron counts its FLOPs, within 25%)."""
    proc = run_quick("step_time.py", "--calibrate", timeout=300)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| torchtitan") or line.startswith("| Meg")]
    assert len(rows) == 3, proc.stdout
    calibration = rows[0].split("|")
    assert "(calibration row)" in calibration[2] and float(calibration[5]) == pytest.approx(1.0, abs=0.02)
    assert "calibration: matched at matmul_efficiency" in proc.stdout
    assert float(rows[1].split("|")[5]) > 0
    assert "Mixtral 8x7B" in rows[2] and abs(float(rows[2].split("|")[5]) - 1) <= 0.25


@pytest.mark.slow
@pytest.mark.distributed
def test_dry_run_sweep_quick():
    """Small configurations drawn at random (task, shape, layout, options), each planned and then trained, and
    (``--heap-check``) trained again with glibc's mmap threshold at 64 KiB: a row each with both ratios, and the
    distributions; a run that fails (not a one-line refusal) fails the script. The targets are the full sweep's
    (docs/guides/dry-run.md)."""
    proc = run_quick("dry_run_sweep.py", "--configs", "3", "--heap-check", timeout=900)
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3, proc.stdout
    assert all(0.5 < float(row[6]) < 2 and 0.5 < float(row[8]) < 2 for row in rows), proc.stdout
    assert "3 configurations:" in proc.stdout and "with a 64 KiB threshold:" in proc.stdout
    assert re.search(r"^glibc (\d+\.\d+|not in use): 3 configurations", proc.stdout, re.M), proc.stdout


def test_cpu_allocator_quick():
    """One small run with glibc's dynamic threshold, one with rapidlite's fixed one and one at 64 KiB: a row with
    each's step time and peak and their ratios to glibc's (nothing is asserted on speed)."""
    proc = run_quick("cpu_allocator.py", timeout=600)
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| pretraining")]
    assert len(rows) == 1, proc.stdout
    step_ratios, peak_ratios = [float(rows[0][i]) for i in (4, 6)], [float(rows[0][i]) for i in (9, 11)]
    assert all(r > 0 for r in step_ratios) and all(0.3 < r < 1.5 for r in peak_ratios), proc.stdout


def test_checkpoint_hashing_benchmark_quick():
    proc = run_quick("checkpoint_hashing.py", timeout=300)
    for row in ("save without hashing", "save with manifest", "hashing overhead", "verify on load"):
        assert row in proc.stdout, proc.stdout


def test_lora_benchmark_quick():
    """The LoRA contenders start from the same adapters and the plain peft loop, the Trainer and rapidlite
    train the same loss curve (checked before any speed is printed); the tables and ratio lines are there
    (nothing is asserted on speed)."""
    proc = run_quick("lora.py", "--threads", "1", timeout=600)
    lines = proc.stdout.splitlines()
    adapters = [line for line in lines if line.startswith("check adapters before step 1")]
    assert len(adapters) >= 6 and all(line.endswith(": ok") for line in adapters), proc.stdout
    losses = [line for line in lines if line.startswith("check loss ")]
    assert len(losses) == 3 and all(line.endswith(": ok") for line in losses), proc.stdout
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ")]
    for row in (
        "plain peft loop",
        "HF Trainer + peft",
        "rapidlite",
        "rapidlite --load-in-4bit",
        "rapidlite --load-in-8bit",
        "rapidlite full fine-tuning",
        "fp32",
        "bf16",
        "nf4",
        "nf4 double quant",
        "int8",
    ):
        assert row in rows, (row, proc.stdout)
    for ratio in ("rapidlite vs plain peft loop tokens/s: x", "rapidlite vs HF Trainer + peft tokens/s: x"):
        assert any(line.startswith(ratio) for line in lines), proc.stdout


@pytest.mark.slow
def test_padding_benchmark_quick():
    """--padding-free trains the losses of the same grouped batches padded (checked before any speed is printed);
    both workloads' tables and ratio lines are there (nothing is asserted on speed)."""
    proc = run_quick("padding.py", timeout=300, env={"OMP_NUM_THREADS": "1"})
    lines = proc.stdout.splitlines()
    checks = [line for line in lines if line.startswith("check loss --padding-free vs padded")]
    assert len(checks) == 4 and all(line.endswith(": ok") for line in checks), proc.stdout
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "contender" not in line]
    labels = [
        "HF Trainer",
        "HF Trainer group_by_length",
        "rapidlite",
        "rapidlite --group-by-length",
        "rapidlite --group-by-length --padding-free",
        "rapidlite --padding-free",
    ]
    assert rows == labels * 2, proc.stdout
    for workload in ("cls", "tok"):
        for ratio in ("--group-by-length vs HF Trainer useful tokens/s: x", "--padding-free vs HF Trainer useful"):
            assert any(line.startswith(f"{workload}: rapidlite") and ratio in line for line in lines), proc.stdout


@pytest.mark.distributed
def test_preference_benchmark_quick():
    proc = run_quick("preference.py", timeout=600)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("contender"))  # after any library's warnings
    rows = [line[:38].strip() for line in lines[header + 1 : header + 5]]
    assert rows == [
        "TRL DPOTrainer",
        "rapidlite",
        "rapidlite --precompute-ref-logprobs",
        "rapidlite ZeRO-3 x 2 ranks",
    ], proc.stdout
    assert any(line.startswith("check first-step losses equal") and line.endswith(": ok") for line in lines)
    for target in ("target tokens/s >= 1.05 x TRL: x", "target peak memory <= 0.8 x TRL"):
        assert any(line.startswith(target) for line in lines), proc.stdout


def test_grpo_benchmark_quick():
    """TRL's GRPOTrainer and --task grpo decode the same completions (the check), then the table and targets."""
    proc = run_quick("grpo.py", timeout=600)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("contender"))
    assert [line[:24].strip() for line in lines[header + 1 : header + 3]] == [
        "TRL GRPOTrainer",
        "rapidlite --task grpo",
    ], proc.stdout
    assert any(line.startswith("check the same completions") and line.endswith(": ok") for line in lines)
    for target in ("target rollout tokens/s >= 1.3 x TRL: x", "target peak memory <= 0.8 x TRL: x"):
        assert any(line.startswith(target) for line in lines), proc.stdout


def test_memory_benchmark_quick():
    """rapidlite's loss curve equals the Trainer's before anything is compared (the script stops otherwise); the
    table, the ratios, the longest-sequence line and the targets line are there (nothing is asserted on the
    figures: a tiny model on a shared machine)."""
    proc = run_quick("memory.py", "--threads", "1", timeout=900)
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] == ["8192"]]
    assert [(r[1], r[2]) for r in rows] == [("LoRA", "trainer"), ("LoRA", "rapidlite"), ("full", "trainer"),
                                            ("full", "rapidlite")]  # fmt: skip
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    assert sum(line.startswith("  vocabulary ") for line in lines) == 2
    assert any(line.startswith("longest sequence within") and "--dry-run found" in line for line in lines)
    assert any(line.startswith("targets at vocabulary 8192:") for line in lines)


def test_streaming_memory_benchmark_quick():
    """A short --streaming run's peak resident size is flat from a 0.2 MB to a 2 MB text file, while the map-style
    path's grows (measured, not assumed: both checks are the script's)."""
    proc = run_quick("streaming_memory.py", timeout=300, env={"OMP_NUM_THREADS": "1"})
    lines = proc.stdout.splitlines()
    rows = [" ".join(line.split()[:2]) for line in lines]
    for row in ("streamed 0.2MB", "streamed 2MB", "map-style 0.2MB", "map-style 2MB"):
        assert row in rows, proc.stdout
    assert "check streamed peak flat (within 5% or 8 MiB): ok" in lines, proc.stdout
    assert "check map-style peak grows more than the streamed one: ok" in lines, proc.stdout


@pytest.mark.slow
def test_moe_benchmark_quick():
    """The dense model, the mixture's per-expert loop and its grouped matmul each train and are compared (the
    loop and the grouped matmul compute the same: the same validation loss)."""
    proc = run_quick("moe.py", timeout=300)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()[-8:]
            if line.startswith("| ") and "contender" not in line}  # fmt: skip
    assert list(rows) == ["dense", "moe loop", "moe grouped"], proc.stdout
    assert rows["moe loop"] == rows["moe grouped"], proc.stdout
    assert "moe grouped vs loop step time: x" in proc.stdout, proc.stdout


@pytest.mark.distributed
def test_long_context_benchmark_quick():
    """CP1 and CP2 planned and run at one length; the table and the targets line are there (nothing is asserted
    on the figures: a tiny model whose peak is the Python runtime)."""
    proc = run_quick("long_context.py", timeout=600)
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("cp")}
    assert list(rows) == ["cp1", "cp2_p2p"] and all(float(r[-1]) > 0 for r in rows.values())
    assert any(line.startswith("targets (longest sequence against CP1") for line in proc.stdout.splitlines())
