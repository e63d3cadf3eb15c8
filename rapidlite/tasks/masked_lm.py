"""``--task masked_lm``: domain adaptation of a masked language model (``AutoModelForMaskedLM``) on raw text.

The black box is an ordinary ``Finetuner`` subclass, the shape of Hugging Face's ``run_mlm``: text (txt with one
document per line, csv/tsv/json/jsonl/parquet or a hub dataset) is tokenized and grouped into blocks of
``--seq-length`` tokens (``rapidlite.data.masked_lm``); each forward step masks its batch with
``DataCollatorForLanguageModeling``'s semantics from per-sample random draws (seeded by ``--seed``, the
sample's index and the epoch), so the masks, and the losses, are the same on any number of ranks and after a
resume. The forward step returns ``(loss_sum, masked_tokens)``: the loss is the mean over the masked tokens of
the whole global batch. Evaluation masks with a fixed stream, so every evaluation of a model scores the same
masks, and logs ``loss`` and ``ppl`` = exp(loss), token-weighted over all ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import get_task
from rapidlite.data.masked_lm import (
    EVAL_STREAM,
    IGNORE_INDEX,
    MaskedLMCollator,
    build_masked_lm_data,
    draw_masks,
    load_text_datasets,
    mask_tokens,
)
from rapidlite.models.head import output_logps
from rapidlite.models.hf import (
    load_error,
    load_hf_model,
    sequence_length,
    tokenizer_and_config,
)
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.trainer import Finetuner
from rapidlite.trainer.base import perplexity


def load_masked_lm(name: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForMaskedLM`` from ``name``; attention through SDPA where the model class has it. ``kwargs``:
    more ``from_pretrained`` arguments (``Trainer.pretrained_load_kwargs``)."""
    from transformers import AutoModelForMaskedLM

    try:
        return load_hf_model(AutoModelForMaskedLM.from_pretrained, name, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("masked language model", name, e) from None


class MaskedLMFinetuner(Finetuner):
    """Masked-LM training on raw text; the loss is over the masked tokens."""

    seq_length = get_task("masked_lm").defaults["seq_length"]  # until the data sets it

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        self.tokenizer, config = tokenizer_and_config(settings.model.pretrained_model_name_or_path, self.logger)
        self.seq_length = sequence_length(
            settings.data.seq_length, self.tokenizer, config=config, explicit=settings.given("seq_length")
        )
        with hf_datasets_progress(self.show_progress):
            raw = load_text_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
            self.data = build_masked_lm_data(
                raw,
                self.tokenizer,
                self.seq_length,
                text_keys=settings.data.text_keys,
                line_by_line=settings.task_options.line_by_line,
                whole_word_masking=settings.task_options.whole_word_masking,
            )
        d = self.data
        shape = (
            f"one sample per document ({d.truncated} cut at --seq-length {self.seq_length})"
            if settings.task_options.line_by_line
            else f"grouped into blocks of --seq-length {self.seq_length}"
        )
        valid = len(d.validation) if d.validation is not None else 0
        self.logger.info(
            f"data: {d.documents} documents from column {d.text_key}"
            f"{f' ({d.empty} empty rows skipped)' if d.empty else ''}, {d.tokens} tokens {shape} | "
            f"{len(d.train)} train / {valid} validation samples; masking {settings.data.mask_prob:g} of the tokens"
            f"{' by whole words' if settings.task_options.whole_word_masking else ''}"
        )
        return d.train, d.validation, d.test, MaskedLMCollator(self.tokenizer.pad_token_id or 0)

    def model_optimizer_lr_scheduler_provider(self):
        model = load_masked_lm(self.settings.model.pretrained_model_name_or_path, **self.pretrained_load_kwargs())
        return model, None, None

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's perplexity: what the demo's learning is judged by
        super().begin_training()

    def masked_loss(
        self, batch: dict[str, Any], model: torch.nn.Module, stream: tuple[int, ...], rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, masked_tokens)`` of the batch masked with the draws of ``stream``; rows from ``rows`` on
        (padding that evens out the ranks' last evaluation batches) are run but not scored."""
        input_ids = batch["input_ids"]
        draws = draw_masks(
            batch["index"],
            input_ids.shape[1],
            self.seq_length,
            len(self.tokenizer),
            self.settings.training.seed,
            stream,
        ).to(input_ids.device)
        inputs, labels = mask_tokens(
            input_ids,
            batch["maskable"],
            draws,
            self.tokenizer.mask_token_id,
            self.settings.data.mask_prob,
            batch.get("word_ids"),
        )
        if rows is not None:
            labels[rows:] = IGNORE_INDEX
        logp_sum = output_logps(
            model,
            {"input_ids": inputs, "attention_mask": batch["attention_mask"]},
            labels,
            shift=False,
            sum_only=True,
            chunked=self.settings.model.chunked_loss,
        )
        return -logp_sum, (labels != IGNORE_INDEX).sum()

    def run_forward_step(self, batch, model):
        epoch = self.iteration // max(self.steps_per_epoch, 1)  # dynamic masking: new masks every epoch
        loss_sum, count = self.masked_loss(batch, model, (1, epoch))
        return loss_sum, int(count)

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, float]:
        total = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        count = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        for batch in eval_dataloader:
            rows = batch["input_ids"].shape[0] - getattr(eval_dataloader, "padding_rows", 0)
            loss_sum, masked = self.masked_loss(batch, model[0], (EVAL_STREAM,), rows)
            total += loss_sum.detach().double()
            count += masked.double()
        total = self.engine.all_reduce_sum(total)
        count = self.engine.all_reduce_sum(count)
        loss = float(total / count.clamp(min=1))
        return {"loss": loss, "ppl": perplexity(loss), "masked_tokens": int(count)}


def trainer_for(settings: Sections) -> type[MaskedLMFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return MaskedLMFinetuner
