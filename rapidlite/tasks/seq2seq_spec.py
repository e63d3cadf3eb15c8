"""``--task seq2seq``'s declaration, options and checks (torch-free; the trainer is ``seq2seq.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import DATA_LIBRARIES, TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


DEFAULT_MAX_TARGET_LENGTH = 128  # run_summarization's --max_target_length


def max_target_length(settings: Sections) -> int:
    """The target tokens a training sample holds at most: ``--max-target-length``, else the default."""
    return settings.task_options.max_target_length or DEFAULT_MAX_TARGET_LENGTH


@dataclass(frozen=True)
class Seq2SeqOptions:
    """Translation pairs' languages, the source prefix, and the target's length and generation."""

    source_lang: str | None = flag(None, "seq2seq: the source language of translation pairs (e.g. en)")
    target_lang: str | None = flag(None, "seq2seq: the target language of translation pairs (e.g. de)")
    source_prefix: str | None = flag(None, "seq2seq: text put before every source, as T5 expects (e.g. 'summarize: ')")
    max_target_length: int | None = flag(
        None, "seq2seq: target tokens kept for training and generated at most in evaluation (default 128)"
    )
    num_beams: int | None = flag(
        None, "seq2seq: beam search width of evaluation's generation (default: the model's generation config)"
    )


def check(settings: Sections) -> None:
    options: Seq2SeqOptions = settings.task_options
    for flag_name, value in (("--max-target-length", options.max_target_length), ("--num-beams", options.num_beams)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag_name} {value}: must be at least 1")


TASK = TaskSpec(
    name="seq2seq",
    summary="fine-tune AutoModelForSeq2SeqLM (T5, BART, ...) on summaries or translations (ROUGE, BLEU)",
    trainer="rapidlite.tasks.seq2seq:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=Seq2SeqOptions,
    demo="rapidlite.tasks.seq2seq_demo:demo",
    defaults={"seq_length": 1024},  # run_summarization's --max_source_length
    load_model_dir=True,
    check=check,
    eval_only=True,
    auto_class="AutoModelForSeq2SeqLM",
    chunked_loss="sum",
    target_length=max_target_length,
    libraries=(*DATA_LIBRARIES, "torchmetrics", "rouge_score.rouge_scorer"),  # ROUGE (with nltk): about 40 MiB
)
