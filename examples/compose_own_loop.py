"""Keep your own training loop: ``engine.compose`` applies the flags to your model, optimizer and schedule.

    rapidlite --user-script examples/compose_own_loop.py \
        --pretrained-model-name-or-path bert-base-cased --data-path DIR_WITH_train.csv_AND_validation.csv \
        --epochs 2 --micro-batch-size 16 --lr 2e-5 --lr-warmup-iters 10 --mixed-precision

What you get from compose: the model on the device (with ``--checkpoint-activations`` and the autocast of
``--mixed-precision``/``--bf16``/``--fp16`` applied), a fused AdamW from the flags (or your optimizer,
wrapped) whose ``step()`` clips to ``--clip-grad`` and, under fp16, unscales and skips overflowing steps,
and your schedule. ``engine.backward(loss)`` applies the fp16 loss scale. ``Finetuner.build_data_loader``
shards data over ranks and moves batches to the device. Gradient accumulation is the templates' job:
in your own loop you decide when to step.
"""

import os
from functools import partial

import torch
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from rapidlite import Finetuner, RapidliteEngine, get_args

engine = RapidliteEngine()
args = get_args()
finetuner = Finetuner(engine=engine)

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
path = args.data_path[0]
files = {split: os.path.join(path, f"{split}.csv") for split in ("train", "validation")}
raw = load_dataset("csv", data_files=files)
label2id = {label: i for i, label in enumerate(sorted(set(raw["train"]["label"])))}


def tokenize(examples):
    out = tokenizer(examples["sentence"], truncation=True, max_length=args.seq_length or 128)
    out["labels"] = [label2id[label] for label in examples["label"]]
    return out


tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)


def collate_fn(examples):
    return dict(tokenizer.pad(examples, padding="longest", return_tensors="pt"))


train_dataloader = finetuner.build_data_loader(tokenized["train"], collate_fn=collate_fn)
eval_dataloader = finetuner.build_data_loader(tokenized["validation"], shuffle=False, collate_fn=collate_fn)

model = AutoModelForSequenceClassification.from_pretrained(
    args.pretrained_model_name_or_path, num_labels=len(label2id), ignore_mismatched_sizes=True
)
lr_scheduler = partial(
    get_linear_schedule_with_warmup,
    num_warmup_steps=args.lr_warmup_iters or 0,
    num_training_steps=args.epochs * len(train_dataloader),
)
model, optimizer, lr_scheduler = engine.compose(model_obj=model, lr_scheduler_fn=lr_scheduler)

for epoch in range(args.epochs):
    model.train()
    train_dataloader.set_epoch(epoch)
    for batch in train_dataloader:
        loss = model(**batch).loss
        engine.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

    model.eval()
    correct = total = 0
    for batch in eval_dataloader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        correct += int((engine.gather(predictions) == engine.gather(batch["labels"])).sum())
        total += len(engine.gather(batch["labels"]))
    print(f"epoch {epoch}: loss {loss.item():.4f} accuracy {correct / total:.4f}", flush=True)
