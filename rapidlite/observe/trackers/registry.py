"""The trackers by name, and ``--report-to`` resolved once into the run's list of them.

``--report-to`` (Hugging Face's name: comma-separated tracker names, ``none`` or ``all``) is the one switch; a
tracker's own flag (``--tensorboard-dir``, ``--wandb-project``, ``--mlflow-experiment``) is a spelling of it that
also says where. Each tracker's library is looked for before anything runs (without importing it: flag errors
stay fast), and a missing one is one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rapidlite.config.runtime import LoggingConfig
from rapidlite.errors import ConfigError
from rapidlite.observe.trackers.base import Tracker, Trackers
from rapidlite.observe.trackers.mlflow import MlflowTracker
from rapidlite.observe.trackers.tensorboard import TensorBoardTracker
from rapidlite.observe.trackers.wandb import WandbTracker


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker as the command line knows it: its class, its title, the flag that implies it (the field of
    ``LoggingConfig``), the module it needs and the extra that installs it (None: a dependency)."""

    cls: type[Tracker]
    title: str
    implied_by: str
    module: str
    extra: str | None


TRACKERS: dict[str, TrackerSpec] = {
    spec.cls.name: spec
    for spec in (
        TrackerSpec(TensorBoardTracker, "TensorBoard", "tensorboard_dir", "tensorboard", None),
        TrackerSpec(WandbTracker, "Weights & Biases", "wandb_project", "wandb", "wandb"),
        TrackerSpec(MlflowTracker, "MLflow", "mlflow_experiment", "mlflow", "mlflow"),
    )
}
WANDB_ONLY = ("wandb_entity", "wandb_run_name", "wandb_mode")  # what W&B alone reads


def installed(spec: TrackerSpec) -> bool:
    return importlib.util.find_spec(spec.module) is not None


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def resolve_trackers(cfg: LoggingConfig) -> tuple[str, ...]:
    """The trackers the run reports to, in the registry's order: ``--report-to``'s, and those a tracker's own
    flag implies; ``all``: every tracker whose library is installed. Refuses an unknown name, a tracker flag
    beside ``--report-to none``, a W&B option without W&B, and a tracker whose library is missing."""
    given = [n.strip().lower() for n in (cfg.report_to or "").split(",") if n.strip()]
    words = {"none", "all"}
    unknown = [n for n in given if n not in TRACKERS and n not in words]
    if unknown:
        raise ConfigError(
            f"--report-to {cfg.report_to}: unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)} "
            "(comma-separated), none or all"
        )
    if len(given) > 1 and words & set(given):
        raise ConfigError(f"--report-to {cfg.report_to}: none and all stand alone; pass one of them, or names")
    implied = [name for name, spec in TRACKERS.items() if getattr(cfg, spec.implied_by) is not None]
    if given == ["none"] and implied:
        flag = flag_name(TRACKERS[implied[0]].implied_by)
        raise ConfigError(f"{flag} reports to {TRACKERS[implied[0]].title}, but --report-to none: drop one of them")
    if cfg.wandb_project is not None and not cfg.wandb_project.strip():
        raise ConfigError("--wandb-project: give the W&B project's name")
    if cfg.mlflow_experiment is not None and not cfg.mlflow_experiment.strip():
        raise ConfigError("--mlflow-experiment: give the MLflow experiment's name")
    if given == ["all"]:
        chosen = {name for name, spec in TRACKERS.items() if installed(spec)} | set(implied)
    else:
        chosen = (set(given) - words) | set(implied)
    for name, spec in TRACKERS.items():
        if name in chosen and not installed(spec):
            asked = flag_name(spec.implied_by) if name in implied else f"--report-to {name}"
            raise ConfigError(
                f"{asked} reports to {spec.title}, which is not installed: pip install 'rapidlite[{spec.extra}]'"
            )
    if "wandb" not in chosen:
        extra = [flag_name(f) for f in WANDB_ONLY if getattr(cfg, f) is not None]
        if extra:
            raise ConfigError(
                f"{extra[0]} configures Weights & Biases reporting: add --wandb-project NAME (or --report-to wandb)"
            )
    return tuple(name for name in TRACKERS if name in chosen)


def build_trackers(cfg: LoggingConfig) -> Trackers:
    """The run's trackers (``cfg.trackers``, resolved), not yet started."""
    return Trackers(TRACKERS[name].cls(cfg) for name in cfg.trackers)
