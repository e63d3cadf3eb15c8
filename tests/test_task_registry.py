"""The task registry: --task, its checks and its demo come from one table, so a new task is one entry."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import ToyFinetuner
from rapidlite.cli.main import main
from rapidlite.config import tasks as registry
from rapidlite.config.fields import flag
from rapidlite.config.parser import build_parser
from rapidlite.config.settings import SECTIONS
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args
from rapidlite.tasks.question_answering_spec import QuestionAnsweringOptions


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
    with pytest.raises(ConfigError, match="unknown task; choose one of causal_lm, dpo, grpo, kto, masked_lm"):
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


def test_each_task_owns_its_options():
    """A task's options are declared in its own module, on no shared section, and make a --help group of their own."""
    shared = {f.name for section in SECTIONS for f in dataclasses.fields(section)}
    groups = {g.title: [a.dest for a in g._group_actions] for g in build_parser()._action_groups}
    several = registry.shared_options()
    owners: dict[str, list[str]] = {}
    for spec in registry.registered():
        if spec.options is not None:
            assert spec.options.__module__ == f"rapidlite.tasks.{spec.name}_spec"
            own = [name for name in spec.option_names() if name not in several]
            assert groups.get(f"--task {spec.name} options", []) == own
            for name in spec.option_names():
                owners.setdefault(name, []).append(spec.name)
    assert not shared & set(owners)
    assert {owners[n][0] for n in ("prompt_key", "doc_stride", "line_by_line", "choices_key", "label_all_tokens")} == {
        "causal_lm", "question_answering", "masked_lm", "multiple_choice", "token_classification"
    }  # fmt: skip
    assert (owners["num_beams"], owners["desirable_weight"]) == (["seq2seq"], ["kto"])
    # Declared by several tasks: one flag, in the group of shared options, each task with its own default.
    assert owners["loss_type"] == ["dpo", "grpo"] and owners["beta"] == ["dpo", "grpo", "kto", "rloo"]
    assert set(groups["options of several tasks"]) == set(several)


def test_the_running_tasks_options_are_typed_and_flat():
    config = parse_args(["--task", "question_answering", "--demo", "--doc-stride", "64"])
    assert config.sections.task_options == QuestionAnsweringOptions(doc_stride=64)
    assert config.doc_stride == 64  # the flat view Rapidformer-style scripts read
    assert parse_args(["--task", "sequence_classification", "--demo"]).sections.task_options is None


def test_another_tasks_option_is_refused_in_one_line(capsys):
    refused = "^--doc-stride: --task seq2seq does not use it \\(--task question_answering's\\); drop the flag$"
    with pytest.raises(ConfigError, match=refused):
        parse_args(["--task", "seq2seq", "--demo", "--doc-stride", "64"])
    parse_args(["--task", "seq2seq", "--demo", "--doc-stride", "128"])  # its default: nothing was chosen
    assert main(["--task", "masked_lm", "--demo", "--prompt-key", "question"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "rapidlite: error: --prompt-key: --task masked_lm does not use it (--task causal_lm's); drop the flag"
    ]


def test_a_tasks_option_cannot_take_a_shared_flags_name(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Clashing:
        seed: int = flag(1, "a name the shared sections have")

    spec = registry.TaskSpec(
        name="clash", summary="a test task", trainer="test_task_registry:toy_trainer", options=Clashing
    )
    monkeypatch.setitem(registry.TASKS, spec.name, spec)
    with pytest.raises(ConfigError, match="^task 'clash': its option --seed is a shared flag already"):
        parse_args(["--task", "clash"])
