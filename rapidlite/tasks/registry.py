"""The black-box tasks ``--task`` can name: what each runs, what it needs, what it supports.

One ``TaskSpec`` per task, looked up by name. The command line (``rapidlite.cli``) and flag validation
(``rapidlite.arguments``) consult this table and nothing else, so adding a task is one module under
``rapidlite/tasks/`` plus one entry here. The table is torch-free and imports no task module: trainers and
demos are named by ``"module:attribute"`` and imported only when a run needs them, so ``--help`` and flag
errors stay fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rapidlite.errors import ConfigError


def _import(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class TaskSpec:
    """A black-box task.

    ``trainer``: ``"module:function"`` returning the trainer class for the parsed flags. ``required``: flags
    the task cannot run without (unless ``--demo`` or an embedded default fills them). ``iteration_based``:
    the run's length is ``--train-iters``. ``pipeline``: pipeline parallelism is supported (fixed-length
    samples). ``demo``: ``("module:DEMO_ARGS", "module:prepare")`` of the embedded offline run, whose flags
    come before the user's so any flag given wins; ``demo_without_data``: the embedded run also starts when
    ``--data-path`` is absent. ``load_model_dir``: a Hugging Face model directory given to ``--load`` is the
    model to start from. ``check``: task-specific validation of the parsed flags (torch-free).
    """

    name: str
    summary: str
    trainer: str
    required: tuple[str, ...] = ()
    iteration_based: bool = False
    pipeline: bool = False
    demo: tuple[str, str] | None = None
    demo_without_data: bool = False
    load_model_dir: bool = False
    check: Callable[[Any], None] | None = None

    def trainer_class(self, args: Any) -> type:
        return _import(self.trainer)(args)

    def demo_run(self) -> tuple[list[str], Callable[[Any], None]]:
        """``(flags, prepare)`` of the embedded offline run."""
        if self.demo is None:
            raise ConfigError(f"--task {self.name} has no embedded demo; give its data and model flags")
        flags, prepare = self.demo
        return list(_import(flags)), _import(prepare)


def _check_pretraining(args: Any) -> None:
    if args.data_path is not None and args.tokenizer_type is None and args.pretrained_model_name_or_path is None:
        raise ConfigError(
            "--task pretraining needs the tokenizer the data was preprocessed with: give --tokenizer-type "
            "(with --vocab-file/--merge-file/--tokenizer-model/--vocab-size) or --pretrained-model-name-or-path"
        )


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="sequence_classification",
            summary="fine-tune AutoModelForSequenceClassification on labelled text (accuracy, F1)",
            trainer="rapidlite.tasks.sequence_classification:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo=("rapidlite.tasks.demo:DEMO_ARGS", "rapidlite.tasks.demo:prepare_demo"),
            load_model_dir=True,
        ),
        TaskSpec(
            name="pretraining",
            summary="pretrain a GPT (built-in or a causal config) or BERT on Megatron mmap data",
            trainer="rapidlite.tasks.pretraining:pretrainer_for",
            iteration_based=True,
            pipeline=True,
            demo=(
                "rapidlite.tasks.pretraining_demo:DEMO_ARGS",
                "rapidlite.tasks.pretraining_demo:prepare_pretraining_demo",
            ),
            demo_without_data=True,
            check=_check_pretraining,
        ),
    )
}


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> TaskSpec:
    """The task ``--task name`` names; an unknown name is one line listing the known ones."""
    spec = TASKS.get(name)
    if spec is None:
        raise ConfigError(f"--task {name}: unknown task; choose one of {', '.join(TASKS)}")
    return spec
