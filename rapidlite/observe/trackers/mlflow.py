"""MLflow: ``--report-to mlflow`` or ``--mlflow-experiment NAME`` (``pip install 'rapidlite[mlflow]'``).

The store is ``MLFLOW_TRACKING_URI`` (a server, a database, a ``file:`` folder), else a file store in ``./mlruns``
of the directory the run starts in (``mlflow ui --backend-store-uri ./mlruns`` shows it), where runs of several
``--save`` directories sit side by side in one experiment to compare. MLflow 3 keeps file stores in maintenance
mode and asks for ``MLFLOW_ALLOW_FILE_STORE=true``; a run that reports to a file store sets it (unless set) for its
process.

The experiment is ``--mlflow-experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else "rapidlite"; the run is named
after the ``--save`` directory. Its params are the resolved settings (nested values flattened as ``a.b``, values
cut to MLflow's length limit); every record's finite numbers are metrics ``<split>/<name>`` at step ``iteration``;
``curves.png``, ``metrics.jsonl`` and ``config.yaml`` are artifacts. A checkpoint keeps the MLflow run id, and a
run resumed from it continues that run (its params keep their first values: MLflow params cannot change). The run
ends FINISHED, FAILED (a crash, a diverged run, a user error) or KILLED (preempted by SIGTERM/SIGUSR1, or
interrupted).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rapidlite.errors import first_line
from rapidlite.observe.trackers.base import STEP, Tracker, TrackingError, numbers

DEFAULT_STORE = "mlruns"
DEFAULT_EXPERIMENT = "rapidlite"
INTERRUPTED = 130  # the exit code of a run stopped by Ctrl-C: KILLED, as a preempted one


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else the file store ``./mlruns`` (absolute: the run may change directory)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    return uri if uri else "file:" + os.path.abspath(DEFAULT_STORE)


def is_file_store(uri: str) -> bool:
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*):", uri)
    return scheme is None or scheme.group(1) == "file" or len(scheme.group(1)) == 1  # a bare path, C:\...


def params(settings: Mapping[str, Any], limit: int) -> dict[str, str]:
    """The settings as MLflow params: nested mappings flattened (``a.b``), values as text (JSON for all but
    strings) cut to ``limit`` characters, keys in MLflow's alphabet."""

    def flat(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
        if isinstance(value, Mapping) and value:
            for key, inner in value.items():
                yield from flat(f"{prefix}.{key}", inner)
        else:
            yield prefix, value

    out = {}
    for name, value in settings.items():
        for key, leaf in flat(name, value):
            text = leaf if isinstance(leaf, str) else json.dumps(leaf, default=str)
            out[re.sub(r"[^\w\-. /]", "_", key)[:250]] = text[:limit]
    return out


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: Any = None

    def start(self, settings: Mapping[str, Any], resume_id: str | None) -> str:
        uri = tracking_uri()
        experiment = self.cfg.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        if is_file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            run = self._existing_run(client, resume_id)
            if run is None:
                found = client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else client.create_experiment(experiment)
                save = settings.get("save")
                name = os.path.basename(os.path.normpath(save)) if save else None
                run = client.create_run(experiment_id, run_name=name, tags={"rapidlite.save": save} if save else None)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
            self._client, self.id = client, run.info.run_id
            self._log_params(run, settings)
        except Exception as e:  # an unreachable server, a refused store, a bad URI: one line
            asked = (
                f"--mlflow-experiment {self.cfg.mlflow_experiment}"
                if self.cfg.mlflow_experiment
                else "--report-to mlflow"
            )
            raise TrackingError(
                f"{asked}: MLflow could not start the run in {uri} ({first_line(e)}); set MLFLOW_TRACKING_URI to a "
                "store you can reach (unset: ./mlruns)"
            ) from None
        continued = " (continued: the checkpoint's run)" if resume_id == self.id else ""
        return f"MLflow: run {self.id} in experiment {experiment!r} at {uri}{continued}"

    @staticmethod
    def _existing_run(client: Any, resume_id: str | None) -> Any:
        """The checkpoint's run, when the store still holds it (a resume from another store starts a new one)."""
        if not resume_id:
            return None
        try:
            return client.get_run(resume_id)
        except Exception:  # MlflowException: RESOURCE_DOES_NOT_EXIST
            return None

    def _log_params(self, run: Any, settings: Mapping[str, Any]) -> None:
        """The settings not yet among the run's params (a resumed run's keep the first launch's values)."""
        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:
            limit = 500
        from mlflow.entities import Param

        held = run.data.params
        new = [Param(k, v) for k, v in params(settings, limit).items() if k not in held]
        for i in range(0, len(new), 100):  # MLflow's params per batch
            self._client.log_batch(self.id, params=new[i : i + 100])

    def log(self, record: Mapping[str, Any], prefix: str) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            return
        now, step = int(time.time() * 1000), int(record.get(STEP, 0))
        metrics = [Metric(key, float(value), now, step) for key, value in numbers(record, prefix).items()]
        if metrics:
            self._client.log_batch(self.id, metrics=metrics)

    def log_file(self, path: str) -> None:
        if self._client is not None:
            self._client.log_artifact(self.id, path)

    def finish(self, exit_code: int, preempted: bool) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        killed = preempted or exit_code == INTERRUPTED
        client.set_terminated(self.id, "KILLED" if killed else "FINISHED" if exit_code == 0 else "FAILED")
