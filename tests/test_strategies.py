"""Strategies: the run's backend is chosen once from the flags and the topology, compose leaves the user's
module its own (no markers, no patched forward, autocast through hooks), and the optimizer takes its
layout's step hooks at construction."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import MLP, engine
from rapidlite import strategies
from rapidlite.config.settings import Sections
from rapidlite.config.topology import Topology
from rapidlite.optim import RapidliteOptimizer, StepHooks
from rapidlite.precision import Precision
from rapidlite.runtime.distributed import DistributedContext


def _context(world: int = 1, pp: int = 1, zero: int = 0, deepspeed: bool = False, mesh: object = None):
    backend = "deepspeed" if deepspeed else "torch"
    topology = Topology.split(world, pp=pp, zero_stage=zero, backend=backend)
    dist = DistributedContext(world_size=world, topology=topology, mesh=mesh)
    return strategies.StrategyContext(
        config=Sections.of({}),
        dist=dist,
        precision=Precision(None, "cpu"),
        logger=logging.getLogger("test"),
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "DataParallel"),
        ({"world": 2, "mesh": object()}, "DataParallel"),
        ({"world": 2, "zero": 1, "mesh": object()}, "DataParallel"),
        ({"world": 2, "zero": 2, "mesh": object()}, "FullySharded"),
        ({"world": 2, "zero": 3, "mesh": object()}, "FullySharded"),
        ({"world": 2, "pp": 2, "mesh": object()}, "Pipeline"),
        ({"world": 4, "pp": 2, "zero": 3, "mesh": object()}, "Pipeline"),
        ({"world": 2, "zero": 2, "deepspeed": True, "mesh": object()}, "DeepSpeed"),
    ],
)
def test_one_strategy_per_backend(kwargs, expected):
    assert type(strategies.select(_context(**kwargs))).__name__ == expected


def test_compose_leaves_the_users_module_its_own():
    """No rapidlite attribute on the module, its class and forward unchanged; bf16 autocast runs through hooks
    (tiny shapes: bf16 is slow on CPUs without a bf16 fast path)."""
    eng = engine("--micro-batch-size", "4", "--bf16", "--train-iters", "2")
    model = MLP()
    before = set(vars(model))
    composed, optimizer, _ = eng.compose(model)
    assert composed is model and type(model) is MLP
    assert "forward" not in vars(model)
    assert not [k for k in set(vars(model)) - before if k.startswith("_rapidlite")]
    assert str(eng.strategy) == "single process"
    x = torch.randn(4, 8)
    assert model(x).dtype == torch.bfloat16  # autocast applied
    assert not torch.is_autocast_enabled("cpu")  # and closed after the forward
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 3))  # a forward that raises still closes its autocast
    assert not torch.is_autocast_enabled("cpu")
    eng.backward(F.mse_loss(model(x).float(), torch.zeros(4, 1)))
    assert optimizer.step()


def test_composing_a_model_twice_is_refused():
    eng = engine("--micro-batch-size", "4", "--train-iters", "2")
    model = MLP()
    eng.compose(model)
    with pytest.raises(TypeError, match="composed already"):
        eng.compose(model)


def test_step_hooks_are_given_at_construction():
    """The layout's hooks run inside the step: gradients synced before unscaling, the norm made whole, a copy
    left out of it."""
    model = torch.nn.Linear(3, 1, bias=False)
    calls = []

    def sync(params):
        calls.append("sync")
        for p in params:
            p.grad.mul_(2.0)  # e.g. the sum of two stages' copies

    def reduce_norm_sq(norm_sq):
        calls.append("norm")
        return norm_sq * 4  # four equal shards

    hooks = StepHooks(sync_grads=sync, reduce_norm_sq=reduce_norm_sq)
    optimizer = RapidliteOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), hooks=hooks)
    start = model.weight.detach().clone()
    optimizer.backward(model(torch.ones(1, 3)).sum())
    assert optimizer.step(grad_divisor=1.0)
    assert calls == ["sync", "norm"]
    assert torch.allclose(model.weight, start - 2.0)  # the synced gradient (2 x ones) was stepped
    assert float(optimizer.last_grad_norm) == pytest.approx(2 * 3**0.5 * 2)
    excluded = RapidliteOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), hooks=StepHooks(norm_exclude=frozenset({id(model.weight)}))
    )
    excluded.backward(model(torch.ones(1, 3)).sum())
    excluded.step()
    assert float(excluded.last_grad_norm) == 0.0
