"""Small models, datasets and trainers shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rapidlite import Finetuner, RapidliteEngine

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
