"""Megatron's learning-rate schedule: warm-up, then constant, linear, cosine or inverse-square-root decay."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from rapidlite.config.sections import OptimizerConfig
from rapidlite.errors import ConfigError
from rapidlite.observe.logging import LOGGER_NAME


class LRScheduler:
    """Megatron's ``OptimizerParamScheduler`` over iterations.

    Linear warmup from 0 to ``max_lr`` over ``warmup_steps`` (the lr at iteration 0 is the
    warmup start), then ``decay_style`` down to ``min_lr`` at ``decay_steps``, ``min_lr`` after.
    ``step()`` is called once per successful optimizer step; the lr it sets is used by the next.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
    ) -> None:
        if decay_style != "constant" and decay_steps < warmup_steps:
            raise ConfigError(
                f"learning-rate warmup ({warmup_steps} iterations) must be shorter than the decay "
                f"({decay_steps} iterations): lower --lr-warmup-iters/--lr-warmup-fraction or "
                "raise --lr-decay-iters"
            )
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(self.min_lr, lr)
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ConfigError(f"--lr-decay-style {self.decay_style}: unknown")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def resize(self, decay_steps: int, warmup_steps: int | None = None, warmup_fraction: float | None = None) -> None:
        """Decay over ``decay_steps`` from now on (a run sized by --time-budget): the schedule a run of that length
        has. The warmup is ``warmup_steps`` if given, else ``warmup_fraction`` of the new length if given, else
        unchanged; never longer than the run."""
        if warmup_steps is None and warmup_fraction is not None:
            warmup_steps = int(warmup_fraction * decay_steps)
        if warmup_steps is not None:
            self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        if self.decay_style != "constant":
            self.warmup_steps = min(self.warmup_steps, decay_steps)
        self.step(0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The flags of the resumed run win (as in Megatron with --override-opt_param-scheduler);
        # only the position in the schedule is restored.
        self.num_steps = int(state["num_steps"])
        self.step(0)


def warmup_steps(cfg: OptimizerConfig, decay_steps: int) -> int:
    if cfg.lr_warmup_iters is not None:
        return cfg.lr_warmup_iters
    if cfg.lr_warmup_fraction is not None:
        return int(cfg.lr_warmup_fraction * decay_steps)
    return 0


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimizerConfig,
    total_iters: int,
    lr_scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Any:
    """The user's scheduler factory if given (e.g. ``partial(get_linear_schedule_with_warmup, ...)``), else
    Megatron's schedule from the flags with ``--lr-decay-iters`` defaulting to the run's length."""
    if lr_scheduler_fn is not None:
        return lr_scheduler_fn(optimizer)
    decay_steps = cfg.lr_decay_iters or total_iters
    warmup = warmup_steps(cfg, decay_steps)
    if warmup > decay_steps and cfg.lr_decay_style != "constant":
        # Known only now for an epoch-based run (its length comes from the data): warm up over the whole run,
        # as the Hugging Face Trainer does, and say so.
        logging.getLogger(LOGGER_NAME).warning(
            f"--lr-warmup-iters {warmup} is longer than the run's {decay_steps} iterations: warming up over "
            "the whole run (the learning rate reaches --lr only at its end); lower --lr-warmup-iters"
        )
        warmup = decay_steps
    return LRScheduler(
        optimizer,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        decay_style=cfg.lr_decay_style,
    )
