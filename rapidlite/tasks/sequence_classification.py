"""``--task sequence_classification``: fine-tune ``AutoModelForSequenceClassification`` on tabular text.

The black box is an ordinary ``Finetuner`` subclass: everything here is reachable from a user script.
"""

from __future__ import annotations

from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.data.tabular import load_raw_datasets
from rapidlite.data.text_classification import build_text_classification_data
from rapidlite.evaluation.metrics import classification_metrics, regression_metrics
from rapidlite.models.hf import (
    head_labels,
    load_with_head,
    refuse_unknown_labels,
    sequence_length,
    tokenizer_and_config,
)
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.trainer import Finetuner


def load_classifier(name: str, num_labels: int, id2label: dict[int, str], **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForSequenceClassification`` from ``name`` with a fresh head for these labels (or, with
    ``problem_type="regression"`` in ``kwargs``, one score); attention through SDPA where the model class has it.
    ``kwargs``: more ``from_pretrained`` arguments."""
    from transformers import AutoModelForSequenceClassification

    return load_with_head(
        AutoModelForSequenceClassification.from_pretrained, name, "model", num_labels, id2label, **kwargs
    )


class SequenceClassificationFinetuner(Finetuner):
    """Text (or text pair) classification; labels may be ints or strings (mapped and saved in the config)."""

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        self.tokenizer, config = tokenizer_and_config(settings.model.pretrained_model_name_or_path, self.logger)
        explicit = settings.given("seq_length")
        seq_length = sequence_length(settings.data.seq_length, self.tokenizer, config=config, explicit=explicit)
        with hf_datasets_progress(self.show_progress):  # reading and tokenizing: datasets' bars with rate and ETA
            raw = load_raw_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
            self.data = build_text_classification_data(
                raw,
                self.tokenizer,
                seq_length=seq_length,
                text_keys=settings.data.text_keys,
                label_key=settings.data.label_key,
                label_order=head_labels(config),
                # A regression model (STS-B's) scores whole-number labels too, rather than a fresh class head.
                scores=getattr(config, "problem_type", None) == "regression",
            )
        label_column = raw["train"].features[self.data.label_key]
        if settings.training.eval_only and getattr(label_column, "dtype", None) in ("string", "large_string"):
            refuse_unknown_labels(
                head_labels(config),
                list(self.data.id2label.values()),
                settings.model.pretrained_model_name_or_path,
                f"--label-key {self.data.label_key}",
            )
        self.logger.info(
            f"data: {len(self.data.train)} train / "
            f"{len(self.data.validation) if self.data.validation is not None else 0} validation "
            f"examples, text columns {list(self.data.text_keys)}, "
            f"{'float scores (regression, MSE)' if self.data.regression else f'{self.data.num_labels} labels'}, "
            f"cut at --seq-length {seq_length}"
        )
        for split, rows in self.data.moved.items():
            self.logger.info(
                f"data: moved {rows} {split} rows to train: their label has no train rows (--split carved {split} "
                "out of the train data, and a class must be trained to be scored)"
            )
        if self.data.follows_head:
            self.logger.info(f"data: the model's head has these labels; its ids are kept ({self.data.id2label})")
        for split, (dropped, rows) in self.data.dropped.items():
            self.logger.warning(
                f"data: dropped {dropped} of {rows} {split} rows whose label ({self.data.label_key}) is missing"
                f"{'' if self.data.regression else ' or negative'}"
            )
        test = self.data.test
        if test is not None and not any(
            label >= 0 or self.data.regression and label == label for label in test["labels"]
        ):
            test = None  # unlabelled test split (GLUE style): nothing to score
        return self.data.train, self.data.validation, test, self.data.collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        id2label = {int(k): str(v) for k, v in self.data.id2label.items()}
        kwargs = self.pretrained_load_kwargs()
        if self.data.regression:
            kwargs["problem_type"] = "regression"  # one output and MSE, as run_glue trains STS-B
        model = load_classifier(
            self.settings.model.pretrained_model_name_or_path, self.data.num_labels, id2label, **kwargs
        )
        if getattr(model.config, "pad_token_id", None) is None and self.tokenizer.pad_token_id is not None:
            model.config.pad_token_id = self.tokenizer.pad_token_id  # GPT-style models need it to pool
        return model, None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, float]:
        # Whole-batch tensors are gathered (the engine drops the rows that pad the ranks' last batches),
        # then unlabelled rows are filtered out.
        model = model[0]
        if self.data.regression:
            return self._regression_metrics(model, eval_dataloader)
        preds, labels, losses = [], [], []
        for batch in eval_dataloader:
            logits = model(**batch).logits.float()
            target = batch["labels"]
            per_sample = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
            preds.append(self.gather(logits.argmax(dim=-1)))
            labels.append(self.gather(target))
            losses.append(self.gather(per_sample))
        preds_t, labels_t, losses_t = torch.cat(preds), torch.cat(labels), torch.cat(losses)
        keep = labels_t >= 0
        metrics = classification_metrics(preds_t[keep], labels_t[keep], self.data.num_labels)
        metrics["loss"] = float(losses_t[keep].double().mean()) if keep.any() else float("nan")
        return metrics

    def _regression_metrics(self, model, eval_dataloader) -> dict[str, float]:
        scores, labels = [], []
        for batch in eval_dataloader:
            scores.append(self.gather(model(**batch).logits.float().squeeze(-1)))
            labels.append(self.gather(batch["labels"].float()))
        scores_t, labels_t = torch.cat(scores), torch.cat(labels)
        keep = ~labels_t.isnan()  # unlabelled test rows
        return regression_metrics(scores_t[keep], labels_t[keep])


def trainer_for(settings: Sections) -> type[SequenceClassificationFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return SequenceClassificationFinetuner
