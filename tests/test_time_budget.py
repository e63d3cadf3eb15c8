"""``--time-budget``: the run's length is fitted to the time left after a few timed steps. The decision is checked
with faked speeds (a fast and a slow machine), never with the wall clock."""

import math

import pytest

from helpers import TINY, rapidlite_here, read_metrics, write_tiny_corpus
from rapidlite.config.parser import parse
from rapidlite.resolve import resolve, with_embedded_demo
from rapidlite.runtime import time_budget
from rapidlite.tasks import pretraining_demo

BUDGET_S = 3.5 * 60
# Seconds per step of the embedded pretraining default (4 x 256 GPT, 16 x 256 tokens) on 2 cores: about 0.45 s
# on an AVX-512 machine, 1.76 s on an AVX2-only one; 6 s stands for a machine far slower than both.
FAST, SLOW, VERY_SLOW = 0.45, 1.76, 6.0


def sized(step_s, elapsed_s=40.0, done=4, eval_interval=None, **kw):
    kw.setdefault("size_eval_interval", eval_interval is None)
    return time_budget.fit(
        budget_s=BUDGET_S, elapsed_s=elapsed_s, done_iters=done, step_s=step_s, max_iters=2000,
        eval_s=4 * step_s / 3, eval_interval=eval_interval, size_log_interval=True, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("step_s", [FAST, SLOW, VERY_SLOW])
def test_a_sized_run_ends_within_the_budget(step_s):
    plan = sized(step_s)
    assert 40.0 + plan.seconds_left <= BUDGET_S
    # It uses the time: what is left unplanned is at most the safety share and one step.
    assert 40.0 + plan.seconds_left >= time_budget.SAFETY * (BUDGET_S - time_budget.END_RESERVE_S) - step_s
    assert plan.eval_interval == math.ceil(plan.total_iters / time_budget.EVALUATIONS)
    assert plan.log_interval == max(1, round(time_budget.LOG_EVERY_S / step_s))
    assert not plan.capped


def test_the_slower_machine_trains_fewer_iterations_and_the_fast_one_stops_at_the_bound():
    fast, slow, very_slow = sized(FAST), sized(SLOW), sized(VERY_SLOW)
    assert fast.total_iters > slow.total_iters > very_slow.total_iters > 4
    assert 300 < fast.total_iters < 400 and 80 < slow.total_iters < 100
    quick = sized(0.01)
    assert quick.total_iters == 2000 and quick.capped  # --train-iters bounds it: done early


def test_a_spent_budget_takes_one_more_step():
    plan = sized(SLOW, elapsed_s=BUDGET_S + 30)
    assert plan.total_iters == 5 and plan.eval_interval == 5  # one evaluation, at the end


def test_evaluations_every_interval_or_per_epoch_are_paid_for():
    free = sized(SLOW, size_eval_interval=False, eval_interval=None)
    every_10 = sized(SLOW, eval_interval=10)
    per_epoch = sized(SLOW, fixed_evaluations=3)
    assert every_10.total_iters < free.total_iters and per_epoch.total_iters < free.total_iters
    assert every_10.eval_interval is None and per_epoch.eval_interval is None  # the given interval stays


# ------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny_corpus(prefix)
    return str(prefix)


def fake_speed(monkeypatch, step_s, elapsed_s):
    """Every timed step takes ``step_s`` and the command started ``elapsed_s`` before the sizing."""
    import time

    from rapidlite.cli import main as cli
    from rapidlite.trainer.clock import RunClock

    real = RunClock._time_step
    monkeypatch.setattr(RunClock, "_time_step", lambda self, seconds: real(self, step_s))
    monkeypatch.setattr(time_budget, "command_start", lambda: time.time() - elapsed_s)
    monkeypatch.setattr(cli, "mark_start", lambda: None)


@pytest.mark.parametrize("step_s", [0.5, 4.0])
def test_a_pretraining_run_is_sized_and_its_schedule_decays_over_the_new_length(
    corpus, tmp_path, monkeypatch, log_lines, step_s
):
    fake_speed(monkeypatch, step_s, elapsed_s=30.0)
    argv = ["--task", "pretraining", "--data-path", corpus, *TINY, "--train-iters", "400", "--time-budget", "1"]
    argv += ["--eval-interval", "5"]  # the first evaluation comes after the sizing (it would be timed for real)
    argv += ["--lr-decay-style", "cosine", "--min-lr", "1e-4", "--save", str(tmp_path)]
    assert rapidlite_here(*argv) == 0
    steps = [r for r in read_metrics(tmp_path) if "split" not in r]
    expected = time_budget.fit(
        budget_s=60, elapsed_s=30.0, done_iters=4, step_s=step_s, max_iters=400,
        eval_s=2 * step_s / 3, eval_interval=5,
    ).total_iters  # fmt: skip
    assert 4 < expected < 400
    assert steps[-1]["iteration"] == expected
    assert steps[-1]["lr"] == pytest.approx(1e-4)  # the cosine reached --min-lr at the sized end
    (line,) = [m for m in log_lines if "steps timed at" in m]
    assert f"{time_budget.TIMED_STEPS} steps timed at {step_s:.2f} s" in line
    assert f"training {expected} iterations" in line
    # --eval-interval and --log-interval were given: they stay.
    validations = [r["iteration"] for r in read_metrics(tmp_path) if r.get("split") == "validation"]
    assert validations == [*range(5, expected + 1, 5), *([expected] if expected % 5 else [])]
    assert [r["iteration"] for r in steps] == list(range(1, expected + 1))


def test_the_embedded_default_spaces_its_evaluations_and_logs(tmp_path, monkeypatch, log_lines):
    """The pretraining default with its budget on a machine where a step takes 2 s: four evaluations spread over
    the sized run, a log line about every 10 s. The model is made tiny (flags win) to keep the test fast."""
    fake_speed(monkeypatch, 2.0, elapsed_s=20.0)
    small = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"]
    assert rapidlite_here("--task", "pretraining", *small, "--global-batch-size", "4", "--micro-batch-size", "4",
                          "--eval-iters", "1", "--save", str(tmp_path)) == 0  # fmt: skip
    records = read_metrics(tmp_path)
    steps = [r for r in records if "split" not in r]
    total = steps[-1]["iteration"]
    expected = time_budget.fit(
        budget_s=pretraining_demo.TIME_BUDGET * 60, elapsed_s=20.0, done_iters=4, step_s=2.0, max_iters=2000,
        eval_s=2.0 / 3, eval_interval=None, size_eval_interval=True, size_log_interval=True,
    )  # fmt: skip
    assert total == expected.total_iters
    validations = [r["iteration"] for r in records if r.get("split") == "validation"]
    every = expected.eval_interval
    assert validations == [*range(every, total + 1, every), *([total] if total % every else [])]
    assert len(validations) == time_budget.EVALUATIONS
    assert [r["iteration"] for r in steps if r["iteration"] > 4][:2] == [5, 10]  # every 5 steps = 10 s
    assert any("--time-budget 3.5 min" in m and "at most 2000 iterations" in m for m in log_lines)


@pytest.mark.parametrize(
    "argv, budget",
    [
        ([], pretraining_demo.TIME_BUDGET),
        (["--train-iters", "400"], None),  # the length asked for wins over the demo's budget
        (["--train-iters", "400", "--time-budget", "2"], 2.0),  # both given: at most 400, within 2 minutes
    ],
)
def test_an_explicit_length_wins_over_the_embedded_budget(argv, budget):
    args = resolve(with_embedded_demo(parse(["--task", "pretraining", *argv])))
    assert args.time_budget == budget


def test_a_budget_must_be_positive():
    from rapidlite.errors import ConfigError

    with pytest.raises(ConfigError, match="--time-budget 0: must be a positive number of minutes"):
        resolve(parse(["--task", "pretraining", "--time-budget", "0"]))


def test_the_fine_tuning_demo_is_sized_on_a_slow_machine_and_pays_for_its_epoch_evaluations(
    tmp_path, monkeypatch, log_lines
):
    """The fine-tuning demo's budget (3 minutes) on a machine where a step takes 5 s: fewer steps than its three
    epochs, with the evaluation at each epoch's end counted in."""
    from rapidlite.tasks import demo

    fake_speed(monkeypatch, 5.0, elapsed_s=20.0)
    assert rapidlite_here("--task", "sequence_classification", "--demo", "--save", str(tmp_path)) == 0
    records = read_metrics(tmp_path)
    total = [r for r in records if "split" not in r][-1]["iteration"]
    (line,) = [m for m in log_lines if "steps timed at" in m]
    assert f"training {total} iterations" in line and f"--time-budget {demo.TIME_BUDGET:g} min" in line
    assert 4 < total < 100  # three epochs of the demo's 4000 rows are 375 steps
    validations = [r for r in records if r.get("split") == "validation"]
    assert validations[-1]["iteration"] == total
