"""``--report-to mlflow`` / ``--mlflow-experiment``: real MLflow against a local file store, read back with
``MlflowClient``: the metrics equal ``metrics.jsonl``'s, the params are the resolved settings, a resumed run
continues the same MLflow run, a diverged run ends FAILED and a preempted one KILLED."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers import DP_COMMON, DP_TWO, REPO, ToyFinetuner, engine, rapidlite, read_metrics
from rapidlite.config import files as config_file
from rapidlite.errors import TrainingDiverged
from rapidlite.runtime.preemption import Preempted
from rapidlite.trainer.clock import RunClock

TOY = ["--micro-batch-size", "8", "--epochs", "2", "--log-interval", "2", "--lr", "0.01"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An MLflow file store under tmp_path (``MLFLOW_TRACKING_URI``), and a client reading it."""
    pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return MlflowClient(tracking_uri=uri)


def only_run(client, experiment: str = "rapidlite"):
    found = client.get_experiment_by_name(experiment)
    assert found is not None, experiment
    (run,) = client.search_runs([found.experiment_id])
    return run


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def jsonl(records: list[dict], key: str, split: str | None = None) -> dict[int, float]:
    return {r["iteration"]: float(r[key]) for r in records if r.get("split") == split and key in r}


def test_every_record_and_the_settings_reach_an_mlflow_run(curves, tmp_path, store):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from rapidlite.observe.trackers.mlflow import params

    save = tmp_path / "toy-run"
    trainer = ToyFinetuner(engine(*TOY, "--save", str(save), "--mlflow-experiment", "rapidlite-test"))
    trainer.train()
    run = only_run(store, "rapidlite-test")
    assert run.info.status == "FINISHED" and run.info.run_name == "toy-run"

    records = read_metrics(save)
    train = history(store, run.info.run_id, "train/loss")
    assert train == jsonl(records, "loss") and sorted(train) == [2, 4, 6, 8, 10, 12, 14, 16]
    for key in ("lr", "grad_norm", "consumed_samples", "samples_per_s"):
        assert history(store, run.info.run_id, f"train/{key}") == jsonl(records, key)
    assert history(store, run.info.run_id, "validation/loss") == jsonl(records, "loss", "validation")
    assert history(store, run.info.run_id, "model_state/param_bytes") == jsonl(records, "param_bytes", "model_state")

    held = run.data.params
    assert held == params(config_file.plain_settings(trainer.args), MAX_PARAM_VAL_LENGTH)
    assert held["micro_batch_size"] == "8" and held["lr"] == "0.01" and held["save"] == str(save)
    assert held["global_batch_size"] == "8" and held["gradient_accumulation_steps"] == "1"  # resolved values too
    assert held["trackers"] == '["mlflow"]' and held["mlflow_experiment"] == "rapidlite-test"

    artifacts = {a.path for a in store.list_artifacts(run.info.run_id)}
    assert {"curves.png", "metrics.jsonl", "config.yaml"} <= artifacts
    checkpoint = next(save.glob("iter_*"))
    assert torch.load(checkpoint / "state.pt", weights_only=True)["mlflow_run_id"] == run.info.run_id


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path, store):
    save = tmp_path / "run"
    argv = [*TOY, "--save", str(save), "--report-to", "mlflow"]
    ToyFinetuner(engine(*argv, "--train-iters", "6")).train()
    first = only_run(store)
    assert first.info.status == "FINISHED"
    ToyFinetuner(engine(*argv, "--load", str(save))).train()
    run = only_run(store)  # still one run in the experiment: the same one, finished again
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    train = history(store, run.info.run_id, "train/loss")
    assert sorted(train) == [2, 4, 6, 8, 10, 12, 14, 16] and train == jsonl(read_metrics(save), "loss")
    assert run.data.params["load"] == "null"  # params keep the first launch's values (MLflow's are immutable)

    ToyFinetuner(engine(*argv, "--load", str(save), "--finetune", "--save", str(tmp_path / "new"))).train()
    experiment = store.get_experiment_by_name("rapidlite").experiment_id
    assert len(store.search_runs([experiment])) == 2  # --finetune starts a new run


class Diverging(ToyFinetuner):
    def run_forward_step(self, batch, model):
        loss = super().run_forward_step(batch, model)
        return loss * float("nan") if self.iteration >= 3 else loss


def test_a_diverged_run_ends_failed_in_the_default_store(tmp_path, store, monkeypatch):
    """Without ``MLFLOW_TRACKING_URI`` the store is ``./mlruns`` of the directory the run starts in."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainingDiverged):
        Diverging(engine(*TOY, "--max-skipped-steps", "2", "--report-to", "mlflow")).train()
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    run = only_run(client)
    assert run.info.status == "FAILED"
    assert sorted(history(client, run.info.run_id, "train/loss")) == [2]


def test_a_preempted_run_ends_killed_and_the_same_command_continues_it(tmp_path, store, monkeypatch):
    """SIGTERM after iteration 4 (the loop's check, as tests/test_preemption.py stops a run in-process): the run
    is KILLED; the same command resumes it into the same MLflow run, which then ends FINISHED."""
    save = tmp_path / "run"
    argv = [*TOY, "--save", str(save), "--load", str(save), "--report-to", "mlflow"]
    trainer = ToyFinetuner(engine(*argv))
    with monkeypatch.context() as patch, pytest.raises(Preempted):
        patch.setattr(RunClock, "signalled", lambda clock: int(signal.SIGTERM) if trainer.iteration == 4 else 0)
        trainer.train()
    stopped = only_run(store)
    assert stopped.info.status == "KILLED"
    assert sorted(history(store, stopped.info.run_id, "train/loss")) == [2, 4]

    ToyFinetuner(engine(*argv)).train()
    run = only_run(store)
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert history(store, run.info.run_id, "train/loss") == jsonl(read_metrics(save), "loss")


@pytest.mark.distributed
def test_two_ranks_make_one_mlflow_run(tmp_path, store):
    """Only rank 0 tracks: two ranks under the launcher make one MLflow run whose losses are metrics.jsonl's."""
    save = tmp_path / "run"
    script = str(REPO / "examples" / "pretrain_custom_model.py")
    argv = ["--user-script", script, *DP_COMMON, *DP_TWO, "--train-iters", "3", "--save", str(save)]
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW")}
    proc = rapidlite(*argv, "--report-to", "mlflow", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(store)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    train = history(store, run.info.run_id, "train/loss")
    assert sorted(train) == [1, 2, 3] and train == jsonl(read_metrics(save), "loss")
