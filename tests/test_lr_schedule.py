import math

import pytest
import torch

from helpers import ToyFinetuner, engine, read_metrics
from rapidlite.errors import ConfigError
from rapidlite.optim import LRScheduler


def scheduler(style, warmup=10, decay=110, max_lr=1.0, min_lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    return LRScheduler(opt, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup, decay_steps=decay, decay_style=style)


@pytest.mark.parametrize(
    "style,iteration,expected",
    [
        ("linear", 0, 0.0),
        ("linear", 5, 0.5),
        ("linear", 10, 1.0),
        ("linear", 60, 0.55),
        ("linear", 110, 0.1),
        ("linear", 500, 0.1),
        ("cosine", 60, 0.55),
        ("cosine", 35, 0.1 + 0.5 * (math.cos(math.pi * 0.25) + 1) * 0.9),
        ("cosine", 110, 0.1),
        ("constant", 3, 0.3),
        ("constant", 400, 1.0),
        ("inverse-square-root", 40, 0.5),
        ("inverse-square-root", 1000, 0.1),
    ],
)
def test_megatron_formulas(style, iteration, expected):
    assert scheduler(style).get_lr(iteration) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_step_sets_optimizer_lr_and_resumes():
    s = scheduler("linear")
    assert s.optimizer.param_groups[0]["lr"] == 0.0  # iteration 0 is the warmup start
    for _ in range(60):
        s.step()
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    t = scheduler("linear")
    t.load_state_dict(s.state_dict())
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)


def test_warmup_may_not_outlast_decay():
    with pytest.raises(ConfigError, match="warmup"):
        scheduler("linear", warmup=21, decay=20)
    # As long as the decay: a warmup over the whole run (what a too-long --lr-warmup-iters is clamped to).
    s = scheduler("linear", warmup=20, decay=20, max_lr=1.0, min_lr=0.1)
    for _ in range(10):
        s.step()
    assert s.get_lr() == pytest.approx(0.5)
    for _ in range(10):
        s.step()
    assert s.get_lr() == pytest.approx(1.0)


def test_trainer_follows_schedule_with_warmup_fraction_and_min_lr(tmp_path):
    # 64 samples / global 8 = 8 iterations per epoch, 4 epochs = 32 iterations; warmup 25% = 8.
    e = engine(
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--epochs",
        "4",
        "--lr",
        "0.01",
        "--min-lr",
        "0.001",
        "--lr-warmup-fraction",
        "0.25",
        "--lr-decay-style",
        "cosine",
        "--log-interval",
        "1",
        "--save",
        str(tmp_path),
    )
    ToyFinetuner(e).train()
    lrs = {r["iteration"]: r["lr"] for r in read_metrics(tmp_path) if "lr" in r}
    ref = scheduler("cosine", warmup=8, decay=32, max_lr=0.01, min_lr=0.001)
    assert sorted(lrs) == list(range(1, 33))
    for it, lr in lrs.items():
        assert lr == pytest.approx(ref.get_lr(it), rel=1e-9, abs=1e-15), it
    assert lrs[32] == pytest.approx(0.001)
