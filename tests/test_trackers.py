"""Trackers as plug-ins: ``--report-to`` resolved once into the run's trackers (the trackers' own flags are spellings
of it), refused up front in one line, a tracker failing mid-run is one warning and never the run's end, and
TensorBoard on the same interface (``--report-to tensorboard`` alone writes beside the checkpoints)."""

from __future__ import annotations

import sys

import pytest

from helpers import ToyFinetuner, engine, read_metrics
from rapidlite.cli.main import main
from rapidlite.observe.trackers import TRACKERS
from rapidlite.observe.trackers.registry import installed
from rapidlite.resolve import parse_args

TOY = ["--micro-batch-size", "8", "--epochs", "1", "--log-interval", "2"]


def trackers(*argv: str):
    settings = parse_args(list(argv), require_task=False).sections.logging
    return settings.trackers, settings.tensorboard_dir


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], ()),
        (["--report-to", "none"], ()),
        (["--report-to", "TensorBoard, mlflow"], ("tensorboard", "mlflow")),
        (["--report-to", "mlflow,tensorboard", "--wandb-project", "p"], ("tensorboard", "wandb", "mlflow")),
        (["--tensorboard-dir", "tb"], ("tensorboard",)),
        (["--wandb-project", "p", "--wandb-mode", "offline"], ("wandb",)),
        (["--report-to", "wandb", "--wandb-run-name", "x"], ("wandb",)),  # W&B's default project
        (["--mlflow-experiment", "e"], ("mlflow",)),
    ],
)
def test_report_to_and_the_flags_that_imply_it_resolve_to_one_list(argv, expected):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    assert trackers(*argv)[0] == expected


def test_all_is_every_installed_tracker_and_tensorboard_writes_beside_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as far as importlib can tell
    names, tb = trackers("--report-to", "all", "--save", str(tmp_path / "run"))
    assert names == tuple(n for n, spec in TRACKERS.items() if installed(spec)) and "wandb" not in names
    assert tb == str(tmp_path / "run" / "tensorboard")
    assert trackers("--report-to", "tensorboard") == (("tensorboard",), None)  # TensorBoard's own ./runs/...
    assert trackers("--report-to", "tensorboard", "--tensorboard-dir", "tb")[1] == "tb"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--report-to", "neptune"], "--report-to neptune: unknown tracker 'neptune'; choose from tensorboard, wandb"),
        (["--report-to", "none,mlflow"], "--report-to none,mlflow: none and all stand alone"),
        (["--report-to", "none", "--tensorboard-dir", "tb"], "--tensorboard-dir reports to TensorBoard, but --report"),
        (["--report-to", "mlflow"], "--report-to mlflow reports to MLflow, which is not installed: pip install "),
        (["--mlflow-experiment", "e"], "--mlflow-experiment reports to MLflow, which is not installed: pip install "),
        (["--mlflow-experiment", " "], "--mlflow-experiment: give the MLflow experiment's name"),
        (["--wandb-mode", "offline"], "--wandb-mode configures Weights & Biases reporting: add --wandb-project NAME"),
        (["--report-to", "wandb"], "--report-to wandb reports to Weights & Biases, which is not installed: pip "),
    ],
)
def test_refused_up_front_in_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    assert main(["--task", "sequence_classification", "--demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    if "installed" in message:
        assert f"pip install 'rapidlite[{'mlflow' if 'MLflow' in message else 'wandb'}]'" in err
    assert not (tmp_path / "cache").exists()


def test_a_tracker_failing_to_log_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, log_lines):
    from rapidlite.observe.trackers.tensorboard import TensorBoardTracker

    def refuse(self, record, prefix):
        raise OSError("the quota is used up")

    monkeypatch.setattr(TensorBoardTracker, "log", refuse)
    ToyFinetuner(engine(*TOY, "--save", str(tmp_path / "run"), "--report-to", "tensorboard")).train()
    warnings = [line for line in log_lines if "could not log a record" in line]
    assert warnings == [
        "tensorboard: could not log a record (the quota is used up); training goes on, metrics.jsonl has every record"
    ]
    assert any(line.startswith("tensorboard: 6 calls failed in this run") for line in log_lines), log_lines
    assert [r["iteration"] for r in read_metrics(tmp_path / "run") if "split" not in r] == [2, 4, 6, 8]


def test_tensorboard_under_save_continues_on_resume_and_keeps_the_curves(curves, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = tmp_path / "run"
    argv = [*TOY, "--save", str(save), "--report-to", "tensorboard"]
    ToyFinetuner(engine(*argv, "--train-iters", "4")).train()
    ToyFinetuner(engine(*argv, "--load", str(save), "--train-iters", "8")).train()
    events = EventAccumulator(str(save / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    expected = {r["iteration"]: r["loss"] for r in read_metrics(save) if "split" not in r}
    assert sorted(losses) == [2, 4, 6, 8] and losses == pytest.approx(expected, rel=1e-6)
    assert "curves.png" in events.Tags()["images"]


def test_overwrite_removes_the_earlier_runs_tensorboard_events_under_save(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = tmp_path / "run"
    argv = [*TOY, "--save", str(save), "--report-to", "tensorboard"]
    ToyFinetuner(engine(*argv)).train()
    ToyFinetuner(engine(*argv, "--train-iters", "2", "--overwrite")).train()
    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2]  # not the earlier run's 2, 4, 6, 8 as well
