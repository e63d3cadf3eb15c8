"""``--task token_classification``'s declaration and options (torch-free; the trainer is
``token_classification.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec


@dataclass(frozen=True)
class TokenClassificationOptions:
    """Which sub-tokens of a word train on its tag."""

    label_all_tokens: bool = flag(
        False,
        "token_classification: every sub-token of a word trains on its tag (B- as I- after the first), not only the "
        "first",
    )


TASK = TaskSpec(
    name="token_classification",
    summary="fine-tune AutoModelForTokenClassification on tagged words, NER or POS (entity F1, accuracy)",
    trainer="rapidlite.tasks.token_classification:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=TokenClassificationOptions,
    demo="rapidlite.tasks.token_classification_demo:demo",
    defaults={"seq_length": 128},
    load_model_dir=True,
    eval_only=True,
    auto_class="AutoModelForTokenClassification",
)
