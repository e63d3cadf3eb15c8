"""The LoRA benchmark's workload (``benchmarks/lora.py``), and rapidlite's white-box trainer for it.

A LLaMA-style causal LM (``LlamaForCausalLM``: RMSNorm, rotary positions, SwiGLU, untied output layer) built
from its config with a fixed seed, on the speed benchmark's synthetic token rows (``SyntheticTokens``: each
row counts from a random start with a random stride), read in the same order by every contender. LoRA on the
seven projections of every block (rapidlite's default for the LLaMA family), dropout 0. The adapters peft
creates draw from torch's generator, so every contender seeds it with ``LORA_SEED`` just before
``get_peft_model``: all start from the same adapters (the benchmark checks it).

As a user script: ``rapidlite --user-script benchmarks/lora_workload.py --num-layers 4 --hidden-size 512
--num-attention-heads 8 --ffn-hidden-size 1376 --seq-length 256 --vocab-size 8192 --lora-rank 16 ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from speed_workload import SyntheticTokens

from rapidlite import PreTrainer, RapidliteEngine, get_args
from rapidlite.models import lora

MODEL_SEED = 0
LORA_SEED = 1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraWorkload:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    ffn: int = 1376
    seq: int = 256
    vocab: int = 8192
    micro_batch: int = 8
    accumulation: int = 2
    steps: int = 16
    warmup: int = 4
    lr: float = 1e-3
    clip: float = 1.0
    rank: int = 16
    alpha: float = 32.0

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
            *("--num-attention-heads", str(self.heads), "--ffn-hidden-size", str(self.ffn)),
            *("--seq-length", str(self.seq), "--vocab-size", str(self.vocab)),
        ]

    def lora_flags(self) -> list[str]:
        return ["--lora-rank", str(self.rank), "--lora-alpha", str(self.alpha), "--lora-dropout", "0"]

    @classmethod
    def from_args(cls, args) -> LoraWorkload:
        return cls(
            layers=args.num_layers,
            hidden=args.hidden_size,
            heads=args.num_attention_heads,
            ffn=args.ffn_hidden_size,
            seq=args.seq_length,
            vocab=args.vocab_size,
        )


L = LoraWorkload()
QUICK = LoraWorkload(
    layers=2, hidden=64, heads=2, ffn=176, seq=64, vocab=512, micro_batch=2, accumulation=2, steps=3, warmup=1, rank=4
)


def build_model(w: LoraWorkload, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model, its weights drawn with ``MODEL_SEED`` (in fp32, then cast: the same weights in every dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        intermediate_size=w.ffn,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        max_position_embeddings=w.seq,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(config).to(dtype)


def peft_config(w: LoraWorkload):
    """The LoRA config rapidlite builds from ``lora_flags`` (rank, alpha, dropout 0, the seven projections)."""
    from peft import LoraConfig

    return LoraConfig(
        r=w.rank, lora_alpha=w.alpha, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM"
    )


def dataset(w: LoraWorkload) -> SyntheticTokens:
    return SyntheticTokens(w.steps * w.global_batch, w.seq, w.vocab)


class LoraPreTrainer(PreTrainer):
    """rapidlite's contender: the model built in the dtype rapidlite loads a base in (``lora.load_kwargs``:
    the compute dtype under LoRA, fp32 for full fine-tuning); ``engine.compose`` applies the LoRA flags."""

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        w = LoraWorkload.from_args(get_args())
        return SyntheticTokens(train_val_test_num_samples[0], w.seq, w.vocab), None, None

    def model_optimizer_lr_scheduler_provider(self):
        engine = self.engine
        dtype = lora.load_kwargs(engine.lora, engine.precision.dtype, engine.device)["dtype"]
        model = build_model(LoraWorkload.from_args(get_args()), dtype)
        torch.manual_seed(LORA_SEED)  # compose creates the adapters next, from this state
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        return model(**next(data_iterator)).loss


if __name__ == "__main__":
    LoraPreTrainer(engine=RapidliteEngine()).train()
