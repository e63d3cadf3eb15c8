"""White box: a Finetuner around a Hugging Face model, in Rapidformer's template shape.

    rapidlite --user-script examples/finetune_huggingface_bert.py \
        --pretrained-model-name-or-path bert-base-cased --data-path glue --data-name mrpc \
        --epochs 3 --micro-batch-size 16 --global-batch-size 64 --lr 2e-5 --mixed-precision

``--data-path`` is a hub dataset (with ``--data-name``) or a local directory holding ``train.csv`` and
``validation.csv`` with a ``sentence`` (or ``sentence1``/``sentence2``) column and a ``label`` column.
Runs the same with ``python examples/finetune_huggingface_bert.py <flags>``.
"""

import os

import torch
from datasets import load_dataset
from torchmetrics.functional.classification import multiclass_accuracy
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rapidlite import Finetuner, RapidliteEngine, get_args


class MyFinetuner(Finetuner):
    def train_valid_test_datasets_provider(self):
        args = get_args()
        self.tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
        path = args.data_path[0]
        if os.path.isdir(path):
            files = {split: os.path.join(path, f"{split}.csv") for split in ("train", "validation")}
            raw = load_dataset("csv", data_files=files)
        else:
            raw = load_dataset(path, args.data_name)
        columns = ["sentence1", "sentence2"] if "sentence1" in raw["train"].column_names else ["sentence"]
        labels = sorted(set(raw["train"]["label"]))
        self.label2id = {label: i for i, label in enumerate(labels)}

        def tokenize(examples):
            out = self.tokenizer(*(examples[c] for c in columns), truncation=True, max_length=args.seq_length or 128)
            out["labels"] = [self.label2id[label] for label in examples["label"]]
            return out

        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

        def collate_fn(examples):
            return dict(self.tokenizer.pad(examples, padding="longest", return_tensors="pt"))

        return tokenized["train"], tokenized["validation"], None, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = AutoModelForSequenceClassification.from_pretrained(
            args.pretrained_model_name_or_path, num_labels=len(self.label2id), ignore_mismatched_sizes=True
        )
        return model, None, None  # None: optimizer and schedule from the flags

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        predictions, references = [], []
        for batch in eval_dataloader:
            with torch.no_grad():
                logits = model(**batch).logits
            predictions.append(self.gather(logits.argmax(dim=-1)))
            references.append(self.gather(batch["labels"]))
        accuracy = multiclass_accuracy(
            torch.cat(predictions).cpu(),
            torch.cat(references).cpu(),
            num_classes=max(len(self.label2id), 2),
            average="micro",
        )
        return {"accuracy": float(accuracy)}


if __name__ == "__main__":
    engine = RapidliteEngine()
    trainer = MyFinetuner(engine=engine)
    trainer.train()
