"""``--optimizer adamw8bit`` / ``paged_adamw8bit``: bitsandbytes' AdamW with 8-bit moments.

It trains with real 8-bit state (the tiny GPT's embedding and MLP matrices hold 4096 elements, bitsandbytes'
threshold), its state is about a quarter of AdamW's, a resumed run repeats an uninterrupted one bit for bit (the
uint8 moments, their block scales and the step survive the checkpoint), the plan's optimizer bytes are the
measured ones, and the layouts and devices it cannot serve are refused in one line before anything runs."""

import importlib.util

import pytest
import torch
from torch import nn

from helpers import TINY, rapidlite, rapidlite_here, read_metrics, stopped_copy, train_losses, write_tiny_corpus
from rapidlite.checkpoint.dcp import SafeFileSystemReader
from rapidlite.cli.main import main
from rapidlite.config.sections import OptimizerConfig
from rapidlite.optim import build_optimizer, optimizer_state_bytes
from rapidlite.parallel.data_parallel import model_state_bytes
from rapidlite.resolve import parse_args

pytest.importorskip("bitsandbytes")

COMMON = ["--task", "pretraining", *TINY, "--lr-decay-iters", "6"]
ARGV = [*COMMON, "--optimizer", "adamw8bit"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny_corpus(prefix)
    return str(prefix)


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
    """6 iterations in this process, checkpoints at 3 and 6."""
    save = tmp_path_factory.mktemp("optim8bit") / "full"
    argv = [*ARGV, "--data-path", corpus, "--train-iters", "6", "--save-interval", "3", "--save", str(save)]
    assert rapidlite_here(*argv) == 0
    return save


def saved_optimizer_dtypes(checkpoint) -> dict[str, torch.dtype]:
    metadata = SafeFileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {k: m.properties.dtype for k, m in metadata.items() if k.startswith("optim.") and hasattr(m, "properties")}


def test_trains_with_8bit_state(full_run):
    losses = train_losses(full_run)
    assert len(losses) == 6 and losses[-1] < 0.95 * losses[0], losses
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    saved = saved_optimizer_dtypes(full_run / "iter_0000006")
    word = "optim.embedding.word_embeddings.weight"
    assert saved[f"{word}.state1"] == saved[f"{word}.state2"] == torch.uint8, saved  # 128 x 32: quantised
    assert saved[f"{word}.absmax1"] == torch.float32 and f"{word}.qmap1" in saved and f"{word}.step" in saved
    small = [k[: -len(".state1")] for k, v in saved.items() if k.endswith(".state1") and v == torch.float32]
    assert small and all(f"{k}.absmax1" not in saved for k in small)  # under 4096 elements: two fp32 moments


def test_resume_is_bit_exact(full_run, corpus, tmp_path):
    part = stopped_copy(full_run, tmp_path / "part", 3)
    argv = [*ARGV, "--data-path", corpus, "--train-iters", "6", "--save-interval", "3"]
    assert rapidlite_here(*argv, "--load", str(part), "--save", str(part)) == 0
    assert train_losses(part) == train_losses(full_run)  # iterations 4-6 from the checkpoint, bit for bit


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_resume_is_bit_exact(corpus, tmp_path):
    """Each replica steps its own 8-bit state; the checkpoint holds one copy, which every rank loads."""
    argv = [*ARGV, "--data-path", corpus, "--micro-batch-size", "2", "--nproc-per-node", "2", "--train-iters", "6"]
    argv += ["--save-interval", "3"]
    full = tmp_path / "full"
    proc = rapidlite(*argv, "--save", str(full))
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = stopped_copy(full, tmp_path / "part", 3)
    proc = rapidlite(*argv, "--load", str(part), "--save", str(part))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(train_losses(full)) == 6 and train_losses(part) == train_losses(full)


def test_plan_counts_the_measured_state_bytes(full_run, corpus):
    (measured,) = [r for r in read_metrics(full_run) if r.get("split") == "model_state"]
    from rapidlite.planning import plan

    (rank,) = plan(parse_args([*ARGV, "--data-path", corpus, "--train-iters", "6"]).sections).ranks
    assert rank.optimizer == measured["optimizer_bytes"]
    (adamw,) = plan(parse_args([*COMMON, "--data-path", corpus, "--train-iters", "6"]).sections).ranks
    assert rank.optimizer < 0.55 * adamw.optimizer  # half this tiny GPT's parameters are in tensors under 4096


class Wide(nn.Module):
    """Large matrices (one of 4100 elements: a partial last block) and small tensors that keep fp32 state."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.odd = nn.Linear(64, 512), nn.Linear(512, 64), nn.Linear(41, 100)
        self.head = nn.Linear(164, 1)

    def forward(self, x):
        wide = self.down(torch.relu(self.up(x)))
        return self.head(torch.cat([wide, self.odd(x[:, :41])], dim=1))


def stepped_state_bytes(optimizer: str) -> tuple[int, list[int]]:
    torch.manual_seed(0)
    model = Wide()
    opt = build_optimizer(model, OptimizerConfig(optimizer=optimizer))
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    return model_state_bytes(model, opt)["optimizer_bytes"], [p.numel() for p in model.parameters()]


def test_state_is_under_a_third_of_adamws():
    eight, sizes = stepped_state_bytes("adamw8bit")
    full, _ = stepped_state_bytes("adamw")
    print(f"\noptimizer state: adamw8bit {eight} bytes, adamw {full} bytes, ratio {eight / full:.3f}")
    assert eight <= 0.3 * full
    assert eight == optimizer_state_bytes(OptimizerConfig(optimizer="adamw8bit"), sizes)


BASE = ["--task", "pretraining", "--data-path", "corpus", *TINY, "--train-iters", "2"]
REFUSED = [
    (["--zero-1-memory-optimization"], "--optimizer adamw8bit does not combine with --zero-1-memory-optimization"),
    (["--zero-3-memory-optimization"], "does not combine with --zero-3-memory-optimization (FSDP2"),
    (["--fsdp-memory-optimization"], "does not combine with --fsdp-memory-optimization"),
    (["--tensor-model-parallel-size", "2"], "does not combine with --tensor-model-parallel-size 2"),
    (["--deepspeed"], "does not combine with --deepspeed"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[a[0] for a, _ in REFUSED])
def test_unsupported_layouts_are_one_line(argv, message, capsys):
    assert main([*BASE, "--optimizer", "adamw8bit", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "use --optimizer adamw" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device pages the state")
def test_paged_without_cuda_is_one_line(capsys):
    assert main([*BASE, "--optimizer", "paged_adamw8bit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "use --optimizer adamw8bit" in err, err


def test_missing_bitsandbytes_is_one_line(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    assert main([*BASE, "--optimizer", "adamw8bit"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--optimizer adamw8bit needs bitsandbytes" in err and "pip install" in err, err


def test_the_cpu_steps_temporaries_are_planned():
    """bitsandbytes' CPU step works on a whole tensor in fp32: the resident peak of a step over the steady state
    is what the plan counts for it (``eight_bit.cpu_step_bytes``), measured in a fresh process."""
    import subprocess
    import sys

    from rapidlite.optim import eight_bit

    probe = """
import torch
from rapidlite.optim.builders import build_optimizer
from rapidlite.config.sections import OptimizerConfig
from rapidlite.runtime.allocator import bound_cpu_retention
bound_cpu_retention()
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
def hwm(): return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
layer = torch.nn.Linear(1024, 4096, bias=False)
layer.weight.grad = torch.randn_like(layer.weight)
opt = build_optimizer(layer, OptimizerConfig(optimizer="adamw8bit"))
opt.step()
steady = rss()
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
opt.step()
print(hwm() - steady)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    measured = int(out.split()[-1])
    planned = eight_bit.cpu_step_bytes([1024 * 4096])
    assert planned == pytest.approx(measured, rel=0.15), (planned, measured)
