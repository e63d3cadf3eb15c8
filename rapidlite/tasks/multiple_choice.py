"""``--task multiple_choice``: fine-tune ``AutoModelForMultipleChoice`` on SWAG/HellaSwag-style questions.

The black box is an ordinary ``Finetuner`` subclass, the shape of Hugging Face's ``run_swag``: each row's context
is paired with each of its N choices (``rapidlite.data.multiple_choice``), the model scores the N sequences and a
cross-entropy over the N scores trains it. The forward step returns ``(loss_sum, rows)``, so the loss is the
mean over the rows of the whole global batch. Evaluation gathers every rank's predictions and logs ``accuracy``
(torchmetrics) and the mean ``loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.multiple_choice import MultipleChoiceCollator, build_multiple_choice_data
from rapidlite.data.tabular import load_raw_datasets
from rapidlite.evaluation.metrics import multiple_choice_accuracy
from rapidlite.models.hf import (
    load_error,
    load_hf_model,
    sequence_length,
    tokenizer_and_config,
)
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.trainer import Finetuner


def load_multiple_choice_model(name: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForMultipleChoice`` from ``name`` (a fresh scoring head when the checkpoint has none);
    attention through SDPA where the model class has it."""
    from transformers import AutoModelForMultipleChoice

    try:
        return load_hf_model(
            AutoModelForMultipleChoice.from_pretrained, name, new_head="multiple-choice head", **kwargs
        )
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("multiple-choice model", name, e) from None


class MultipleChoiceFinetuner(Finetuner):
    """Multiple choice: one score per (context, choice) sequence, a softmax over a row's choices."""

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        self.tokenizer, config = tokenizer_and_config(settings.model.pretrained_model_name_or_path, self.logger)
        seq_length = sequence_length(
            settings.data.seq_length, self.tokenizer, config=config, explicit=settings.given("seq_length")
        )
        with hf_datasets_progress(self.show_progress):
            raw = load_raw_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
            self.data = build_multiple_choice_data(
                raw,
                self.tokenizer,
                seq_length,
                text_keys=settings.data.text_keys,
                choices_key=settings.task_options.choices_key,
                label_key=settings.data.label_key,
            )
        d = self.data
        valid = len(d.validation) if d.validation is not None else 0
        self.logger.info(
            f"data: {len(d.train)} train / {valid} validation questions with {d.num_choices} choices | context "
            f"{' + '.join(d.layout.context)}, choices {', '.join(d.layout.choices)}, label {d.layout.label}"
            f"{f' | {d.truncated} choice sequences cut at --seq-length {seq_length}' if d.truncated else ''}"
        )
        test = d.test
        if test is not None and not any(label >= 0 for label in test["labels"]):
            test = None  # unlabelled test split (HellaSwag's): nothing to score
        return d.train, d.validation, test, MultipleChoiceCollator(self.tokenizer.pad_token_id or 0)

    def model_optimizer_lr_scheduler_provider(self):
        model = load_multiple_choice_model(
            self.settings.model.pretrained_model_name_or_path,
            evaluating=self.settings.training.eval_only,
            **self.pretrained_load_kwargs(),
        )
        return model, None, None

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's accuracy: chance, what the demo is measured against
        super().begin_training()

    def _scores(self, batch: dict[str, torch.Tensor], model: torch.nn.Module) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs).logits.float()

    def run_forward_step(self, batch, model):
        labels = batch["labels"]
        loss_sum = F.cross_entropy(self._scores(batch, model), labels, reduction="sum")
        return loss_sum, labels.shape[0]

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, float]:
        # Whole-batch tensors are gathered (the engine drops the rows that pad the ranks' last batches), then
        # unlabelled rows are filtered out.
        preds, labels, losses = [], [], []
        for batch in eval_dataloader:
            scores = self._scores(batch, model[0])
            target = batch["labels"]
            preds.append(self.gather(scores.argmax(dim=-1)))
            labels.append(self.gather(target))
            losses.append(self.gather(F.cross_entropy(scores, target.clamp(min=0), reduction="none")))
        preds_t, labels_t, losses_t = torch.cat(preds), torch.cat(labels), torch.cat(losses)
        keep = labels_t >= 0
        metrics = {"accuracy": multiple_choice_accuracy(preds_t[keep], labels_t[keep])}
        metrics["loss"] = float(losses_t[keep].double().mean()) if keep.any() else float("nan")
        return metrics


def trainer_for(settings: Sections) -> type[MultipleChoiceFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return MultipleChoiceFinetuner
