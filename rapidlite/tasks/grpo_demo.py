"""Offline assets for ``rapidlite --task grpo --demo``: online RL of a verifiable skill with a rule-based reward.

The skill is the causal-LM demo's ("reverse the words: red fox blue" answered "blue fox red"). The model is the
DPO demo's: that demo's tiny LLaMA after a short supervised fine-tuning, which has learnt the shape of the answers
and half learnt the skill (``dpo_demo.sft``). The prompts carry their ``answer``; two rule-based rewards check the
completions against it: ``positions`` (the share of the answer's words at their place, the reward trained on) and
``exact`` (1 for the whole answer, weight 0: the accuracy, logged as ``rewards/exact/mean``). The run samples 8
completions a prompt; the validation prompts' mean reward rises from the SFT model's (about 0.6) to above 0.8 in
under a minute on a CPU, and their accuracy rises with it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rapidlite.tasks import causal_lm_demo, dpo_demo
from rapidlite.tasks.demo import TIME_BUDGET

GENERATOR_VERSION = 1


def _words(completion: Any) -> list[str]:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return text.split()


def positions(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """The share of the answer's words the completion has at their place (extra words count against it)."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        got, right = _words(completion), want.split()
        hits = sum(a == b for a, b in zip(got, right, strict=False))
        out.append(hits / max(len(right), len(got), 1))
    return out


def exact(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1 for the whole answer and nothing else, else 0."""
    return [float(_words(c) == a.split()) for c, a in zip(completions, answer, strict=True)]


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict[str, str]]]:
    """The SFT rows (``sft``) and each split's prompts with their answers; no word sequence is in two of them."""
    rng, seen = random.Random(seed), set()
    out = {"sft": causal_lm_demo.generate_rows(rng, dpo_demo.SFT_ROWS, seen)}
    for name, count in sizes.items():
        rows = causal_lm_demo.generate_rows(rng, count, seen)
        out[name] = [{"prompt": r["prompt"], "answer": r["completion"]} for r in rows]
    return out


def build_tokenizer(build: Any) -> Any:
    """The causal-LM demo's byte-level BPE, trained on the SFT rows' texts and the prompts with their answers."""
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    texts = [r["prompt"] + r["completion"] for r in build.splits["sft"]]
    texts += [r["prompt"] + r["answer"] for r in build.splits["train"]]
    vocab, merges = train_byte_level_bpe(texts, causal_lm_demo.VOCAB_SIZE, build.scratch)
    return GPT2BPETokenizer(vocab, merges).hf_tokenizer()


REWARDS = [f"{__name__}:positions", f"{__name__}:exact"]
# fmt: off
# Measured here: the validation reward 0.56 -> 0.86 and the accuracy 0.13 -> 0.39 in 300 steps (38 s); a third
# epoch adds nothing (0.86 and 0.41 after 450 steps); a higher learning rate collapses the policy (--lr 4e-3:
# reward 0.36 after 300 steps).
DEMO_FLAGS = {
    "time_budget": TIME_BUDGET, "reward_funcs": REWARDS, "reward_weights": [1.0, 0.0], "num_generations": 8,
    "micro_batch_size": 32, "global_batch_size": 64, "max_completion_length": 8, "lr": 1.5e-3, "epochs": 2,
    "scale_rewards": "batch", "log_interval": 10, "eval_interval": 150, "weight_decay": 0.0, "clip_grad": 1.0,
}

# ``--task grpo --demo``: the DPO demo's SFT model, and prompt/answer jsonl.
demo = dpo_demo.SFTDemoSpec(
    "grpo", GENERATOR_VERSION, splits={"train": 1200, "validation": 32},
    generate=generate, write_split=dpo_demo.write_split, suffix=".jsonl", tokenizer=build_tokenizer,
    model="LlamaForCausalLM", token_config=causal_lm_demo.token_config, flags=DEMO_FLAGS,
    config=causal_lm_demo.demo.config,
)
# fmt: on
write_demo_assets = demo.write_assets
