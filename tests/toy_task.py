"""A task written outside rapidlite, in one module: predict how many words a generated sentence has
(regression on a Hugging Face encoder), with an option of its own (``--train-sentences``).
``tests/test_new_task.py`` registers it with one ``TaskSpec`` and runs it as a user of ``--task`` would: training,
``--dry-run`` and ``--eval-only``."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import AutoModelForSequenceClassification

from rapidlite.config.fields import flag
from rapidlite.trainer import Finetuner

WORDS = ("alpha", "beta", "gamma", "delta", "omega")
VOCAB = 16  # ids 0..15: 0 pads, each word a token


def sentences(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(count)]


@dataclass(frozen=True)
class WordCountOptions:
    """The task's own flags (``TaskSpec.options``): a --help group of their own, refused under another task."""

    train_sentences: int = flag(64, "word_count: generated sentences to train on")


class WordCountFinetuner(Finetuner):
    """Regression: the model reads a sentence of token ids and predicts its length in words."""

    def train_valid_test_datasets_provider(self):
        seq_length = self.args.seq_length
        options: WordCountOptions = self.settings.task_options
        train, valid = sentences(options.train_sentences, self.args.seed), sentences(16, self.args.seed + 1)

        def collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
            ids = torch.zeros(len(rows), seq_length, dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row[:seq_length])
            labels = torch.tensor([float(len(row)) for row in rows])
            return {"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": labels}

        return train, valid, None, collate

    def model_optimizer_lr_scheduler_provider(self):
        name = self.args.pretrained_model_name_or_path
        return AutoModelForSequenceClassification.from_pretrained(name, num_labels=1), None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model, errors = model[0], []  # the model chunks, as Rapidformer's hook receives them
        for batch in eval_dataloader:
            prediction = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
            errors.append((prediction - batch["labels"]).abs())
        return {"mae": self.gather(torch.cat(errors)).mean().item()}


def trainer_for(args) -> type[WordCountFinetuner]:
    """The registry's entry point: the trainer class for the flags."""
    return WordCountFinetuner
