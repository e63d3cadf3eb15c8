"""``--task masked_lm``'s declaration, options and checks (torch-free; the trainer is ``masked_lm.py``).

``--mlm-probability`` is shared with BERT pretraining (``DataConfig.mask_prob``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class MaskedLmOptions:
    """How text becomes samples and how masks are drawn."""

    whole_word_masking: bool = flag(
        False, "masked_lm: mask every sub-token of a chosen word together (needs a fast tokenizer)"
    )
    line_by_line: bool = flag(
        False, "masked_lm: one sample per document (cut at --seq-length) instead of blocks of concatenated text"
    )


def check(settings: Sections) -> None:
    if not 0 < settings.data.mask_prob < 1:
        raise ConfigError(f"--mlm-probability {settings.data.mask_prob:g}: must be in (0, 1); 0.15 is usual")
    if settings.data.padding_free:
        raise ConfigError(
            "--padding-free: --task masked_lm draws each sample's masks over its own row of tokens (and grouped "
            "blocks have no padding to remove); drop --padding-free"
        )


TASK = TaskSpec(
    name="masked_lm",
    summary="adapt AutoModelForMaskedLM (BERT, RoBERTa, ...) to raw text of a domain (perplexity)",
    trainer="rapidlite.tasks.masked_lm:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=MaskedLmOptions,
    demo="rapidlite.tasks.masked_lm_demo:demo",
    defaults={"seq_length": 512},  # a cap: lowered to the model's limit
    load_model_dir=True,
    check=check,
    eval_only=True,
    auto_class="AutoModelForMaskedLM",
    chunked_loss="sum",
    scored_share=lambda settings: settings.data.mask_prob,  # the masked positions
)
