"""The task registry: --task, its checks and its demo come from one table, so a new task is one entry."""

from __future__ import annotations

import pytest

from helpers import ToyFinetuner
from rapidlite.cli.main import main
from rapidlite.config import tasks as registry
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args


def toy_trainer(args):
    """A registry entry point: the trainer class for the flags."""
    return ToyFinetuner


@pytest.fixture
def toy_task(monkeypatch):
    spec = registry.TaskSpec(
        name="toy_regression",
        summary="a test task",
        trainer="test_task_registry:toy_trainer",
        required=("--seed",),
    )
    monkeypatch.setitem(registry.TASKS, spec.name, spec)
    return spec


def test_unknown_task_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="unknown task; choose one of sequence_classification, pretraining"):
        parse_args(["--task", "summarise"])


def test_a_registered_task_runs_from_the_command_line(toy_task, log_lines):
    assert "toy_regression" in registry.task_names()
    assert main(["--task", "toy_regression", "--micro-batch-size", "16", "--epochs", "1", "--lr", "1e-2"]) == 0
    assert any(line.startswith("final validation") for line in log_lines)


def test_the_registry_drives_validation(toy_task, tmp_path):
    # Pipeline parallelism only where the task supports it; the demo only where there is one.
    with pytest.raises(ConfigError, match="--task toy_regression with data, tensor or ZeRO"):
        parse_args(["--task", "toy_regression", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"])
    parse_args(["--task", "pretraining", "--train-iters", "4", "--pipeline-model-parallel-size", "2",
                "--nproc-per-node", "2", "--global-batch-size", "4", "--micro-batch-size", "2"])  # fmt: skip
    with pytest.raises(ConfigError, match="--task toy_regression has no embedded demo"):
        toy_task.demo_run()
    with pytest.raises(ConfigError, match="--task sequence_classification needs --pretrained-model-name-or-path"):
        parse_args(["--task", "sequence_classification", "--data-path", str(tmp_path)])
    with pytest.raises(ConfigError, match="--task pretraining is iteration-based"):
        parse_args(["--task", "pretraining"])
    # A user script runs its own trainer: --task is accepted beside it, and still checked for a typo.
    script = tmp_path / "s.py"
    script.write_text("")
    parse_args(["--user-script", str(script), "--task", "sequence_classification"])
    with pytest.raises(ConfigError, match="unknown task"):
        parse_args(["--user-script", str(script), "--task", "sequence_clasification"])
