"""``--task reward_model``'s declaration and checks (torch-free; the trainer is ``reward_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError
from rapidlite.tasks.dpo_spec import SEQ_LENGTH

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class RewardModelOptions:
    """TRL's ``RewardConfig`` name for the one option of its loss beyond the margin column."""

    center_rewards_coefficient: float | None = flag(
        None,
        "reward_model: add this weight x mean((r_chosen + r_rejected)^2) to the loss, so that the rewards stay "
        "centred on 0 (TRL's; off by default)",
    )


def check(settings: Sections) -> None:
    coefficient = settings.task_options.center_rewards_coefficient
    if coefficient is not None and coefficient < 0:
        raise ConfigError(f"--center-rewards-coefficient {coefficient:g}: must be 0 or more")
    if settings.data.padding_free:
        raise ConfigError(
            "--padding-free: --task reward_model reads each sequence's score at its last token, which a packed row "
            "does not mark; drop --padding-free (--group-by-length also cuts padding)"
        )


TASK = TaskSpec(
    name="reward_model",
    summary="train AutoModelForSequenceClassification to score chosen above rejected responses (reward model)",
    trainer="rapidlite.tasks.reward_model:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=RewardModelOptions,
    defaults={"seq_length": SEQ_LENGTH},
    load_model_dir=True,
    check=check,
    # Its loss has no reference, beta or prompt cut (a row longer than --max-length is dropped).
    ignored=("preference",),
    eval_only=True,
    demo="rapidlite.tasks.reward_model_demo:demo",
    auto_class="AutoModelForSequenceClassification",
    inputs_per_sample=2,  # the chosen and the rejected sequence of a pair
)
