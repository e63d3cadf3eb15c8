"""``--offload-activations``: the saved tensors go through the hooks and come back unchanged (same losses and
gradients, with and without activation checkpointing, on one process and under ZeRO-3 on 2 ranks), the planner
moves a GPU rank's activations to host but a block's worth, and the layouts it cannot serve are refused in one
line."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, engine, params, run_cli

sys.path.insert(0, str(REPO / "examples"))
from pretrain_custom_model import MyPreTrainer, TinyCausalLM  # noqa: E402

from rapidlite.parallel.activation_offload import OffloadActivations  # noqa: E402
from rapidlite.parallel.recompute import apply_activation_checkpointing  # noqa: E402
from rapidlite.planning.activations import offload_activations  # noqa: E402
from rapidlite.resolve import parse_args

TINY = ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "3", "--seq-length", "16"]
TINY += ["--hidden-size", "32", "--num-layers", "3", "--lr", "1e-3", "--log-interval", "1"]


def tiny_model(granularity: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=64, hidden=32, layers=3, heads=4, seq=16, dropout=0.0)
    if granularity is not None:
        apply_activation_checkpointing(model, granularity)
    return model


def loss_and_grads(model, tokens, hooks=None):
    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class Recording(OffloadActivations):
    """The hooks, remembering the tensors the pack hook moved."""

    def __init__(self, device: torch.device) -> None:
        self.moved: list[torch.Tensor] = []
        super().__init__(device)

    def _pack(self, t: torch.Tensor):
        before = self.packed
        packed = super()._pack(t)
        if self.packed > before:
            self.moved.append(t)
        return packed


@pytest.mark.parametrize("granularity", [None, "full", "selective"])
def test_hooks_move_saved_tensors_and_give_the_same_gradients(granularity):
    """The pack hook sees the saved activations (not the parameters) and the backward pass gets them back
    unchanged: the loss and every gradient are bitwise those of the same model without the hooks."""
    model = tiny_model(granularity)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, tokens)
    hooks = Recording(torch.device("cpu"))
    loss_off, grads_off = loss_and_grads(model, tokens, hooks)
    assert torch.equal(loss_off, loss)
    assert grads_off.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.equal(grads_off[name], g), name
    weights = {id(p) for p in model.parameters()}
    assert hooks.packed > 0 and hooks.packed_bytes > 0
    assert len(hooks.moved) == hooks.packed and not any(id(t) in weights for t in hooks.moved)
    if granularity is not None:
        # A checkpointed block keeps its input for the recompute, and the input goes through the hooks too.
        inputs = [t for t in hooks.moved if t.shape == (2, 16, 32)]
        assert len(inputs) >= 3


def test_small_tensors_and_parameters_stay_on_a_gpu():
    """What a GPU run keeps on the device: tensors under the threshold and parameters (checked on the CPU with
    the GPU's rule); a tensor saved twice is copied once."""
    hooks = OffloadActivations(torch.device("cpu"))
    hooks.min_bytes = 1024
    small, large = torch.zeros(16), torch.zeros(1024)
    weight = torch.nn.Parameter(torch.zeros(1024))
    assert hooks._pack(small) is small and hooks._pack(weight) is weight
    packed = hooks._pack(large)
    assert packed is not large and hooks.packed == 1
    back = hooks._unpack(packed)
    assert torch.equal(back, large) and back is not large
    # Saved twice in one forward: moved once; changed in place in between: moved again.
    assert hooks._pack(large) is packed and hooks.packed == 1
    large.add_(1)
    assert hooks._pack(large) is not packed and hooks.packed == 2


def train(*argv):
    trainer = MyPreTrainer(engine(*TINY, *argv))
    trainer.train()
    return trainer


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_training_run_is_unchanged(checkpointed):
    """Three steps of two micro-batches (dropout on): the trained weights are bitwise those of the run without
    the flag, and the strategy's hooks ran in every micro-batch."""
    extra = ["--checkpoint-activations"] if checkpointed else []
    plain = train(*extra)
    offloaded = train(*extra, "--offload-activations")
    assert plain.engine.strategy.offload is None
    assert offloaded.engine.strategy.offload.packed > 0
    expected, actual = params(plain.model), params(offloaded.model)
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(actual[k], v), k


@pytest.mark.distributed
def test_zero3_on_two_ranks_gives_the_same_gradients():
    """ZeRO-3 (FSDP2) on 2 ranks with checkpointing: the same composed model's loss and gradient shards with the
    strategy's hooks and without, bitwise on every rank (one launch)."""
    argv = ["--nproc-per-node", "2", "--zero-3-memory-optimization", "--checkpoint-activations"]
    argv += ["--offload-activations", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "offload_grads.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["strategy"] == "ZeRO-3 (FSDP2)"
    assert found["packed"] > 0 and found["same"], found


def test_planner_keeps_a_block_on_a_gpu_and_moves_nothing_on_a_cpu():
    assert offload_activations(10_000, 1_500.0, on_gpu=True) == (1_500, 8_500)
    assert offload_activations(1_000, 1_500.0, on_gpu=True) == (1_000, 0)  # less than a block: all stays
    assert offload_activations(10_000, 1_500.0, on_gpu=False) == (10_000, 0)


PLANNED = ["--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2"]
PLANNED += ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"]
PLANNED += ["--global-batch-size", "2", "--train-iters", "1", "--data-path", "unused"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plan_counts_what_stays_on_the_device(monkeypatch, device):
    """The plan of the same run with and without the flag: on a CPU identical; on a GPU (this machine posing as
    one for the plan) the activations but a block's worth move to the host column and a note says so."""
    from rapidlite.planning import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    base = plan(parse_args([*PLANNED, "--checkpoint-activations"]).sections)
    off = plan(parse_args([*PLANNED, "--checkpoint-activations", "--offload-activations"]).sections)
    (b,), (o,) = base.ranks, off.ranks
    assert (o.params, o.grads, o.optimizer, o.transient) == (b.params, b.grads, b.optimizer, b.transient)
    if device == "cpu":
        assert (o.activations, o.host) == (b.activations, b.host)
        assert any("on a CPU host memory is the device" in n for n in off.notes)
    else:
        assert 0 < o.activations < b.activations
        assert o.host == b.host + (b.activations - o.activations)
        assert o.peak < b.peak
        assert any("the host column" in n for n in off.notes)
        # Selective recompute's kept outputs are held by the checkpoint itself, past the hooks: they stay.
        selective = ["--checkpoint-activations", "--recompute-granularity", "selective", "--offload-activations"]
        (s,) = plan(parse_args([*PLANNED, *selective]).sections).ranks
        assert s.activations > o.activations


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["--pipeline-model-parallel-size", "2", "--num-layers", "2"], "--pipeline-model-parallel-size 2"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
        (["--deepspeed"], "--deepspeed"),
    ],
)
def test_layouts_it_cannot_serve_are_refused_in_one_line(argv, refused):
    proc = run_cli(*PLANNED[:-2], "--offload-activations", "--nproc-per-node", "2", *argv, "--dry-run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rapidlite: error: --offload-activations does not combine with {refused}")
