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

import random
from collections.abc import Mapping
from typing import Any

from rapidlite.tasks.demo_build import DemoSpec, write_jsonl

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


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict]]:
    """The translation pairs of each split (over ``lexicon(seed)``); no English sentence is in two splits."""
    words = lexicon(seed)
    rng, seen = random.Random(seed), set()
    return {name: generate_rows(rng, words, count, seen) for name, count in sizes.items()}


def token_config(tokenizer: Any) -> dict[str, int]:
    """T5's token ids; the decoder starts from padding."""
    pad = tokenizer.pad_token_id
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": pad,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": pad,
    }


# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 32, "lr": 2e-3, "epochs": 3, "seq_length": 32, "max_target_length": 24, "log_interval": 25,
    "weight_decay": 0.0, "clip_grad": 1.0, "source_lang": SOURCE_LANG, "target_lang": TARGET_LANG,
    "source_prefix": PREFIX,
}

# ``--task seq2seq --demo``: a tiny T5, the word-level tokenizer of both languages and the pairs as jsonl.
demo = DemoSpec(
    "seq2seq", GENERATOR_VERSION, config=MODEL_SIZES, token_config=token_config, flags=DEMO_FLAGS,
    splits={"train": 3000, "validation": 200}, generate=generate, write_split=write_jsonl, suffix=".jsonl",
    tokenizer=lambda build: build_tokenizer(vocabulary(lexicon(build.seed))), model="T5ForConditionalGeneration",
)
# fmt: on
write_demo_assets = demo.write_assets
