"""Offline assets for ``rapidlite --task causal_lm --demo``: an instruction task made on the machine.

The task is a small skill: "reverse the words: red fox blue" answered "blue fox red", over a few dozen
words and 3-5 words per prompt, so the validation prompts are word sequences never seen in training and
an exact match needs the skill, not memory. The data are prompt/completion jsonl files; the tokenizer is a
byte-level BPE trained on them (every word one token); the model a randomly initialised tiny LLaMA, all in
Hugging Face format in the rapidlite cache. The untrained model completes nothing exactly; a few minutes of
fine-tuning on a CPU get most completions right.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil

from rapidlite.cache import build_once, cache_root
from rapidlite.config.tasks import Demo

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 1
VOCAB_SIZE = 400
MODEL_SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
# fmt: off
WORDS = (
    "red", "blue", "green", "black", "white", "gold", "fox", "cat", "dog", "bird", "fish", "wolf", "tree", "river",
    "stone", "cloud", "moon", "sun", "rain", "snow", "ship", "house", "road", "lamp",
)
# fmt: on
PROMPT = "reverse the words: {words}\n"

DEMO_FLAGS = {
    "micro_batch_size": 16,
    "lr": 2e-3,
    "epochs": 3,
    "seq_length": 64,
    "log_interval": 25,
    "weight_decay": 0.0,
    "clip_grad": 1.0,
    "eval_generate": 40,
}


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


def write_demo_assets(
    out_dir: str | os.PathLike, seed: int = 1234, num_train: int = 3000, num_validation: int = 200
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write (once) ``out_dir/model`` (tokenizer and tiny LLaMA) and ``out_dir/data`` (train/validation jsonl).
    Returns (model_dir, data_dir). Deterministic for a seed; a concurrent builder's result is as good."""
    final = build_once(out_dir, lambda scratch: _build(scratch, seed, num_train, num_validation))
    return final / "model", final / "data"


def _build(out: pathlib.Path, seed: int, num_train: int, num_validation: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    rng = random.Random(seed)
    seen: set[str] = set()
    splits = {"train": generate_rows(rng, num_train, seen), "validation": generate_rows(rng, num_validation, seen)}
    (out / "data").mkdir()
    for name, rows in splits.items():
        with open(out / "data" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    texts = [r["prompt"] + r["completion"] for r in splits["train"]]
    vocab, merges = train_byte_level_bpe(texts, VOCAB_SIZE, out / "bpe")
    tokenizer = GPT2BPETokenizer(vocab, merges).hf_tokenizer()
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **MODEL_SIZES,
    )
    with torch.random.fork_rng(devices=[]):  # seeding must not change the caller's RNG stream
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(model_dir)
    shutil.rmtree(out / "bpe")


def _demo_root() -> pathlib.Path:
    return pathlib.Path(cache_root()) / f"demo-causal-lm-v{GENERATOR_VERSION}"


def prepare_demo() -> None:
    """Write (once) the embedded demo: a tiny LLaMA, its tokenizer and the word-reversal data in the cache."""
    write_demo_assets(_demo_root())


def demo() -> Demo:
    """``--task causal_lm --demo``: where ``prepare_demo`` writes the model and the data."""
    root = _demo_root()
    assets = {"pretrained_model_name_or_path": str(root / "model"), "data_path": [str(root / "data")]}
    return Demo(defaults=DEMO_FLAGS, assets=assets, prepare=prepare_demo)
