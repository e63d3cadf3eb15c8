"""Offline assets for ``rapidlite --task causal_lm --demo``: an instruction task made on the machine.

The task is a small skill: "reverse the words: red fox blue" answered "blue fox red", over a few dozen
words and 3-5 words per prompt, so the validation prompts are word sequences never seen in training and
an exact match needs the skill, not memory. The data are prompt/completion jsonl files; the tokenizer is a
byte-level BPE trained on them (every word one token); the model a randomly initialised tiny LLaMA, all in
Hugging Face format in the rapidlite cache. The untrained model completes nothing exactly; a few minutes of
fine-tuning on a CPU get most completions right.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rapidlite.tasks.demo_build import DemoBuild, DemoSpec, write_jsonl

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 1
VOCAB_SIZE = 400
# fmt: off
WORDS = (
    "red", "blue", "green", "black", "white", "gold", "fox", "cat", "dog", "bird", "fish", "wolf", "tree", "river",
    "stone", "cloud", "moon", "sun", "rain", "snow", "ship", "house", "road", "lamp",
)
# fmt: on
PROMPT = "reverse the words: {words}\n"


def generate_rows(rng: random.Random, count: int, seen: set[str]) -> list[dict[str, str]]:
    """``count`` prompt/completion rows whose word sequences are not in ``seen`` (updated), so splits differ."""
    rows: list[dict[str, str]] = []
    while len(rows) < count:
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 5))]
        key = " ".join(words)
        if key in seen:
            continue
        seen.add(key)
        rows.append({"prompt": PROMPT.format(words=key), "completion": " ".join(reversed(words))})
    return rows


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict[str, str]]]:
    """The prompt/completion rows of each split; no word sequence is in two splits."""
    rng, seen = random.Random(seed), set()
    return {name: generate_rows(rng, count, seen) for name, count in sizes.items()}


def build_tokenizer(build: DemoBuild) -> Any:
    """A byte-level BPE trained on the training texts (every word one token)."""
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    texts = [r["prompt"] + r["completion"] for r in build.splits["train"]]
    vocab, merges = train_byte_level_bpe(texts, VOCAB_SIZE, build.scratch)
    return GPT2BPETokenizer(vocab, merges).hf_tokenizer()


def token_config(tokenizer: Any) -> dict[str, int]:
    """LLaMA's token ids; padding is the end-of-text token."""
    eos = tokenizer.eos_token_id
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }


# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 16, "lr": 2e-3, "epochs": 3, "seq_length": 64, "log_interval": 25, "weight_decay": 0.0,
    "clip_grad": 1.0, "eval_generate": 40,
}

# ``--task causal_lm --demo``: a tiny LLaMA with tied embeddings, and the word-reversal data as jsonl.
demo = DemoSpec(
    "causal-lm", GENERATOR_VERSION, splits={"train": 3000, "validation": 200},
    generate=generate, write_split=write_jsonl, suffix=".jsonl", tokenizer=build_tokenizer,
    model="LlamaForCausalLM", token_config=token_config, flags=DEMO_FLAGS,
    config={"tie_word_embeddings": True, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": 128},
)
# fmt: on
write_demo_assets = demo.write_assets
