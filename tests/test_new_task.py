"""A new task is one module plus one registry entry: ``tests/toy_task.py`` registered with ``register_task``
trains, plans (``--dry-run``) and evaluates (``--eval-only``) through the command line like a built-in task."""

from __future__ import annotations

import pytest

from helpers import read_metrics
from rapidlite.cli.main import main
from rapidlite.config import tasks as registry
from rapidlite.errors import ConfigError


@pytest.fixture
def word_count(request):
    spec = registry.TaskSpec(
        name="word_count",
        summary="predict a sentence's length in words (a test task)",
        trainer="toy_task:trainer_for",
        required=("--pretrained-model-name-or-path",),
        defaults={"seq_length": 8},
        eval_only=True,
        auto_class="AutoModelForSequenceClassification",
    )
    registry.register_task(spec)
    request.addfinalizer(lambda: registry.TASKS.pop(spec.name))
    return spec


@pytest.fixture
def tiny_encoder(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=1,
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(tmp_path / "encoder")
    return str(tmp_path / "encoder")


def test_a_registered_task_trains_plans_and_evaluates(word_count, tiny_encoder, tmp_path, capsys, log_lines):
    base = ["--task", "word_count", "--pretrained-model-name-or-path", tiny_encoder, "--micro-batch-size", "8"]
    assert main([*base, "--epochs", "2", "--lr", "1e-3", "--save", str(tmp_path / "run")]) == 0
    records = read_metrics(tmp_path / "run")
    evaluations = [r for r in records if "mae" in r]
    assert len(evaluations) == 2 and all(r["mae"] >= 0 for r in evaluations)
    assert any("loss" in r and "iteration" in r for r in records)

    capsys.readouterr()
    assert main([*base, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    # The spec's model class is built on meta, at the spec's default length (the task's default, not given).
    assert "predicted memory per rank" in plan and "sequence length 8 (the task's default" in plan

    log_lines.clear()
    assert main([*base, "--eval-only"]) == 0
    assert any("evaluation (validation)" in line and "mae" in line for line in log_lines), log_lines
    assert not any("iteration:" in line and "loss:" in line for line in log_lines)  # nothing trained


def test_a_task_name_is_registered_once(word_count):
    with pytest.raises(ConfigError, match="task 'word_count' is registered already"):
        registry.register_task(word_count)
