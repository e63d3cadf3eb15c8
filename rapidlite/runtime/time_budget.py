"""``--time-budget MINUTES``: a run sized to end within a wall-clock budget, not an iteration count.

The budget counts from the command's start (``rapidlite`` records it before anything is built, so preparing an
embedded corpus, starting workers and loading the model are inside it). The run starts as long as it may be
(``--train-iters`` or the epochs: the upper bound), times its first optimizer steps (``TIMED_STEPS`` after the
first, which warms up allocators and compiles), and then sets its length to the iterations that fit in what is
left, after a reserve for the evaluations and the end (final checkpoint, export). Only what follows is changed:
the learning-rate schedule decays over the new length, as if it had been given; the warmup is never part of the
timed steps' decision. Evaluation and log intervals that the run did not set explicitly are spaced over the new
length (four evaluations; a log line every ``LOG_EVERY_S`` seconds or so), so a person sees it working.

The decision is a pure function of the measured speed (``fit``), tested with faked speeds.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

START_ENV = "RAPIDLITE_START_TIME"  # the command's start (seconds since the epoch), inherited by the workers
TIMED_STEPS = 3  # steps timed after the first before the run is sized
EVALUATIONS = 4  # evaluations over a sized run whose --eval-interval was not given
LOG_EVERY_S = 10.0  # a log line about this often, where --log-interval was not given
END_RESERVE_S = 10.0  # the final checkpoint, export and curves
SAFETY = 0.9  # the share of the remaining time planned for steps: speeds drift


def mark_start() -> None:
    """Record the command's start for this process and the workers it starts; a worker (started by torchrun)
    keeps its launcher's."""
    if "LOCAL_RANK" not in os.environ:
        os.environ[START_ENV] = repr(time.time())


def command_start() -> float:
    value = os.environ.get(START_ENV)
    try:
        return float(value) if value else time.time()
    except ValueError:
        return time.time()


@dataclass(frozen=True)
class Fit:
    """The sized run: its total iterations and the intervals spaced over it, and the seconds it should take
    from now."""

    total_iters: int
    eval_interval: int | None
    log_interval: int | None
    seconds_left: float
    capped: bool  # the upper bound (--train-iters or the epochs) ended it, not the budget


def fit(
    *,
    budget_s: float,
    elapsed_s: float,
    done_iters: int,
    step_s: float,
    max_iters: int,
    eval_s: float,
    eval_interval: int | None,
    fixed_evaluations: int | None = None,
    size_eval_interval: bool = False,
    size_log_interval: bool = False,
) -> Fit:
    """The run that fits ``budget_s`` seconds, ``elapsed_s`` of which are used, after ``done_iters`` steps of
    ``step_s`` seconds each, at most ``max_iters`` in all. ``eval_s``: one evaluation's seconds. Evaluations:
    ``fixed_evaluations`` when their number does not depend on the length (an epoch-based run's), else four
    when ``size_eval_interval`` (the interval is spaced over the length), else one every ``eval_interval``
    (None: none). A run always takes at least one more step."""
    step_s = max(step_s, 1e-6)
    left = budget_s - elapsed_s - END_RESERVE_S
    per_step = step_s
    if fixed_evaluations is not None:
        left -= fixed_evaluations * eval_s
    elif size_eval_interval:
        left -= EVALUATIONS * eval_s
    elif eval_interval:
        per_step += eval_s / eval_interval
    steps = max(1, math.floor(SAFETY * left / per_step))
    total = min(max_iters, done_iters + steps)
    spaced = size_eval_interval and fixed_evaluations is None
    # Four evaluations; a run too short for them evaluates once, at its end.
    eval_every = (math.ceil(total / EVALUATIONS) if total >= 2 * EVALUATIONS else total) if spaced else None
    log_every = max(1, min(total, round(LOG_EVERY_S / step_s))) if size_log_interval else None
    if fixed_evaluations is not None:
        evaluations = fixed_evaluations
    elif size_eval_interval:
        evaluations = EVALUATIONS
    else:
        evaluations = (total - done_iters) // eval_interval if eval_interval else 0
    seconds = (total - done_iters) * step_s + evaluations * eval_s + END_RESERVE_S
    return Fit(total, eval_every, log_every, seconds, capped=total == max_iters)


def describe(minutes: float) -> str:
    seconds = round(minutes * 60)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
