"""``--task reward_model``'s declaration and checks (torch-free; the trainer is ``reward_model.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError
from rapidlite.tasks.dpo_spec import SEQ_LENGTH

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


def check(settings: Sections) -> None:
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
    defaults={"seq_length": SEQ_LENGTH},
    load_model_dir=True,
    check=check,
    # Its loss has no reference, beta or prompt cut (a row longer than --max-length is dropped).
    ignored=("preference",),
    eval_only=True,
    auto_class="AutoModelForSequenceClassification",
    inputs_per_sample=2,  # the chosen and the rejected sequence of a pair
)
