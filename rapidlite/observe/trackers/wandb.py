"""Weights & Biases: ``--report-to wandb`` or ``--wandb-project NAME`` (``pip install 'rapidlite[wandb]'``).

One W&B run gets every record (train, validation, test, model_state) as its finite numbers under
``<split>/<name>``, charted against ``iteration`` (W&B's own step only counts calls, so a resumed run that logs an
iteration again is kept, not dropped). The run's config is every resolved setting. A checkpoint keeps the run's
id, and a run resumed from it continues the same W&B run (``resume="allow"``). The run is finished with the
process's outcome (exit code; a preempted run is marked preempting), also when training fails.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rapidlite.errors import first_line
from rapidlite.observe.trackers.base import STEP, Tracker, TrackingError, numbers


class WandbTracker(Tracker):
    """One W&B run from ``--wandb-project`` (unset: W&B's default, ``WANDB_PROJECT``), ``--wandb-entity``,
    ``--wandb-run-name`` and ``--wandb-mode`` (unset: W&B's own default and ``WANDB_MODE``)."""

    name = "wandb"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run: Any = None

    def start(self, settings: Mapping[str, Any], resume_id: str | None) -> str:
        import wandb

        cfg = self.cfg
        kwargs: dict[str, Any] = {
            "project": cfg.wandb_project,
            "entity": cfg.wandb_entity,
            "name": cfg.wandb_run_name,
            "mode": cfg.wandb_mode,
            "config": dict(settings),
        }
        if resume_id:
            kwargs.update(id=resume_id, resume="allow")
        try:
            run = wandb.init(**kwargs)
        except Exception as e:  # wandb's errors (no API key, no network, a refused entity) are one line here
            asked = f"--wandb-project {cfg.wandb_project}" if cfg.wandb_project else "--report-to wandb"
            raise TrackingError(
                f"{asked}: Weights & Biases could not start the run ({first_line(e)}); log in with 'wandb login' "
                "(or set WANDB_API_KEY), or pass --wandb-mode offline and 'wandb sync' later"
            ) from None
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        self._run, self.id = run, run.id
        continued = " (continued: the checkpoint's run)" if resume_id == run.id else ""
        return f"Weights & Biases: run {run.id} in project {run.project}{continued}"

    def log(self, record: Mapping[str, Any], prefix: str) -> None:
        values = numbers(record, prefix)
        if values and self._run is not None:
            self._run.log({STEP: record.get(STEP, 0), **values})

    def log_table(self, name: str, rows: list[Mapping[str, Any]], step: int) -> None:
        """``rows`` as a ``wandb.Table`` (nested values as JSON text) at ``step``."""
        if self._run is None or not rows:
            return
        import json

        import wandb

        columns = list(rows[0])
        data = [
            [v if isinstance(v, int | float | str) else json.dumps(v, default=str) for v in r.values()] for r in rows
        ]
        self._run.log({STEP: step, name: wandb.Table(columns=columns, data=data)})

    def log_file(self, path: str) -> None:
        """The file among the run's files (uploaded online; kept in the offline run's directory)."""
        if self._run is not None:
            self._run.save(os.path.abspath(path), base_path=os.path.dirname(os.path.abspath(path)), policy="now")

    def finish(self, exit_code: int, preempted: bool) -> None:
        """End the run (its upload included, online); idempotent. ``preempted``: W&B shows it as preempted."""
        run, self._run = self._run, None
        if run is None:
            return
        if preempted:
            run.mark_preempting()
        run.finish(exit_code=exit_code)
