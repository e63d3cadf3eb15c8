"""Offline assets for ``rapidlite --task seq2seq --demo``: a translation task made on the machine.

The "language" is an artificial one (ISO 639 ``art``) with its own words for a few dozen English ones and its
own word order: adjectives follow their noun, the verb closes the clause, a place comes last with a
postposition. "the old fox sees the red boat near the house" is "ka tare tali ka zore vako sudi demi ne". Each
role has words of its own (animals and people act on things; they are old or young, things are coloured), so
the reordering goes by word class. A translation needs the lexicon and the reordering; the validation
sentences are word combinations never seen in training. The data are ``{"translation": {"en": ..., "art":
...}}`` jsonl files (the WMT layout); the tokenizer is a word-level vocabulary of both languages built with
``tokenizers``; the model a randomly initialised tiny T5, all in Hugging Face format in the rapidlite cache. The
untrained model's BLEU is 0; a minute of training on a CPU translates almost every sentence right.
"""

from __future__ import annotations

import json
import os
import pathlib
import random

from rapidlite.cache import build_once, cache_root
from rapidlite.config.tasks import Demo

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 1
SOURCE_LANG, TARGET_LANG = "en", "art"
PREFIX = "translate English to Artificial: "
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5's ids: padding (also the decoder's start) 0, end 1
MODEL_SIZES = {"d_model": 128, "d_ff": 256, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "d_kv": 32}
# fmt: off
SUBJECTS = ("fox", "cat", "dog", "bird", "wolf", "horse", "farmer", "child", "sailor", "king")
OBJECTS = ("apple", "stone", "boat", "lamp", "letter", "song", "bell", "cloud", "ring", "basket")
PLACES = ("river", "house", "garden", "bridge", "tower", "road")
SUBJECT_ADJECTIVES = ("old", "young", "small", "big", "quiet", "brave", "tired", "happy")
OBJECT_ADJECTIVES = ("red", "blue", "green", "dark", "bright", "golden", "heavy", "broken")
VERBS = ("sees", "likes", "follows", "finds", "watches", "paints", "carries", "keeps", "hears", "builds")
SYLLABLES = (
    "ka", "lo", "mi", "re", "tu", "sa", "vo", "ne", "di", "ba", "po", "ri", "me", "su", "ta", "ko", "li", "de",
    "va", "no", "fe", "gu", "zo", "hi",
)
# fmt: on
DETERMINER, POSTPOSITION = "ka", "ne"  # "the", "near"
ENGLISH = (*SUBJECTS, *OBJECTS, *PLACES, *SUBJECT_ADJECTIVES, *OBJECT_ADJECTIVES, *VERBS)  # the lexicon's words

DEMO_FLAGS = {
    "micro_batch_size": 32,
    "lr": 2e-3,
    "epochs": 3,
    "seq_length": 32,
    "max_target_length": 24,
    "log_interval": 25,
    "weight_decay": 0.0,
    "clip_grad": 1.0,
    "source_lang": SOURCE_LANG,
    "target_lang": TARGET_LANG,
    "source_prefix": PREFIX,
}


def lexicon(seed: int = 1234) -> dict[str, str]:
    """English word -> artificial word: two-syllable words, distinct, none equal to an English word."""
    rng = random.Random(seed)
    reserved = {DETERMINER, POSTPOSITION, *ENGLISH}
    words: dict[str, str] = {}
    for english in ENGLISH:
        while True:
            word = rng.choice(SYLLABLES) + rng.choice(SYLLABLES)
            if word not in reserved and word not in words.values():
                words[english] = word
                break
    return words


def translate(
    words: dict[str, str], noun: str, adj: str | None, verb: str, noun2: str, adj2: str | None, place: str | None
) -> tuple[str, str]:
    """One sentence pair: English word order, and the artificial one (noun before adjective, verb last, place
    after the clause with a postposition)."""

    def english_phrase(n: str, a: str | None) -> list[str]:
        return ["the", *([a] if a else []), n]

    def artificial_phrase(n: str, a: str | None) -> list[str]:
        return [DETERMINER, words[n], *([words[a]] if a else [])]

    source = [*english_phrase(noun, adj), verb, *english_phrase(noun2, adj2)]
    target = [*artificial_phrase(noun, adj), *artificial_phrase(noun2, adj2), words[verb]]
    if place:
        source += ["near", "the", place]
        target += [words[place], POSTPOSITION]
    return " ".join(source), " ".join(target)


def generate_rows(rng: random.Random, words: dict[str, str], count: int, seen: set[str]) -> list[dict]:
    """``count`` translation pairs whose English side is not in ``seen`` (updated), so splits differ."""
    rows: list[dict] = []
    while len(rows) < count:
        source, target = translate(
            words,
            rng.choice(SUBJECTS),
            rng.choice(SUBJECT_ADJECTIVES) if rng.random() < 0.6 else None,
            rng.choice(VERBS),
            rng.choice(OBJECTS),
            rng.choice(OBJECT_ADJECTIVES) if rng.random() < 0.6 else None,
            rng.choice(PLACES) if rng.random() < 0.4 else None,
        )
        if source in seen:
            continue
        seen.add(source)
        rows.append({"translation": {SOURCE_LANG: source, TARGET_LANG: target}})
    return rows


def vocabulary(words: dict[str, str]) -> list[str]:
    """Every token the data can hold: the specials, both languages' words and the prefix's words."""
    english = ["the", "near", *ENGLISH]
    artificial = [DETERMINER, POSTPOSITION, *words.values()]
    vocab = list(SPECIAL_TOKENS)
    for token in (*PREFIX.split(), *english, *artificial):
        if token not in vocab:
            vocab.append(token)
    return vocab


def build_tokenizer(vocab: list[str]):
    """A word-level tokenizer over ``vocab`` that ends every text with ``</s>``, as T5's does, wrapped for
    transformers (it decodes to the words joined by spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def write_demo_assets(
    out_dir: str | os.PathLike, seed: int = 1234, num_train: int = 3000, num_validation: int = 200
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write (once) ``out_dir/model`` (tokenizer and tiny T5) and ``out_dir/data`` (train/validation jsonl).
    Returns (model_dir, data_dir). Deterministic for a seed; a concurrent builder's result is as good."""
    final = build_once(out_dir, lambda scratch: _build(scratch, seed, num_train, num_validation))
    return final / "model", final / "data"


def _build(out: pathlib.Path, seed: int, num_train: int, num_validation: int) -> None:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    words = lexicon(seed)
    rng = random.Random(seed)
    seen: set[str] = set()
    splits = {
        "train": generate_rows(rng, words, num_train, seen),
        "validation": generate_rows(rng, words, num_validation, seen),
    }
    (out / "data").mkdir()
    for name, rows in splits.items():
        with open(out / "data" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    tokenizer = build_tokenizer(vocabulary(words))
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir)
    config = T5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **MODEL_SIZES,
    )
    with torch.random.fork_rng(devices=[]):  # seeding must not change the caller's RNG stream
        torch.manual_seed(seed)
        T5ForConditionalGeneration(config).save_pretrained(model_dir)


def _demo_root() -> pathlib.Path:
    return pathlib.Path(cache_root()) / f"demo-seq2seq-v{GENERATOR_VERSION}"


def prepare_demo() -> None:
    """Write (once) the embedded demo: a tiny T5, its tokenizer and the translation data in the cache."""
    write_demo_assets(_demo_root())


def demo() -> Demo:
    """``--task seq2seq --demo``: where ``prepare_demo`` writes the model and the data."""
    root = _demo_root()
    assets = {"pretrained_model_name_or_path": str(root / "model"), "data_path": [str(root / "data")]}
    return Demo(defaults=DEMO_FLAGS, assets=assets, prepare=prepare_demo)
