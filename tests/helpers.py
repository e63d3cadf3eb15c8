"""Small models, datasets and trainers shared by the tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rapidlite import Finetuner, RapidliteEngine
from rapidlite.data.indexed_dataset import IndexedDatasetBuilder

REPO = Path(__file__).resolve().parents[1]


class ToyRegressionData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, dim: int = 8, seed: int = 0):
        weight = torch.randn(dim, 1, generator=torch.Generator().manual_seed(1234))  # one function for all splits
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ weight + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 32, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


class ToyFinetuner(Finetuner):
    """MSE regression; records every training loss it returns."""

    def __init__(self, engine, dropout: float = 0.0, n: int = 64):
        super().__init__(engine=engine)
        self.dropout, self.n = dropout, n

    def train_valid_test_datasets_provider(self):
        return ToyRegressionData(self.n, seed=1), ToyRegressionData(20, seed=2), None

    def model_optimizer_lr_scheduler_provider(self):
        return MLP(dropout=self.dropout), None, None

    def run_forward_step(self, batch, model):
        return F.mse_loss(model(batch["x"]), batch["y"])


class VariableLengthData(torch.utils.data.Dataset):
    """Token sequences of different lengths (padded per batch), for (loss_sum, num_items) tests."""

    def __init__(self, n: int = 32, vocab: int = 20, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [
            torch.randint(1, vocab, (int(torch.randint(3, 17, (1,), generator=g)),), generator=g) for _ in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(seqs):
    length = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": tokens, "attention_mask": mask}


class TokenModel(nn.Module):
    def __init__(self, vocab: int = 20, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        return self.head(self.rnn(self.embed(input_ids))[0])


class TokenSumFinetuner(Finetuner):
    """Next-token loss summed over real (unpadded) tokens: returns (loss_sum, num_tokens)."""

    mean_mode = False

    def train_valid_test_datasets_provider(self):
        return VariableLengthData(), None, None, pad_collate

    def model_optimizer_lr_scheduler_provider(self):
        torch.manual_seed(0)
        return TokenModel(), None, None

    def run_forward_step(self, batch, model):
        logits = model(batch["input_ids"][:, :-1])
        target = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        count = int((target != -100).sum())
        return (loss_sum / count) if self.mean_mode else (loss_sum, count)


def engine(*argv: str) -> RapidliteEngine:
    return RapidliteEngine(argv=list(argv))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_metrics(save_dir: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(save_dir, "metrics.jsonl").read_text().splitlines()]


def run_cli(*argv: str, cwd: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``rapidlite ARGV`` in a fresh process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "rapidlite", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


SUBJECTS = "the cat|a dog|my neighbour|the old farmer|our teacher|the small bird|a tired traveller|the river".split("|")
VERBS = "sees|likes|follows|paints|carries|remembers|finds|watches|builds|keeps".split("|")
OBJECTS = "the garden|a red house|the morning light|two apples|the long road|a quiet village|the blue boat".split("|")
TAILS = "|today|before dinner|in the rain|with great care|every summer|near the mountains|after school".split("|")


def english_corpus(num_docs: int, seed: int) -> list[str]:
    """Documents of 1-7 sentences made from word templates (some one-sentence documents on purpose)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(int(rng.integers(1, 8))):
            words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(TAILS)]
            if rng.random() < 0.5:
                words += ["and", rng.choice(VERBS), rng.choice(OBJECTS)]
            text = " ".join(w for w in words if w)
            sentences.append(text[0].upper() + text[1:] + ".")
        docs.append(" ".join(sentences))
    return docs


# Data-parallel runs of examples/pretrain_custom_model.py: the same global batch (8) everywhere.
PRETRAIN = str(REPO / "examples" / "pretrain_custom_model.py")
# 1 process x micro 4 x 2 steps, or 2 ranks x micro 2 x 2 steps.
DP_COMMON = ["--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--hidden-dropout", "0"]
DP_COMMON += ["--seq-length", "16", "--hidden-size", "32", "--lr-decay-iters", "6"]
DP_ONE = ["--micro-batch-size", "4"]
DP_TWO = ["--micro-batch-size", "2", "--nproc-per-node", "2"]


def rapidlite(*argv, env=None, timeout=300):
    """One thread per rank (2 cores, 2 ranks), as a user on this machine would run it."""
    saved = dict(os.environ)
    os.environ.update({"OMP_NUM_THREADS": "1", **(env or {})})
    try:
        return run_cli(*argv, timeout=timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def rapidlite_here(*argv: str) -> int:
    """``rapidlite ARGV`` in this process (a one-process run whose launch is not what a test is about); a
    ``--user-script`` run's changes to ``sys.argv`` and ``sys.path`` are undone."""
    from rapidlite.cli.main import main

    saved_argv, saved_path = list(sys.argv), list(sys.path)
    try:
        return main(list(argv))
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def rapidlite_captured(*argv: str) -> subprocess.CompletedProcess:
    """``rapidlite ARGV`` in this process, its exit code and output as ``run_cli`` returns them: for a dry run or
    a one-process run whose launch is not what a test is about (start-up is most of such a run's time). A bug
    stays this process's traceback; warnings already shown in this process are not shown again. A check that a
    library's own output is absent needs ``run_cli``: a library's log handler may hold the stream it started with.
    So does a check of a CPU plan's peak: its runtime term is the resident size of the process that plans."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = rapidlite_here(*argv)
    return subprocess.CompletedProcess(["rapidlite", *argv], code, out.getvalue(), err.getvalue())


def train_losses(save_dir, key="loss"):
    return [r[key] for r in read_metrics(save_dir) if "split" not in r]


def assert_close_lists(actual, expected, rtol):
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= rtol * abs(e), (actual, expected)


def layout_runs(root: Path, argv: list[str], layouts: dict[str, list[str]]):
    """``get(name)``: the run of layout ``name`` (``argv`` + its flags, 6 iterations, checkpoints at 3 and 6),
    trained once and shared by the tests of a module (a one-process layout in the test process); its output is
    kept beside it, in ``name.log``."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            save = root / name
            run = rapidlite if "--nproc-per-node" in layouts[name] else rapidlite_captured
            proc = run(*argv, *layouts[name], "--train-iters", "6", "--save-interval", "3", "--save", str(save))
            assert proc.returncode == 0, proc.stderr[-3000:]
            (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
            done[name] = save
        return done[name]

    return get


def stopped_copy(run: Path, dest: Path, iteration: int) -> Path:
    """``dest``: a copy of the finished run ``run`` as it was when it stopped after ``iteration`` (a checkpoint
    saved there): no later checkpoint or export, ``latest`` naming it, the metrics records up to it. A resume
    test starts from it instead of training those iterations in a launch of its own."""
    later = [p.name for p in run.glob("iter_*") if int(p.name[len("iter_") :]) > iteration]
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(*later, "hf"))
    (dest / "latest").write_text(f"{iteration}\n")
    records = (dest / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(r for r in records if json.loads(r).get("iteration", 0) <= iteration))
    return dest


def write_tiny_corpus(prefix, vocab=97, eod=96, docs=300, seed=0):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(docs):
        start = int(rng.integers(0, 90))
        builder.add_item(np.append((np.arange(start, start + rng.integers(8, 40)) % 90), eod))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32"]
TINY += ["--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8"]
TINY += ["--lr", "3e-3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "2", "--hidden-dropout", "0.1"]


def bert_run_args(root, num_layers=2, vocab_size=None):
    """Sentence-split data, a WordPiece vocabulary and a tiny BERT config (vocabulary padded to even, or
    ``vocab_size`` entries) in ``root``; returns the --task pretraining flags that train it."""
    from transformers import BertConfig

    from rapidlite.data.preprocess import preprocess
    from rapidlite.data.tokenizers import build_tokenizer, write_wordpiece_vocab

    root.mkdir(parents=True, exist_ok=True)
    docs = english_corpus(200, seed=0)
    source = root / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    vocab = write_wordpiece_vocab(docs, 200, root / "vocab")
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    prefix = preprocess(source, root / "corpus", tokenizer, split_sentences=True, log=None)["text"]
    BertConfig(
        vocab_size=vocab_size or tokenizer.vocab_size + tokenizer.vocab_size % 2, hidden_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
    ).save_pretrained(root / "config")  # fmt: skip
    return [
        "--task", "pretraining", "--pretrained-model-name-or-path", str(root / "config"), "--data-path", prefix,
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab), "--seq-length", "48",
        "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--lr-decay-iters", "5",
        "--eval-interval", "5", "--eval-iters", "1", "--split", "90,10,0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "5",
    ]  # fmt: skip


def word_tokenizer(directory, words, bert: bool, model_max_length: int = 2048):
    """A word-level tokenizer over ``words``, saved in ``directory``: BERT's special tokens and template
    (``bert``), or a causal model's (pad, unk, bos, eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if bert else ["<pad>", "<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*specials, *words])}, unk_token=specials[1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        names = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
        names["mask_token"] = "[MASK]"
    else:
        names = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **names)
    wrapped.save_pretrained(directory)
    return wrapped


def write_jsonl(directory, split, rows):
    """``directory/{split}.jsonl``, one row a line (the directory made); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{split}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def read_jsonl(directory, split="train"):
    return [json.loads(line) for line in open(Path(directory) / f"{split}.jsonl")]


def as_layout(rows, layout):
    """prompt/chosen/rejected text rows in another of TRL's preference layouts: "conversation" (each a one-message
    conversation), "implicit" (the prompt inside both responses) or "text" (as they are)."""
    if layout == "conversation":
        return [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    if layout == "implicit":
        return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    return rows


def assert_same_metrics(run, reference, keys, rel, at_least=1):
    """Every training interval's and evaluation's ``keys`` in ``run``'s metrics.jsonl equal ``reference``'s (the
    same records and names, values within ``rel``), and there are at least ``at_least`` of them."""

    def numbers(save_dir):
        records = [r for r in read_metrics(save_dir) if "loss" in r]
        return [(r.get("split", "train"), k, r[k]) for r in records for k in keys if k in r]

    ours, expected = numbers(run), numbers(reference)
    assert [x[:2] for x in ours] == [x[:2] for x in expected] and len(ours) >= at_least
    for (split, key, value), (_, _, want) in zip(ours, expected, strict=True):
        assert abs(value - want) <= max(rel * abs(want), 1e-6), (split, key, value, want)


def big_vocab_llama(model_dir, out):
    """``model_dir``'s tokenizer with a tiny LLaMA (2 x 32) whose output layer has ``MIN_VOCAB`` rows (its ids past
    the tokenizer's never occur), so the chunked output layer (``rapidlite.models.head``) serves it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rapidlite.models.head import MIN_VOCAB

    config = LlamaConfig.from_pretrained(model_dir)
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.update(dict(vocab_size=MIN_VOCAB, tie_word_embeddings=False, **sizes))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out
