"""Workload W of the speed benchmark (``benchmarks/speed.py``), and rapidlite's white-box trainer for it.

A GPT-2-style causal LM (``GPT2LMHeadModel``, dropout 0) on synthetic token rows from a fixed generator:
each row counts from a random start with a random stride (modulo the vocabulary), so the loss falls within
a few steps and two implementations that differ show it in the loss curve. Every contender builds the model
with the same seed and reads the rows in the same order (row 0, 1, 2, ...), so all of them start from the
same weights and see the same batches.

As a user script: ``rapidlite --user-script benchmarks/speed_workload.py --num-layers 6 --hidden-size 384
--num-attention-heads 6 --seq-length 256 --vocab-size 8192 ...`` (the sizes are rapidlite's own flags).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidlite import PreTrainer, RapidliteEngine, get_args

MODEL_SEED = 0
DATA_SEED = 1234


@dataclass(frozen=True)
class Workload:
    layers: int = 6
    hidden: int = 384
    heads: int = 6
    seq: int = 256
    vocab: int = 8192
    micro_batch: int = 8
    accumulation: int = 4
    steps: int = 30
    warmup: int = 10
    lr: float = 3e-4
    weight_decay: float = 0.1
    clip: float = 1.0

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def model_flags(self) -> list[str]:
        """rapidlite flags naming the model and data sizes (read back by ``from_args``)."""
        return [
            *("--num-layers", str(self.layers), "--hidden-size", str(self.hidden)),
            *("--num-attention-heads", str(self.heads), "--seq-length", str(self.seq)),
            *("--vocab-size", str(self.vocab)),
        ]

    @classmethod
    def from_args(cls, args) -> Workload:
        return cls(
            layers=args.num_layers,
            hidden=args.hidden_size,
            heads=args.num_attention_heads,
            seq=args.seq_length,
            vocab=args.vocab_size,
        )


W = Workload()
QUICK = Workload(layers=2, hidden=64, heads=2, seq=64, vocab=512, micro_batch=2, accumulation=2, steps=6, warmup=2)


def build_model(w: Workload) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=w.layers,
        n_embd=w.hidden,
        n_head=w.heads,
        n_positions=w.seq,
        vocab_size=w.vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 lies outside the small vocabulary; nothing here uses them
        eos_token_id=None,
    )
    torch.manual_seed(MODEL_SEED)
    model = GPT2LMHeadModel(config)
    # transformers derives the loss type from the class name, and "GPT2LMHeadModel" names none: the Trainer
    # then divides the loss summed over the T-1 shifted labels by all T labels. Naming it makes the Trainer
    # count the shifted labels, as the model's own mean does (and changes nothing for the other contenders).
    model.loss_type = "ForCausalLM"
    return model


class SyntheticTokens(torch.utils.data.Dataset):
    """``rows`` rows of ``seq`` tokens: ``(start + stride * i) % vocab``, start and stride drawn once."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(DATA_SEED)
        self.starts = torch.randint(0, vocab, (rows,), generator=g)
        self.strides = torch.randint(1, 8, (rows,), generator=g)
        self.seq, self.vocab = seq, vocab

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = (self.starts[i] + self.strides[i] * torch.arange(self.seq)) % self.vocab
        return {"input_ids": row, "labels": row}


def dataset(w: Workload) -> SyntheticTokens:
    return SyntheticTokens(w.steps * w.global_batch, w.seq, w.vocab)


class SpeedPreTrainer(PreTrainer):
    """rapidlite's contender: the model's own loss (the mean over the micro-batch's tokens), as the other
    contenders compute it."""

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        w = Workload.from_args(get_args())
        return SyntheticTokens(train_val_test_num_samples[0], w.seq, w.vocab), None, None

    def model_optimizer_lr_scheduler_provider(self):
        return build_model(Workload.from_args(get_args())), None, None

    def run_forward_step(self, data_iterator, model):
        return model(**next(data_iterator)).loss


if __name__ == "__main__":
    SpeedPreTrainer(engine=RapidliteEngine()).train()
