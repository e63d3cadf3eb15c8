"""``--task question_answering``'s declaration, options and checks (torch-free; the trainer is
``question_answering.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections

SEQ_LENGTH = 384  # run_qa's --max_seq_length


@dataclass(frozen=True)
class QuestionAnsweringOptions:
    """How long contexts become windows, and how answers are read back from the logits (run_qa's names)."""

    doc_stride: int = flag(
        128, "question_answering: tokens shared by consecutive windows of a context longer than --seq-length"
    )
    max_answer_length: int = flag(30, "question_answering: the longest answer predicted, in tokens")
    n_best_size: int = flag(20, "question_answering: start and end logits searched per window for the best answer")
    version_2_with_negative: bool = flag(
        False, "question_answering: SQuAD v2 data, where some questions have no answer"
    )
    null_score_diff_threshold: float = flag(
        0.0, "question_answering (v2): answer nothing when the null score beats the best span's by more than this"
    )


def check(settings: Sections) -> None:
    options: QuestionAnsweringOptions = settings.task_options
    if settings.data.padding_free:
        raise ConfigError(
            "--padding-free: question answering picks each window's answer span by a softmax over the whole window, "
            "which a row of packed windows would mix; drop --padding-free (--group-by-length also cuts padding)"
        )
    seq_length = settings.data.seq_length or SEQ_LENGTH
    for flag_name, value in (
        ("--n-best-size", options.n_best_size),
        ("--max-answer-length", options.max_answer_length),
    ):
        if value < 1:
            raise ConfigError(f"{flag_name} {value}: must be at least 1")
    if not 0 < options.doc_stride < seq_length:
        raise ConfigError(
            f"--doc-stride {options.doc_stride}: must be positive and below --seq-length {seq_length} (windows of a "
            "long context overlap by that many tokens)"
        )


TASK = TaskSpec(
    name="question_answering",
    summary="fine-tune AutoModelForQuestionAnswering on SQuAD-style extractive QA (exact match, F1)",
    trainer="rapidlite.tasks.question_answering:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=QuestionAnsweringOptions,
    demo="rapidlite.tasks.question_answering_demo:demo",
    defaults={"seq_length": SEQ_LENGTH},
    load_model_dir=True,
    check=check,
    eval_only=True,
    auto_class="AutoModelForQuestionAnswering",
)
