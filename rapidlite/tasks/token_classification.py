"""``--task token_classification``: fine-tune ``AutoModelForTokenClassification`` to tag words (NER, POS, chunks).

The black box is an ordinary ``Finetuner`` subclass. Words are tokenized with a fast tokenizer and each word's tag
goes on its first sub-token (``rapidlite.data.token_classification``); the forward step returns ``(loss_sum,
num_items)`` so the loss is token-exact over micro-batches and ranks. Evaluation scores the word-level
predictions (each word's first sub-token), gathered from every rank, as seqeval does by default: entity-level
precision, recall and F1, overall and per entity type, and tag accuracy; tag sets without B-/I- prefixes (POS
tags) get accuracy alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.token_classification import (
    IGNORE,
    build_token_classification_data,
    load_token_datasets,
    most_frequent_tag_baseline,
)
from rapidlite.evaluation.metrics import is_entity_tagset, tagging_metrics
from rapidlite.models.hf import (
    ensure_pad_token,
    head_labels,
    load_config,
    load_tokenizer,
    load_with_head,
    refuse_unknown_labels,
    sequence_length,
)
from rapidlite.models.losses import maybe_loss_parallel
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.trainer import Finetuner

# Byte-level BPE tokenizers read pre-split words only with a space before each (run_ner's list).
_PREFIX_SPACE_MODELS = ("bloom", "gpt2", "roberta", "deberta", "longformer", "bart")


def load_word_tokenizer(name: str, config: Any) -> Any:
    """The tokenizer of ``name``, set to read pre-split words: a byte-level BPE tokenizer (RoBERTa, GPT-2, ...)
    marks a word by the space before it, so each word gets one (``add_prefix_space``), as run_ner does."""
    prefix_space = {"add_prefix_space": True} if getattr(config, "model_type", None) in _PREFIX_SPACE_MODELS else {}
    return load_tokenizer(name, **prefix_space)


def load_token_classifier(name: str, id2label: dict[int, str], **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForTokenClassification`` from ``name`` with a head for these tags (a fresh one unless the
    model's has as many); attention through SDPA where the model class has it. ``kwargs``: more
    ``from_pretrained`` arguments."""
    from transformers import AutoModelForTokenClassification

    what, labels = "token classification model", len(id2label)
    return load_with_head(AutoModelForTokenClassification.from_pretrained, name, what, labels, id2label, **kwargs)


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "word_starts")}
    return model(**inputs).logits


class TokenClassificationFinetuner(Finetuner):
    """Word tagging: one tag per word, the loss and the scores on each word's first sub-token (with
    ``--label-all-tokens`` the loss on every sub-token)."""

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        name = settings.model.pretrained_model_name_or_path
        config = load_config(name)
        self.tokenizer = load_word_tokenizer(name, config)
        if (padding := ensure_pad_token(self.tokenizer, config, name)) is not None:
            self.logger.info(f"data: {padding}")
        explicit = settings.given("seq_length")
        self.seq_length = seq_length = sequence_length(
            settings.data.seq_length, self.tokenizer, config=config, explicit=explicit
        )
        with hf_datasets_progress(self.show_progress):
            raw = load_token_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
        self.data = d = build_token_classification_data(
            raw,
            self.tokenizer,
            seq_length,
            text_keys=settings.data.text_keys,
            label_key=settings.data.label_key,
            label_all_tokens=settings.task_options.label_all_tokens,
            label_order=head_labels(config),
        )
        if settings.training.eval_only:
            refuse_unknown_labels(
                head_labels(config),
                list(d.id2label.values()),
                settings.model.pretrained_model_name_or_path,
                "tags",
            )
        self.entity_scores = is_entity_tagset(list(d.id2label.values()))
        for split, count in d.moved.items():
            self.logger.info(
                f"data: moved {count} {split} sentences to train: a tag of theirs has no train sentence (--split "
                f"carved {split} out of the train data, and a tag must be trained to be scored)"
            )
        tags = list(d.id2label.values())
        shown = ", ".join(tags[:12]) + (", ..." if len(tags) > 12 else "")
        sizes = [f"{len(ds)} {split}" for split in ("train", "validation", "test") if (ds := getattr(d, split))]
        empty = sum(d.empty_words.values())
        self.logger.info(
            f"data: {' / '.join(sizes)} sentences, words {d.words_key}, tags {d.tags_key}: {len(tags)} ({shown}); "
            f"{sum(d.truncated.values())} sentences truncated to --seq-length {seq_length} "
            f"({', '.join(f'{n} {s}' for s, n in d.truncated.items())}: their words beyond it are neither trained "
            "nor scored)"
            + (f"; {empty} words the tokenizer turns into no token (neither trained nor scored)" if empty else "")
        )
        if "test" in raw and d.test is None:
            self.logger.info(f"data: the test split has no {d.tags_key} column: it is not scored")
        if not self.entity_scores:
            self.logger.info(
                f"evaluation: tag accuracy only; entity precision/recall/F1 are not applicable: the tags ({shown}) "
                "are not 'O' and B-/I-/E-/S- prefixed entity types"
            )
        if d.validation is not None and self.engine.is_main_process:
            valid = d.sentences["validation"]
            guess = most_frequent_tag_baseline(d.sentences["train"], valid.words)
            self.logger.info(
                "baseline (each word's most frequent train tag) on validation: "
                + ", ".join(f"{k} {v:.4f}" for k, v in self._score(valid.tags, guess).items() if "_" not in k)
            )
        return d.train, d.validation, d.test, d.collate_fn

    def _score(self, true_ids: list[list[int]], pred_ids: list[list[int]]) -> dict[str, Any]:
        names = self.data.id2label
        true = [[names[i] for i in row] for row in true_ids]
        pred = [[names[i] for i in row] for row in pred_ids]
        return tagging_metrics(true, pred, entity=self.entity_scores)

    def model_optimizer_lr_scheduler_provider(self):
        model = load_token_classifier(
            self.settings.model.pretrained_model_name_or_path, self.data.id2label, **self.pretrained_load_kwargs()
        )
        if getattr(model.config, "pad_token_id", None) is None and self.tokenizer.pad_token_id is not None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model, None, None

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's scores: what the demo's learning is measured against
        super().begin_training()

    def run_forward_step(self, batch, model):
        labels = batch["labels"]
        logits = _logits(model, batch)
        with maybe_loss_parallel(logits):
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
            )
        if hasattr(loss_sum, "full_tensor"):
            loss_sum = loss_sum.full_tensor()
        return loss_sum, self.count_items(batch)

    def count_items(self, batch: dict[str, Any]) -> int:
        """The labelled tokens the loss sums over (a word's first piece; the rest and padding are ignored)."""
        return int((batch["labels"] != IGNORE).sum().item())

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        # Whole-batch tensors are gathered (the engine drops the rows that pad the ranks' last batches), padded to
        # --seq-length so every rank's have one shape; word-level tags are read off the first sub-tokens.
        model = model[0]
        width = self.seq_length
        loss_sums, counts, true_rows, pred_rows = [], [], [], []
        for batch in eval_dataloader:
            logits = _logits(model, batch)
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            logits = logits.float()
            labels = batch["labels"]
            token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
            loss_sums.append(self.gather(token_loss.double().sum(dim=1)))
            counts.append(self.gather((labels != IGNORE).sum(dim=1)))
            starts = batch["word_starts"].bool()
            pad = (0, width - labels.shape[1])
            true_rows.append(self.gather(F.pad(labels.masked_fill(~starts, IGNORE), pad, value=IGNORE)))
            pred_rows.append(self.gather(F.pad(logits.argmax(dim=-1).masked_fill(~starts, IGNORE), pad, value=IGNORE)))
        true_t, pred_t = torch.cat(true_rows).cpu(), torch.cat(pred_rows).cpu()
        keep = true_t != IGNORE
        true_ids = [row[mask].tolist() for row, mask in zip(true_t, keep, strict=True)]
        pred_ids = [row[mask].tolist() for row, mask in zip(pred_t, keep, strict=True)]
        metrics = self._score(true_ids, pred_ids)
        metrics["loss"] = float(torch.cat(loss_sums).sum() / torch.cat(counts).sum().clamp(min=1))
        return metrics


def trainer_for(settings: Sections) -> type[TokenClassificationFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return TokenClassificationFinetuner
