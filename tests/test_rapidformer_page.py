"""Every code sample of Rapidformer's usage page (``shared/reference/rapidformer-usage.txt``), typed in as a
user of that page would, with ``rapidformer`` renamed to ``rapidlite`` and on tiny local models and data
instead of hub names. Where a sample needs more than the rename, a ``# page:`` comment says why; the README's
"Coming from Rapidformer" lists the same differences."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, english_corpus, read_metrics
from rapidlite.tasks.demo import write_demo_assets

pytestmark = pytest.mark.slow

# The page's launch scripts export these before calling the command.
PAGE_ENV = {"MASTER_ADDR": "localhost", "NNODES": "1", "NODE_RANK": "0"}


def command(name: str, *argv: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """A console script of the installed package (``rapidformer``, ``rapidlite-preprocess``), as the page runs
    it; MASTER_PORT is a free one (the page's 6010 may be taken on a shared test machine)."""
    from rapidlite.runtime.distributed import free_port

    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{name} is not installed next to {sys.executable}: pip install -e ."
    env = {**os.environ, **PAGE_ENV, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    return subprocess.run([str(script), *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout + proc.stderr


def train_losses(save: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(save) if "split" not in r]


@pytest.fixture(scope="module")
def mrpc(tmp_path_factory) -> dict[str, Path]:
    """A tiny BERT classifier with its tokenizer, and MRPC-shaped csv files (idx, sentence1, sentence2, label)."""
    import csv

    root = tmp_path_factory.mktemp("page_mrpc")
    model_dir, demo_data = write_demo_assets(root / "demo", seed=5, num_train=480, num_validation=96, num_test=64)
    data = root / "glue"
    data.mkdir()
    for split in ("train", "validation", "test"):
        with open(demo_data / f"{split}.csv") as f:
            rows = list(csv.DictReader(f))
        with open(data / f"{split}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["idx", "sentence1", "sentence2", "label"])
            for i, row in enumerate(rows):
                # A paraphrase task stand-in, easy to learn in a few steps: sentence2 carries a cue word.
                positive = row["label"] == "positive"
                out.writerow([i, row["sentence"], "excellent" if positive else "tedious", int(positive)])
    return {"root": root, "model": model_dir, "data": data}


@pytest.fixture(scope="module")
def mrpc_small(mrpc, tmp_path_factory) -> dict[str, Path]:
    """The first 192 train and 32 validation and test rows of ``mrpc``: for the samples whose assertions need a
    run, not learning (3 steps of 64 an epoch)."""
    data = tmp_path_factory.mktemp("page_mrpc_small")
    for split, rows in (("train", 192), ("validation", 32), ("test", 32)):
        lines = (mrpc["data"] / f"{split}.csv").read_text().splitlines(keepends=True)
        (data / f"{split}.csv").write_text("".join(lines[: rows + 1]))
    return {**mrpc, "data": data}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A JSON-lines corpus, GPT-2 BPE files and a BERT vocabulary made from it."""
    from rapidlite.data.tokenizers import train_byte_level_bpe, write_wordpiece_vocab

    root = tmp_path_factory.mktemp("page_corpus")
    docs = english_corpus(400, seed=11)
    (root / "book_wiki_owtv2_small.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    vocab, merges = train_byte_level_bpe(docs, 400, root / "gpt2")
    os.replace(vocab, root / "gpt2-vocab.json")
    os.replace(merges, root / "gpt2-merges.txt")
    bert_vocab = write_wordpiece_vocab(docs, 200, root / "bert")
    os.replace(bert_vocab, root / "bert-en-uncased-vocab.txt")
    return {"root": root}


@pytest.fixture(scope="module")
def gpt_data(corpus) -> Path:
    """The page's preprocessing command (sample 2), reused by the Megatron GPT sample."""
    root = corpus["root"]
    ok(
        command(
            "rapidlite-preprocess",  # page: python preprocess_data.py (Megatron's script)
            "--input", "book_wiki_owtv2_small.json",
            "--output-prefix", "gpt_small",
            "--vocab", "gpt2-vocab.json",
            "--dataset-impl", "mmap",
            "--tokenizer-type", "GPT2BPETokenizer",
            "--merge-file", "gpt2-merges.txt",
            "--append-eod",
            cwd=root,
        )
    )  # fmt: skip
    return root / "gpt_small_text_document"


@pytest.fixture(scope="module")
def bert_data(corpus) -> dict[str, Path]:
    """Sentence-split BERT data (``..._text_sentence``) and a tiny saved BertForPreTraining."""
    from transformers import BertConfig, BertForPreTraining

    root = corpus["root"]
    ok(
        command(
            "rapidlite-preprocess", "--input", "book_wiki_owtv2_small.json", "--output-prefix", "book_wiki_owtv2_small",
            "--vocab", "bert-en-uncased-vocab.txt", "--dataset-impl", "mmap", "--tokenizer-type",
            "BertWordPieceLowerCase", "--split-sentences",
            cwd=root,
        )
    )  # fmt: skip
    vocab_size = len((root / "bert-en-uncased-vocab.txt").read_text().splitlines())
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    BertForPreTraining(config).save_pretrained(root / "bert-base-uncased")
    return {"prefix": root / "book_wiki_owtv2_small_text_sentence", "model": root / "bert-base-uncased"}


# ------------------------------------------------------------------------------------------ black box
def test_page_black_box_fine_tuning(mrpc_small, tmp_path):
    """黑盒化加速:加速微調Huggingface模型 — the command as printed, with the local model and data."""
    out = ok(
        command(
            "rapidformer", "--task", "sequence_classification",
            "--pretrained-model-name-or-path", str(mrpc_small["model"]),  # page: 'bert-base-cased'
            "--data-path", str(mrpc_small["data"]),  # page: glue --data-name mrpc (hub names need a hub)
            "--epochs", "3",
            "--micro-batch-size", "16",
            "--global-batch-size", "64",
            "--lr", "2e-5",
            "--lr-decay-style", "linear",
            "--lr-warmup-iters", "100",
            "--weight-decay", "1e-2",
            "--clip-grad", "1.0",
            "--seed", "42",
            "--mixed-precision",
            "--onnx-runtime-training",
            "--zero-1-memory-optimization",
            "--save", str(tmp_path),
            cwd=tmp_path,
        )
    )  # fmt: skip
    # 192 rows / 64 per step x 3 epochs = 9 iterations: the page's 100 warmup iterations are clamped, loudly.
    assert "--lr-warmup-iters 100 is longer than the run's 9 iterations" in out
    assert "--onnx-runtime-training" in out and "using torch.compile" in out
    assert "data: train = train.csv (192 rows); validation = validation.csv (32 rows); test = test.csv" in out
    final = [r for r in read_metrics(tmp_path) if r.get("split") == "validation"][-1]
    assert 0 <= final["accuracy"] <= 1 and (tmp_path / "hf" / "config.json").is_file()


def test_page_preprocessing(gpt_data):
    """黑盒化加速:加速預訓練 step 1 — Megatron's preprocess flags (``--vocab`` included) give the mmap pair."""
    from rapidlite.data.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(gpt_data))
    assert len(dataset) == 400 and dataset.get(0)[-1] == 0  # one sequence per document, each ending in EOD


def test_page_black_box_bert_pretraining(bert_data, corpus, tmp_path):
    """黑盒化加速:加速預訓練Huggingface模型 — BERT pretraining with the page's flags (sizes made tiny)."""
    ok(
        command(
            "rapidformer", "--task", "pretraining",
            "--pretrained-model-name-or-path", str(bert_data["model"]),
            "--num-layers", "2",  # page: 12 x 768 x 12 heads, seq 512, micro 16, global 128, 100 iterations
            "--hidden-size", "32",
            "--num-attention-heads", "4",
            "--micro-batch-size", "4",
            "--global-batch-size", "8",
            "--seq-length", "48",
            "--tokenizer-type", "BertWordPieceLowerCase",
            "--max-position-embeddings", "64",
            "--train-iters", "6",
            "--data-path", str(bert_data["prefix"]),
            "--vocab-file", str(corpus["root"] / "bert-en-uncased-vocab.txt"),
            "--data-impl", "mmap",
            "--split", "980,20",
            "--lr", "1e-3",
            "--lr-decay-style", "linear",
            "--min-lr", "0.0",
            "--lr-decay-iters", "2000",
            "--weight-decay", "1e-2",
            "--clip-grad", "1.0",
            "--lr-warmup-fraction", ".01",
            "--mixed-precision",
            "--onnx-runtime-training",
            "--fsdp-memory-optimization",
            "--log-interval", "1", "--save", str(tmp_path),
            cwd=tmp_path,
        )
    )  # fmt: skip
    losses = train_losses(tmp_path)
    assert len(losses) == 6 and all(0 < loss < 20 for loss in losses)


# ------------------------------------------------------------------------------------------ white box
FINETUNER_SCRIPT = """
import torch  # page: the snippets use torch without importing it
from torchmetrics.classification import BinaryAccuracy  # page: load_metric (removed from datasets)
from transformers import AutoConfig, BertForSequenceClassification, AutoTokenizer
from datasets import load_dataset
from rapidlite import RapidformerEngine
from rapidlite import get_args
from rapidlite import get_logger
from rapidlite import get_timers
from rapidlite import Finetuner
from rapidlite import Pretrainer
from rapidlite import build_train_valid_test_datasets_for_huggingface

args = None  # page: its methods read a module-level args


class MyFintuner(Finetuner):
    def __init__(self,engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        tokenizer = AutoTokenizer.from_pretrained(args.load)  # page: "bert-base-cased"

        def tokenize_function(examples):
            # max_length=None => use the model max length (it's actually the default)
            outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)
            return outputs

        datasets = load_dataset(args.dataset_path, args.dataset_name)
        # Apply the method we just defined to all the examples in all the splits of the dataset
        tokenized_datasets = datasets.map(
            tokenize_function,
            batched=True,
            remove_columns=["idx", "sentence1", "sentence2"],
        )
        tokenized_datasets = tokenized_datasets.rename_column("label", "labels")  # page: rename_column_ (removed)

        train_dataset = tokenized_datasets["train"]
        valid_dataset = tokenized_datasets['validation']
        test_dataset = tokenized_datasets['test']

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return train_dataset, valid_dataset, test_dataset, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = BertForSequenceClassification.from_pretrained(args.load)
        return model, None, None

    def run_forward_step(self, batch, model):
        output_tensor = model(**batch)
        return output_tensor.loss

    # after each epoch run metric on eval dataset
    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        metric = BinaryAccuracy()  # page: load_metric(args.dataset_path, args.dataset_name)
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)

            metric.update(self.gather(predictions), self.gather(batch["labels"]))  # page: metric.add_batch

        eval_metric = {"accuracy": metric.compute()}  # page: metric.compute()
        return eval_metric


engine = RapidformerEngine()
args = get_args()
trainer = MyFintuner(engine=engine)
trainer.train()
"""


def test_page_finetuner_template(mrpc_small, tmp_path):
    """白盒化加速:基于Finetuner代碼模版的Huggingface模型微調 — the script and its launch flags."""
    script = tmp_path / "rapidformer_finetune_huggingface_bert_trainer.py"
    script.write_text(FINETUNER_SCRIPT)
    out = ok(
        command(
            "rapidformer", "--user-script", str(script),
            "--task", "sequence_classification",
            "--pretrained-model-name-or-path", str(mrpc_small["model"]),
            "--data-path", str(mrpc_small["data"]),  # page: glue --data-name mrpc
            "--load", str(mrpc_small["model"]),  # page: the script loads from_pretrained(args.load), no --load given
            "--epochs", "3",
            "--micro-batch-size", "16",
            "--global-batch-size", "16",
            "--lr", "2e-5",
            "--lr-decay-style", "linear",
            "--lr-warmup-iters", "100",
            "--weight-decay", "1e-2",
            "--clip-grad", "1.0",
            "--mixed-precision",
            "--zero-3-memory-optimization",
            "--onnx-runtime-training",
            "--save", str(tmp_path / "run"),
            cwd=tmp_path,
        )
    )  # fmt: skip
    assert "holds a Hugging Face model, not a rapidlite checkpoint" in out  # --load understood, nothing resumed
    evaluations = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert len(evaluations) == 3 and all(0 <= r["accuracy"] <= 1 for r in evaluations)


BERT_PRETRAINER_SCRIPT = """
import torch  # page: not imported in the snippet
from rapidlite import mpu  # page: from megatron import mpu
from transformers import BertConfig, BertForPreTraining
from transformers import AutoModelForPreTraining  # page: used, never imported
from rapidlite import RapidformerEngine, get_args, PreTrainer
from rapidlite import build_train_valid_test_datasets_for_huggingface


class MyBertPreTrainer(PreTrainer):

    def __init__(self,engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()

        train_ds, valid_ds, test_ds = build_train_valid_test_datasets_for_huggingface(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            max_seq_length=args.seq_length,
            masked_lm_prob=args.mask_prob,
            short_seq_prob=args.short_seq_prob,
            seed=args.seed,
            skip_warmup=(not args.mmap_warmup),
            binary_head=True)

        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = AutoModelForPreTraining.from_pretrained(args.pretrained_model_name_or_path)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        # Items and their type.
        keys = ['input_ids', 'attention_mask', 'token_type_ids', 'labels', 'next_sentence_label']
        datatype = torch.int64

        # Broadcast data.
        if data_iterator is not None:
            data = next(data_iterator)
        else:
            data = None
        data_b = mpu.broadcast_data(keys, data, datatype)
        input_ids = data_b['input_ids'].long()
        attention_mask = data_b['attention_mask'].long()
        token_type_ids = data_b['token_type_ids'].long()
        labels = data_b['labels'].long()
        next_sentence_label = data_b['next_sentence_label'].long()
        output_tensor = model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids, labels=labels, next_sentence_label=next_sentence_label)

        return output_tensor['loss']


engine = RapidformerEngine()
trainer = MyBertPreTrainer(engine=engine)
trainer.train()
"""


def test_page_pretrainer_template_bert(bert_data, corpus, tmp_path):
    """白盒化加速:基于Pretrainer代碼模版的Huggingface模型預訓練 — mpu.broadcast_data and the page's dataset builder."""
    script = tmp_path / "rapidformer_pretrain_huggingface_bert_trainer.py"
    script.write_text(BERT_PRETRAINER_SCRIPT)
    ok(
        command(
            "rapidformer", "--user-script", str(script),
            "--pretrained-model-name-or-path", str(bert_data["model"]),
            "--num-layers", "2",  # page: bert-base sizes, seq 512, micro 16, global 64, 100 iterations
            "--hidden-size", "32",
            "--num-attention-heads", "4",
            "--micro-batch-size", "4",
            "--global-batch-size", "8",
            "--seq-length", "48",
            "--tokenizer-type", "BertWordPieceLowerCase",
            "--max-position-embeddings", "64",
            "--train-iters", "6",
            "--data-path", str(bert_data["prefix"]),
            "--vocab-file", str(corpus["root"] / "bert-en-uncased-vocab.txt"),
            "--data-impl", "mmap",
            "--split", "980,20",
            "--lr", "1e-3",
            "--lr-decay-style", "linear",
            "--weight-decay", "1e-2",
            "--clip-grad", "1.0",
            "--lr-warmup-fraction", ".01",
            "--zero-3-memory-optimization",
            "--onnx-runtime-training",
            "--mixed-precision",
            "--log-interval", "1", "--save", str(tmp_path / "run"),
            cwd=tmp_path,
        )
    )  # fmt: skip
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 6 and all(0 < loss < 20 for loss in losses)


OWN_LOOP_SCRIPT = """
import torch
from functools import partial  # page: used, not imported
from datasets import load_dataset
from torchmetrics.classification import BinaryAccuracy  # page: load_metric("glue", "mrpc")
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    get_linear_schedule_with_warmup,
    BertForSequenceClassification,
)
from rapidlite import Finetuner, RapidformerEngine, get_args

engine = RapidformerEngine()
args = get_args()
finetuner = Finetuner(engine=engine)

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)  # page: "bert-base-cased"
datasets = load_dataset(args.dataset_path)  # page: load_dataset("glue", "mrpc")
metric = BinaryAccuracy()

def tokenize_function(examples):
    # max_length=None => use the model max length (it's actually the default)
    outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)
    return outputs

tokenized_datasets = datasets.map(
    tokenize_function,
    batched=True,
    remove_columns=["idx", "sentence1", "sentence2"],
)

model = AutoModelForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path, return_dict=True)

lr_scheduler = partial(
        get_linear_schedule_with_warmup,
        num_warmup_steps=args.lr_warmup_iters,
        num_training_steps=args.train_iters
    )

model, optimizer, lr_scheduler = engine.compose(model_obj=model,
      lr_scheduler_fn=lr_scheduler)

train_dataloader = finetuner.build_data_loader(tokenized_datasets["train"])
eval_dataloader = finetuner.build_data_loader(tokenized_datasets["validation"])

for epoch in range(args.epochs):
    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

    model.eval()
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            metric.update(engine.gather(predictions), engine.gather(batch["labels"]))  # page: add_batch

    eval_metric = metric.compute()
    metric.reset()
    print("epoch {}: {}".format(epoch, eval_metric))
"""


def test_page_own_loop_with_compose(mrpc, tmp_path):
    """白盒化加速:用戶自定義Trainer — the user's loop with build_data_loader (no collate_fn) and compose, its
    plain loss.backward() under fp16 loss scaling, on 2 processes."""
    script = tmp_path / "own_loop.py"
    script.write_text(OWN_LOOP_SCRIPT)
    out = ok(
        command(
            "rapidformer", "--user-script", str(script),
            "--pretrained-model-name-or-path", str(mrpc["model"]), "--data-path", str(mrpc["data"]),
            "--epochs", "3", "--train-iters", "45", "--micro-batch-size", "16", "--lr", "2e-3",
            "--lr-warmup-iters", "5", "--fp16", "--nproc-per-node", "2",
            cwd=tmp_path,
        )
    )  # fmt: skip
    # The page's loop prints on every rank (lines of two ranks may interleave): one per epoch and rank.
    accuracies = [float(value) for _, value in re.findall(r"epoch (\d+): (?:tensor\()?([0-9.]+)", out)]
    assert len(accuracies) == 6, out[-3000:]
    # Unscaled gradients are stepped as they are (one warning), so the classifier learns: before the fix the
    # composed optimizer divided them by the loss scale and accuracy stayed at chance.
    assert accuracies[-1] > 0.8, accuracies
    assert out.count("came from loss.backward()") == 1  # once, from the main process


MEGATRON_GPT_SCRIPT = '''
import torch  # page: not imported in the snippets
from rapidlite import mpu  # page: from megatron import mpu
from rapidlite import RapidformerEngine, get_args, PreTrainer
from rapidlite import build_train_valid_test_datasets, get_tokenizer, get_ltor_masks_and_position_ids
from rapidlite import GPTModel  # page: from yourmodel import GPTModel


class MyGPTPreTrainer(PreTrainer):  # page: three snippets of one class (MegatronGPTPreTrainer / MyGPTPreTrainer)
    def __init__(self,
                 engine,
                 ):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()

        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=args.seq_length,
            seed=args.seed,
            skip_warmup=(not args.mmap_warmup))

        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        model = GPTModel()
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        """Forward step."""
        args = get_args()

        tokenizer = get_tokenizer()

        # Items and their type.
        keys = ['text']
        datatype = torch.int64

        # Broadcast data.
        if data_iterator is not None:
            data = next(data_iterator)
        else:
            data = None
        data_b = mpu.broadcast_data(keys, data, datatype)

        # Unpack.
        tokens_ = data_b['text'].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()

        # Get the masks and postition ids.
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens,
            tokenizer.eod,
            args.reset_position_ids,
            args.reset_attention_mask,
            args.eod_mask_loss)

        output_tensor = model(tokens, position_ids, attention_mask,
                              labels=labels)

        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()

        return loss


engine = RapidformerEngine()
trainer = MyGPTPreTrainer(engine=engine)
trainer.train()
'''


def _megatron_gpt(script: Path, data: Path, corpus: dict, save: Path, *layout: str) -> list[float]:
    root = corpus["root"]
    ok(
        command(
            "rapidformer", "--user-script", str(script), *layout,
            "--num-layers", "4",  # page: 12 x 768 x 12 heads, seq 512, micro 16, global 128, 100 iterations
            "--hidden-size", "64",
            "--num-attention-heads", "4",
            "--micro-batch-size", "2",
            "--global-batch-size", "8",
            "--seq-length", "32",
            "--tokenizer-type", "GPT2BPETokenizer",
            "--max-position-embeddings", "32",
            "--train-iters", "4",
            "--data-path", str(data),
            "--vocab-file", str(root / "gpt2-vocab.json"),
            "--merge-file", str(root / "gpt2-merges.txt"),
            "--data-impl", "mmap",
            "--split", "980,20",
            "--lr", "1e-3",
            "--lr-decay-style", "linear",
            "--weight-decay", "1e-2",
            "--clip-grad", "1.0",
            "--lr-warmup-fraction", ".01",
            "--log-interval", "1",
            "--zero-2-memory-optimization",
            "--checkpoint-activations",
            "--mixed-precision",
            "--hidden-dropout", "0", "--attention-dropout", "0",  # page: dropout on; off to compare layouts
            "--save", str(save),
            cwd=save.parent,
        )
    )  # fmt: skip
    return train_losses(save)


@pytest.mark.distributed
def test_page_megatron_gpt_pretrainer_tensor_and_pipeline_parallel(gpt_data, corpus, tmp_path):
    """白盒化加速:基于Pretrainer代碼模版的Megatron模型預訓練 — GPTModel() from the flags, Megatron's per-token
    losses, mpu.broadcast_data, on tp2 x pp2 (4 processes) against one process."""
    from rapidlite.precision import cpu_bf16_is_fast

    script = tmp_path / "rapidformer_pretrain_megatron_gpt_trainer.py"
    script.write_text(MEGATRON_GPT_SCRIPT)
    parallel = _megatron_gpt(
        script, gpt_data, corpus, tmp_path / "tp2pp2",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "4",
    )  # fmt: skip
    single = _megatron_gpt(script, gpt_data, corpus, tmp_path / "single")
    assert len(parallel) == len(single) == 4
    tolerance = 2e-2 if cpu_bf16_is_fast() else 1e-4  # --mixed-precision is bf16 only where bf16 is fast
    assert parallel == pytest.approx(single, rel=tolerance)
