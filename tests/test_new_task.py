"""A new task is one module plus one registry entry: ``tests/toy_task.py`` registered with ``register_task``
trains, plans (``--dry-run``) and evaluates (``--eval-only``) through the command line like a built-in task, and
its own option is a flag of the command line, of ``--help`` and of ``--config`` files, refused under another task."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import toy_task

from helpers import read_metrics
from rapidlite.cli.main import main
from rapidlite.config import tasks as registry
from rapidlite.config.fields import flag
from rapidlite.config.parser import build_parser
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args


@pytest.fixture
def word_count(request):
    spec = registry.TaskSpec(
        name="word_count",
        summary="predict a sentence's length in words (a test task)",
        trainer="toy_task:trainer_for",
        required=("--pretrained-model-name-or-path",),
        options=toy_task.WordCountOptions,
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


def test_a_registered_tasks_option_reaches_its_trainer(word_count, tiny_encoder, tmp_path):
    base = ["--task", "word_count", "--pretrained-model-name-or-path", tiny_encoder, "--micro-batch-size", "8"]
    assert main([*base, "--epochs", "1", "--train-sentences", "16", "--save", str(tmp_path / "run")]) == 0
    trained = [r["iteration"] for r in read_metrics(tmp_path / "run") if "loss" in r and "iteration" in r]
    assert max(trained) == 2  # 16 sentences in micro-batches of 8, not the default 64

    config = parse_args([*base, "--train-sentences", "16"])
    assert config.sections.task_options == toy_task.WordCountOptions(train_sentences=16)
    assert config.train_sentences == 16  # the flat view get_args() returns
    (tmp_path / "run.yaml").write_text("train-sentences: 24\n")
    assert parse_args([*base, "--config", str(tmp_path / "run.yaml")]).sections.task_options.train_sentences == 24


def test_a_registered_tasks_option_is_its_own(word_count, tiny_encoder):
    group = next(g for g in build_parser()._action_groups if g.title == "--task word_count options")
    assert [a.dest for a in group._group_actions] == ["train_sentences"]
    refused = "^--train-sentences: --task pretraining does not use it \\(--task word_count's\\); drop the flag$"
    with pytest.raises(ConfigError, match=refused):
        parse_args(["--task", "pretraining", "--train-iters", "2", "--train-sentences", "16"])
    taken = registry.TaskSpec(name="char_count", summary="", trainer="toy_task:trainer_for", options=Clashing)
    with pytest.raises(ConfigError, match="its option 'train_sentences' is --task word_count's already, of another"):
        registry.register_task(taken)
    assert "char_count" not in registry.task_names()


@dataclass(frozen=True)
class Clashing:
    """An option named as word_count's, of another type: two tasks may share an option only as one flag."""

    train_sentences: str = flag("all", "which sentences")
