"""``--task kto``'s declaration and checks (torch-free; the trainer is ``kto.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag, option
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError
from rapidlite.tasks.causal_lm_spec import check_split_sequences
from rapidlite.tasks.dpo_spec import SEQ_LENGTH, preference_reference

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class KtoOptions:
    """The KL strength and the loss weights of the two labels (TRL's names and defaults); the prompt cut and the
    precomputed reference are the preference tasks' shared section."""

    beta: float = flag(0.1, "the KL penalty's strength")

    desirable_weight: float = flag(1.0, "kto: the loss weight of desirable (label true) completions")
    undesirable_weight: float = flag(1.0, "kto: the loss weight of undesirable (label false) completions")


def check(settings: Sections) -> None:
    for name, value in dataclasses.asdict(settings.task_options).items():  # beta and the two weights
        if value <= 0:
            raise ConfigError(f"{option(name)} {value}: must be positive")
    check_split_sequences(settings)
    if settings.data.group_by_length:
        raise ConfigError(
            "--group-by-length: --task kto reads its training data in order (each global batch's KL sequences are "
            "its own completions re-paired); drop --group-by-length"
        )


TASK = TaskSpec(
    name="kto",
    summary="preference-train AutoModelForCausalLM on completions labelled desirable or not (KTO)",
    trainer="rapidlite.tasks.kto:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=KtoOptions,
    defaults={"seq_length": SEQ_LENGTH},
    load_model_dir=True,
    check=check,
    eval_only=True,
    demo="rapidlite.tasks.kto_demo:demo",
    auto_class="AutoModelForCausalLM",
    reference=preference_reference,
    chunked_loss="tokens",
    eval_harness=True,
    context_parallel=True,
)
