"""Weights & Biases beside ``metrics.jsonl`` and TensorBoard: ``--wandb-project`` (``pip install 'rapidlite[wandb]'``).

Rank 0's ``MetricsWriter`` feeds one W&B run: every record (train, validation, test, model_state) as its finite
numbers under ``<split>/<name>``, charted against ``iteration`` (W&B's own step only counts calls, so a resumed
run that logs an iteration again is kept, not dropped). The run's config is every resolved setting. A checkpoint
keeps the run's id, and a run resumed from it continues the same W&B run (``resume="allow"``). The run is
finished with the process's outcome (exit code), also when training fails.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from rapidlite.config.runtime import LoggingConfig
from rapidlite.errors import ConfigError

INSTALL = "pip install 'rapidlite[wandb]'"
STEP = "iteration"


class TrackingError(ConfigError):
    """A tracker that cannot start (not logged in, unreachable, refused)."""


def check_wandb_flags(cfg: LoggingConfig) -> None:
    """Before anything runs: the companion flags need ``--wandb-project``, and the package must be installed (found
    without importing it: flag errors stay fast)."""
    if cfg.wandb_project is None:
        given = [
            flag
            for flag, value in (
                ("--wandb-entity", cfg.wandb_entity),
                ("--wandb-run-name", cfg.wandb_run_name),
                ("--wandb-mode", cfg.wandb_mode),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(f"{given[0]} configures Weights & Biases reporting: add --wandb-project NAME")
        return
    if not cfg.wandb_project.strip():
        raise ConfigError("--wandb-project: give the W&B project's name")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project reports to Weights & Biases, which is not installed: {INSTALL}")


class WandbRun:
    """One W&B run: ``log`` a metrics record, ``finish`` once. Start it with ``WandbRun.start``."""

    def __init__(self, run: Any) -> None:
        self._run = run
        self.id: str = run.id

    @classmethod
    def start(cls, cfg: LoggingConfig, config: dict[str, Any], resume_id: str | None = None) -> WandbRun:
        """``wandb.init`` from the flags (``--wandb-mode`` unset: W&B's own default and ``WANDB_MODE``);
        ``resume_id``: the id a checkpoint kept, continued with ``resume="allow"``."""
        import wandb

        kwargs: dict[str, Any] = {
            "project": cfg.wandb_project,
            "entity": cfg.wandb_entity,
            "name": cfg.wandb_run_name,
            "mode": cfg.wandb_mode,
            "config": config,
        }
        if resume_id:
            kwargs.update(id=resume_id, resume="allow")
        try:
            run = wandb.init(**kwargs)
        except Exception as e:  # wandb's errors (no API key, no network, a refused entity) are one line here
            text = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise TrackingError(
                f"--wandb-project {cfg.wandb_project}: Weights & Biases could not start the run ({text}); log in "
                "with 'wandb login' (or set WANDB_API_KEY), or pass --wandb-mode offline and 'wandb sync' later"
            ) from None
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        return cls(run)

    def log(self, record: dict[str, Any], prefix: str) -> None:
        numbers = {
            f"{prefix}/{key}": value
            for key, value in record.items()
            if key != STEP and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        if numbers:
            self._run.log({STEP: record.get(STEP, 0), **numbers})

    def finish(self, exit_code: int = 0, preempted: bool = False) -> None:
        """End the run (its upload included, online); idempotent. ``preempted``: W&B shows it as preempted."""
        run, self._run = self._run, None
        if run is None:
            return
        if preempted:
            run.mark_preempting()
        run.finish(exit_code=exit_code)
