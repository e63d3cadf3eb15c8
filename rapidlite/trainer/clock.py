"""When a run stops other than at its last iteration, and how long it is: ``--time-budget`` sizing after the first
timed steps, ``--exit-interval`` / ``--exit-duration-in-mins``, SIGTERM/SIGUSR1 agreed over the ranks, and the
divergence watch (``--max-skipped-steps`` NaN/inf steps in a row stop the run with nothing saved).

The clock decides; the loop acts on its answer (save, say how to resume, end), so every rank stops after the same
iteration.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.errors import TrainingDiverged
from rapidlite.runtime import preemption, time_budget


class RunClock:
    """The run's length and its early ends. ``trainer``: the ``BaseTrainer`` whose position (iteration, length,
    intervals) the clock reads and, when ``--time-budget`` sizes the run, sets."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.settings = trainer.settings
        self.engine = trainer.engine
        self.logger = trainer.logger
        self.signals = preemption.StopSignals()
        self.skip_streak = 0  # consecutive steps skipped for NaN/inf (see watch_divergence)
        self._first_iteration = 0
        self._step_clock: float | None = None  # --time-budget: when the last step's bookkeeping ended
        self._timed_steps: list[float] = []  # --time-budget: the timed steps' seconds (emptied once sized)
        self._eval_seconds: float | None = None  # the last evaluation's seconds

    # ------------------------------------------------------------------ the run's start and steps
    def begin(self) -> None:
        """Right before the first step: stop signals are caught from here, and --time-budget starts timing."""
        trainer = self.trainer
        self._first_iteration = trainer.iteration
        self.signals.install()
        budget = self.settings.training.time_budget
        if budget is not None and trainer.iteration < trainer.total_iters:
            self._step_clock = time.perf_counter()
            elapsed = time.time() - time_budget.command_start()
            self.logger.info(
                f"--time-budget {budget:g} min: {time_budget.describe(elapsed / 60)} used so far; the run is sized "
                f"after {time_budget.TIMED_STEPS} timed steps to end within the budget (at most {trainer.total_iters} "
                "iterations)"
            )

    def step_ended(self) -> None:
        """After an optimizer step, before its bookkeeping: the step's seconds count towards the sizing."""
        if self._step_clock is not None:
            self._time_step(time.perf_counter() - self._step_clock)

    def bookkeeping_ended(self) -> None:
        if self._step_clock is not None:
            self._step_clock = time.perf_counter()  # the next step's time excludes this bookkeeping

    @contextlib.contextmanager
    def timing_evaluation(self) -> Iterator[None]:
        """Around an evaluation: its seconds size the evaluations still to come."""
        start = time.perf_counter()
        yield
        self._eval_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ --time-budget
    def _time_step(self, seconds: float) -> None:
        if self.trainer.iteration - 1 <= self._first_iteration:  # the first step warms up (and compiles): not timed
            return
        self._timed_steps.append(seconds)
        if len(self._timed_steps) >= time_budget.TIMED_STEPS:
            self._size_to_budget()

    def _size_to_budget(self) -> None:
        """Set the run's length to the iterations that fit the rest of --time-budget (``runtime.time_budget``).
        Every rank decides from the slowest rank's numbers, so all agree."""
        settings, trainer = self.settings, self.trainer
        step_s = sorted(self._timed_steps)[len(self._timed_steps) // 2]
        elapsed = time.time() - time_budget.command_start()
        measured = torch.tensor([step_s, elapsed], dtype=torch.float64, device=self.engine.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
        step_s, elapsed = (float(x) for x in measured.cpu())
        given = settings.explicit_flags  # None: settings built by hand, every value counts as given
        user_given = Sections.field_names() if given is None else given - settings.task.demo_defaults
        sized_evaluations = trainer.evaluations_left() is None and "eval_interval" not in user_given
        eval_s = self._eval_seconds if self._eval_seconds is not None else trainer.estimated_eval_seconds(step_s)
        plan = time_budget.fit(
            budget_s=settings.training.time_budget * 60,
            elapsed_s=elapsed,
            done_iters=trainer.iteration,
            step_s=step_s,
            max_iters=trainer.total_iters,
            eval_s=eval_s,
            eval_interval=trainer.eval_every,
            fixed_evaluations=trainer.evaluations_left(),
            size_eval_interval=sized_evaluations,
            size_log_interval="log_interval" not in user_given,
        )
        timed = len(self._timed_steps)
        self._step_clock, self._timed_steps = None, []
        self._apply_plan(plan, user_given)
        ends = time.strftime("%H:%M:%S", time.localtime(time.time() + plan.seconds_left))
        bound = " (the upper bound: it fits with time to spare)" if plan.capped else ""
        if elapsed + plan.seconds_left > settings.training.time_budget * 60 * 1.05:
            bound = " (the budget is spent: this machine is slower than it allows; raise --time-budget)"
        self.logger.info(
            f"--time-budget {settings.training.time_budget:g} min: {timed} steps timed at "
            f"{step_s:.2f} s, {time_budget.describe(elapsed / 60)} used: training {plan.total_iters} iterations"
            f"{bound}, about {time_budget.describe(plan.seconds_left / 60)} more (until {ends})"
        )

    def _apply_plan(self, plan: Any, user_given: set[str]) -> None:
        """The sized length, intervals and LR schedule on the trainer, and the progress bar's new total."""
        settings, trainer = self.settings, self.trainer
        trainer.total_iters = plan.total_iters
        if plan.eval_interval is not None:
            trainer.eval_every = plan.eval_interval
        if plan.log_interval is not None:
            trainer.log_every = plan.log_interval
        resize = getattr(trainer.lr_scheduler, "resize", None)
        if resize is not None and settings.optim.lr_decay_iters is None:
            warmup = None
            if "lr_warmup_iters" not in user_given and settings.optim.lr_warmup_iters:
                warmup = min(
                    settings.optim.lr_warmup_iters, max(plan.total_iters // 4, 1)
                )  # a demo's warmup fits its length
            resize(plan.total_iters, warmup_steps=warmup, warmup_fraction=settings.optim.lr_warmup_fraction)
        progress = trainer.monitor.progress
        if progress is not None:
            progress.total = plan.total_iters
            progress.refresh()

    # ------------------------------------------------------------------ early ends
    def exit_reason(self) -> str | None:
        """Megatron's ``--exit-interval N`` (after an iteration divisible by N) and ``--exit-duration-in-mins M``
        (after the first step ending M minutes after the command's start; every rank agrees on the same one): the
        flag that ends the run here, or None. The run's own last iteration is never cut short."""
        settings, trainer = self.settings, self.trainer
        interval, minutes = settings.training.exit_interval, settings.training.exit_duration_in_mins
        if (interval is None and minutes is None) or trainer.iteration >= trainer.total_iters:
            return None
        reason = None
        if interval is not None and trainer.iteration % interval == 0:
            reason = f"--exit-interval {interval}"
        late = minutes is not None and (time.time() - time_budget.command_start()) / 60 >= minutes
        if minutes is not None and preemption.max_over_ranks(int(late), self.engine.device):
            reason = reason or f"--exit-duration-in-mins {minutes:g}"
        return reason

    def signalled(self) -> int:
        """The stop signal (SIGTERM, SIGUSR1) that reached any rank, agreed by every rank; 0 for none."""
        return self.signals.agreed(self.engine.device)

    def restore_signals(self) -> None:
        """The process's own signal handlers again: a signal now no longer stops the run at a step's end."""
        self.signals.restore()

    def watch_divergence(self, applied: bool, nonfinite: bool) -> None:
        """Count consecutive steps that could not be applied: NaN/inf losses or gradients, and fp16 overflows once
        the loss scale is at its minimum (before that, skipping is how the scaler finds its scale). After
        ``--max-skipped-steps`` of them the run stops (``TrainingDiverged``, exit code 3), with nothing saved."""
        trainer = self.trainer
        scaler = trainer.optimizer.loss_scaler
        stuck = not applied and scaler is not None and scaler.scale <= scaler.min_scale
        if applied or not (nonfinite or stuck):
            self.skip_streak = 0
            return
        self.skip_streak += 1
        limit, iteration = self.settings.training.max_skipped_steps, trainer.iteration
        if self.skip_streak == 1 and self.engine.is_main_process:
            what = "non-finite loss or gradients" if nonfinite else "fp16 overflow at the minimum loss scale"
            self.logger.warning(
                f"iteration {iteration}: {what}; step skipped, weights unchanged (the run stops after "
                f"{limit} such steps in a row: --max-skipped-steps)"
            )
        if limit and self.skip_streak >= limit:
            first = iteration - self.skip_streak + 1
            raise TrainingDiverged(
                f"the loss or the gradients were NaN/inf for {self.skip_streak} steps in a row (iterations "
                f"{first}-{iteration}): stopped without saving them; {trainer.checkpointing.last_good()} (lower "
                "--lr, clip gradients with --clip-grad, or use bf16 instead of fp16)"
            )
