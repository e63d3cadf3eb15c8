"""``--task sequence_classification``'s declaration (torch-free; the trainer is ``sequence_classification.py``)."""

from __future__ import annotations

from rapidlite.config.tasks import TaskSpec

TASK = TaskSpec(
    name="sequence_classification",
    summary="fine-tune AutoModelForSequenceClassification on text (accuracy, F1; scores: Pearson, Spearman)",
    trainer="rapidlite.tasks.sequence_classification:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    demo="rapidlite.tasks.demo:demo",
    defaults={"seq_length": 128},
    load_model_dir=True,
    eval_only=True,
    auto_class="AutoModelForSequenceClassification",
)
