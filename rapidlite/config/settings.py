"""``Sections``: one of each settings section, the run's settings as the code below the command line reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rapidlite.config.moe import MoEConfig
from rapidlite.config.runtime import CheckpointConfig, LoggingConfig, ParallelConfig, PrecisionConfig
from rapidlite.config.sections import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PreferenceConfig,
    TaskConfig,
    TrainingConfig,
)
from rapidlite.config.tasks import find_task, registered, task_options
from rapidlite.config.topology import Batching, Topology
from rapidlite.config.vision import VisionConfig

SECTIONS: tuple[type, ...] = (
    TaskConfig,
    ModelConfig,
    DataConfig,
    TrainingConfig,
    OptimizerConfig,
    PrecisionConfig,
    ParallelConfig,
    CheckpointConfig,
    LoggingConfig,
    LoraConfig,
    PreferenceConfig,
    MoEConfig,
    VisionConfig,
)


SECTION_NAMES = (
    "task",
    "model",
    "data",
    "training",
    "optim",
    "precision",
    "parallel",
    "checkpoint",
    "logging",
    "lora",
    "preference",
    "moe",
    "vision",
)


@dataclass(frozen=True)
class Sections:
    """One of each section: the run's settings as the code below the command line reads them."""

    task: TaskConfig
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    optim: OptimizerConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    lora: LoraConfig
    preference: PreferenceConfig
    moe: MoEConfig
    vision: VisionConfig
    # The running task's own options (its TaskSpec.options, e.g. QuestionAnsweringOptions); None for a task
    # without options of its own, or a user script.
    task_options: Any = None
    # The flags the command line (or a --config file) gave; None for settings built by hand, where every flag
    # counts as given.
    explicit_flags: frozenset[str] | None = None
    # How the world is split and a step batched, as resolve derived them (rapidlite.config.topology); settings
    # built by hand get one process's unless they pass their own.
    topology: Topology = Topology()
    batching: Batching = Batching()

    @classmethod
    def of(
        cls, values: Mapping[str, Any], topology: Topology | None = None, batching: Batching | None = None
    ) -> Sections:
        """The sections of flat settings (a namespace's ``vars``): each field takes its value by name, and a
        field the values lack keeps its default (settings built by hand may name only what they need)."""
        built: dict[str, Any] = {"explicit_flags": values.get("explicit_flags")}
        built["topology"] = topology or Topology()
        built["batching"] = batching or Batching()
        for name, section in zip(SECTION_NAMES, SECTIONS, strict=True):
            built[name] = _section(section, values)
        spec = find_task(values.get("task")) if values.get("user_script") is None else None
        if spec is not None and spec.options is not None:
            built["task_options"] = task_options(spec, values)
        return cls(**built)

    def given(self, dest: str) -> bool:
        """Whether the command line gave ``dest``'s flag rather than a default (see ``explicit_flags``)."""
        return self.explicit_flags is None or dest in self.explicit_flags

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every name a section or a task's options declare: the flat settings the sections cover."""
        options = tuple(spec.options for spec in registered() if spec.options is not None)
        return frozenset(f.name for section in SECTIONS + options for f in dataclasses.fields(section))


def _section(section: type, values: Mapping[str, Any]) -> Any:
    """``section`` from flat settings: each field by name, a field the values lack at its default."""
    names = {f.name for f in dataclasses.fields(section)}
    return section(**{name: values[name] for name in names if name in values})
