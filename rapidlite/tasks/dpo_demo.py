"""Offline assets for ``rapidlite --task dpo --demo``: preference pairs on the causal-LM demo's skill.

The skill is the causal-LM demo's ("reverse the words: red fox blue" answered "blue fox red"). The model is that
demo's tiny LLaMA after a short supervised fine-tuning (``SFT_STEPS`` steps on prompts of its own, made here,
seeded): it has half learnt the skill, and its greedy answers are often near misses. The pairs prefer the correct
reversal to a near miss (two neighbouring words swapped, or the words left in their order), so preference training
raises the share of pairs the model ranks right (``rewards/accuracies``) and of exact greedy answers over the SFT
model's (``exact_match``, scored before training and after it).
"""

from __future__ import annotations

import pathlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rapidlite.tasks import causal_lm_demo
from rapidlite.tasks.demo import TIME_BUDGET
from rapidlite.tasks.demo_build import DemoSpec, write_jsonl

GENERATOR_VERSION = 1
SFT_ROWS = 600
SFT_STEPS = 120
SFT_BATCH = 16
SFT_LR = 2e-3


def near_miss(words: list[str], rng: random.Random) -> str:
    """A wrong answer close to the right one (``words`` reversed): two neighbours swapped, or no reversal."""
    right = list(reversed(words))
    if rng.random() < 0.3 and words != right:
        return " ".join(words)
    i = rng.randrange(len(right) - 1)
    wrong = right[:i] + [right[i + 1], right[i]] + right[i + 2 :]
    if wrong == right:  # the two words are the same: swap another pair, or drop the last word
        wrong = right[1:] + right[:1] if len(set(right)) > 1 else right[:-1]
    return " ".join(wrong)


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict[str, str]]]:
    """The pairs of each split, and the SFT rows (``sft``): no word sequence is in two of them."""
    rng, seen = random.Random(seed), set()
    out = {"sft": causal_lm_demo.generate_rows(rng, SFT_ROWS, seen)}
    for name, count in sizes.items():
        rows = causal_lm_demo.generate_rows(rng, count, seen)
        out[name] = [
            {
                "prompt": r["prompt"],
                "chosen": r["completion"],
                "rejected": near_miss(r["completion"].split()[::-1], rng),
            }
            for r in rows
        ]
    return out


def write_split(path: pathlib.Path, rows: list[dict[str, str]]) -> None:
    if path.stem == "sft":  # the SFT rows stay out of the data the run reads
        path = path.parent.parent / "sft.jsonl"
    write_jsonl(path, rows)


def sft(model: Any, tokenizer: Any, rows: list[dict[str, str]], seed: int) -> None:
    """A short supervised fine-tuning of ``model`` on ``rows`` (the response tokens and EOS trained)."""
    import torch
    import torch.nn.functional as F

    encoded = []
    for r in rows:
        prompt = tokenizer(r["prompt"])["input_ids"]
        ids = tokenizer(r["prompt"] + r["completion"])["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((ids, [-100] * len(prompt) + ids[len(prompt) :]))
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(SFT_STEPS):
            batch = rng.sample(encoded, SFT_BATCH)
            length = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [tokenizer.eos_token_id] * (length - len(i)) for i, _ in batch])
            labels = torch.tensor([lab + [-100] * (length - len(lab)) for _, lab in batch])
            mask = torch.tensor([[1] * len(i) + [0] * (length - len(i)) for i, _ in batch])
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@dataclass(frozen=True)
class SFTDemoSpec(DemoSpec):
    """The causal-LM demo's model, fine-tuned on the ``sft`` rows before the pairs train it."""

    def _write_model(self, model_dir: pathlib.Path, tokenizer: Any, seed: int) -> None:
        import json

        import transformers

        from rapidlite.models.hf import plain_save

        super()._write_model(model_dir, tokenizer, seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        rows = [json.loads(line) for line in open(model_dir.parent / "sft.jsonl", encoding="utf-8")]
        sft(model, tokenizer, rows, seed)
        with plain_save():
            model.save_pretrained(model_dir)


def build_tokenizer(build: Any) -> Any:
    """The causal-LM demo's byte-level BPE, trained on the SFT rows' texts and the pairs' (every word a token)."""
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    texts = [r["prompt"] + r["completion"] for r in build.splits["sft"]]
    texts += [r["prompt"] + r["chosen"] for r in build.splits["train"]]
    vocab, merges = train_byte_level_bpe(texts, causal_lm_demo.VOCAB_SIZE, build.scratch)
    return GPT2BPETokenizer(vocab, merges).hf_tokenizer()


# fmt: off
# RPO (--rpo-alpha: DPO plus the chosen answers' NLL): plain DPO lowers the chosen answers' likelihood with the
# rejected ones' here (exact match 0.23 -> 0.01 in one epoch), RPO raises it (0.23 -> 0.54 in two).
DEMO_FLAGS = {
    "time_budget": TIME_BUDGET, "micro_batch_size": 16, "lr": 1e-3, "epochs": 2, "seq_length": 64,
    "log_interval": 10, "weight_decay": 0.0, "clip_grad": 1.0, "eval_generate": 100, "beta": 0.1, "rpo_alpha": 1.0,
}

# ``--task dpo --demo``: the causal-LM demo's LLaMA after a short SFT, and prompt/chosen/rejected jsonl.
demo = SFTDemoSpec(
    "dpo", GENERATOR_VERSION, splits={"train": 1500, "validation": 100},
    generate=generate, write_split=write_split, suffix=".jsonl", tokenizer=build_tokenizer,
    model="LlamaForCausalLM", token_config=causal_lm_demo.token_config, flags=DEMO_FLAGS,
    config=causal_lm_demo.demo.config,
)
# fmt: on
write_demo_assets = demo.write_assets
