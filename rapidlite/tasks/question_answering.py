"""``--task question_answering``: fine-tune ``AutoModelForQuestionAnswering`` on SQuAD-style extractive QA.

The black box is an ordinary ``Finetuner`` subclass. Questions and contexts become overlapping windows labelled
with the answer's token span (``rapidlite.data.question_answering``); evaluation gathers every window's start
and end logits from all ranks, turns them back into answer texts over each example's windows and scores them
with SQuAD's official exact match and F1 (v2: with the no-answer splits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.question_answering import (
    FEATURE_INDEX,
    POSITION_KEYS,
    build_question_answering_data,
    postprocess_predictions,
)
from rapidlite.data.tabular import load_raw_datasets
from rapidlite.evaluation.metrics import squad_v1_metrics, squad_v2_metrics
from rapidlite.models.hf import (
    load_error,
    load_hf_model,
    sequence_length,
    tokenizer_and_config,
)
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.trainer import Finetuner


def load_question_answering_model(name: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForQuestionAnswering`` from ``name`` (a fresh span head when the checkpoint has none);
    ``kwargs``: more ``from_pretrained`` arguments."""
    from transformers import AutoModelForQuestionAnswering

    try:
        return load_hf_model(AutoModelForQuestionAnswering.from_pretrained, name, new_head="span head", **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("question answering model", name, e) from None


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != FEATURE_INDEX and k not in POSITION_KEYS}


def span_losses(start_logits: torch.Tensor, end_logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each window's loss: the mean of its start and end cross-entropies over its own tokens. The model's loss
    softmaxes over the padded width too (padding scores are not masked), so it would change with how a batch is
    padded: with the micro-batch size, the ranks' shares and the padding side."""
    padding = batch["attention_mask"] == 0
    losses = []
    for logits, key in zip((start_logits, end_logits), POSITION_KEYS, strict=True):
        masked = logits.float().masked_fill(padding, torch.finfo(torch.float32).min)
        losses.append(F.cross_entropy(masked, batch[key], reduction="none"))
    return (losses[0] + losses[1]) / 2


class QuestionAnsweringFinetuner(Finetuner):
    """Extractive question answering: the model scores each token as the answer's start and end."""

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        self.tokenizer, config = tokenizer_and_config(settings.model.pretrained_model_name_or_path, self.logger)
        explicit = settings.given("seq_length")
        seq_length = sequence_length(settings.data.seq_length, self.tokenizer, config=config, explicit=explicit)
        with hf_datasets_progress(self.show_progress):
            raw = load_raw_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
            # --eval-only of data without a validation split scores its train split: it needs the windows' metadata.
            evaluated = ("validation", "test", "train") if settings.training.eval_only else ("validation", "test")
            self.data = build_question_answering_data(
                raw,
                self.tokenizer,
                seq_length=seq_length,
                doc_stride=settings.task_options.doc_stride,
                text_keys=settings.data.text_keys,
                label_key=settings.data.label_key,
                version_2_with_negative=settings.task_options.version_2_with_negative,
                eval_splits=evaluated,
            )
        d = self.data
        counts = ", ".join(f"{name} {d.rows[name]} questions in {d.windows[name]} windows" for name in d.rows)
        task = settings.task_options
        self.logger.info(
            f"data: {d.columns.describe()}; {counts} (--seq-length {d.seq_length}, --doc-stride {task.doc_stride}"
            f"{', SQuAD v2: unanswerable questions' if task.version_2_with_negative else ''})"
        )
        return d.train, d.validation, d.test, d.collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        model = load_question_answering_model(
            self.settings.model.pretrained_model_name_or_path,
            evaluating=self.settings.training.eval_only,
            **self.pretrained_load_kwargs(),
        )
        return model, None, None

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's scores: what the demo's learning is measured against
        super().begin_training()  # after it, so the first interval's rates count training only

    def run_forward_step(self, batch, model):
        # A sum and a count: exact over micro-batches and ranks of any size (a last, shorter micro-batch too).
        out = model(**_model_inputs(batch))
        losses = span_losses(out.start_logits, out.end_logits, batch)
        return losses.sum(), losses.numel()

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        # Every window's logits over the longest window (-inf beyond its own tokens) are gathered with its index,
        # whole batches at a time (the engine drops the rows that pad the ranks' last batches).
        model = model[0]
        width = self.data.seq_length
        left = self.tokenizer.padding_side == "left"
        indices, starts, ends, losses = [], [], [], []
        for batch in eval_dataloader:
            out = model(**_model_inputs(batch))
            start_logits, end_logits = out.start_logits.float(), out.end_logits.float()
            per_window = span_losses(start_logits, end_logits, batch)
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            aligned = []
            for logits in (start_logits, end_logits):
                full = logits.new_full((logits.shape[0], width), float("-inf"))
                for row, n in enumerate(lengths):  # the window's own tokens, wherever padding put them
                    full[row, :n] = logits[row, logits.shape[1] - n :] if left else logits[row, :n]
                aligned.append(full)
            indices.append(self.gather(batch[FEATURE_INDEX]))
            starts.append(self.gather(aligned[0]))
            ends.append(self.gather(aligned[1]))
            losses.append(self.gather(per_window))
        order = torch.cat(indices).cpu()
        metrics = self.score(order.numpy(), torch.cat(starts).cpu().numpy(), torch.cat(ends).cpu().numpy())
        metrics["loss"] = float(torch.cat(losses).double().mean())
        return metrics

    def score(self, feature_index: np.ndarray, start_logits: np.ndarray, end_logits: np.ndarray) -> dict[str, Any]:
        """SQuAD metrics of one evaluation split from its windows' logits (rows in any order, ``feature_index``
        naming each row's window)."""
        d = self.data
        split = next(name for name, window_range in d.windows_of.items() if int(feature_index[0]) in window_range)
        windows = d.windows_of[split]
        if sorted(feature_index.tolist()) != list(windows):
            raise RuntimeError(f"evaluation of {split}: gathered {len(feature_index)} windows of {len(windows)}")
        local = feature_index - windows.start
        starts, ends = [None] * len(windows), [None] * len(windows)
        meta = d.meta[windows.start : windows.stop]
        for row, i in enumerate(local.tolist()):
            n = len(meta[i].offsets)
            starts[i], ends[i] = start_logits[row, :n], end_logits[row, :n]
        examples = d.examples[split]
        settings = self.settings
        predictions, _ = postprocess_predictions(
            examples,
            meta,
            starts,
            ends,
            n_best_size=settings.task_options.n_best_size,
            max_answer_length=settings.task_options.max_answer_length,
            version_2_with_negative=settings.task_options.version_2_with_negative,
            null_score_diff_threshold=settings.task_options.null_score_diff_threshold,
        )
        references = [e.answers for e in examples]
        if settings.task_options.version_2_with_negative:
            return squad_v2_metrics(predictions, references)
        return squad_v1_metrics(predictions, references)


def trainer_for(settings: Sections) -> type[QuestionAnsweringFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return QuestionAnsweringFinetuner
