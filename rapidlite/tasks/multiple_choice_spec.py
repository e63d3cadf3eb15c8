"""``--task multiple_choice``'s declaration, options and checks (torch-free; the trainer is
``multiple_choice.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class MultipleChoiceOptions:
    """Where a question's choices are."""

    choices_key: list[str] | None = flag(
        None, "multiple_choice: the column holding the list of choices, or one column per choice (ending0 ending1 ...)"
    )


def check(settings: Sections) -> None:
    if settings.data.padding_free:
        raise ConfigError(
            "--padding-free: --task multiple_choice scores each question's choices as rows of one [choices, length] "
            "block, which cannot be flattened into one row; drop --padding-free (--group-by-length works)"
        )


TASK = TaskSpec(
    name="multiple_choice",
    summary="fine-tune AutoModelForMultipleChoice on SWAG/HellaSwag-style questions (accuracy)",
    trainer="rapidlite.tasks.multiple_choice:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=MultipleChoiceOptions,
    demo="rapidlite.tasks.multiple_choice_demo:demo",
    defaults={"seq_length": 512},  # a cap: lowered to the model's limit; rows pad to the longest
    load_model_dir=True,
    check=check,
    eval_only=True,
    auto_class="AutoModelForMultipleChoice",
    inputs_per_sample=4,  # SWAG's four choices per question, each a sequence
)
