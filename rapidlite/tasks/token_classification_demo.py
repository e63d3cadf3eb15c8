"""Offline assets for ``rapidlite --task token_classification --demo``: named entities made on the machine.

Sentences from templates tag people (``PER``), places (``LOC``) and organisations (``ORG``), many of several words
("Anna Rose", "Salt Lake City", "Bank of Green Bay"), in IOB2 CoNLL files. The same words play every part: "Jordan"
is a person in one sentence and a place in the next, "Rose" a surname, a flower ("a red rose") and a verb
("shares of Hill Motors rose"), "Green" a surname, part of a place, of a company and a colour. Only the context
tells which, so remembering each word's usual tag (the baseline the run logs) falls well short; the tokenizer
is lowercasing WordPiece with a small vocabulary (many words are several pieces), the model a randomly
initialised 2-layer BERT, all in Hugging Face format in the rapidlite cache.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

from rapidlite.tasks.demo_build import TINY_BERT, DemoBuild, DemoSpec, build_wordpiece_tokenizer

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 1
VOCAB_SIZE = 360  # below the 170 distinct words plus pieces: a third of the words are split into pieces
MAX_POSITIONS = 128
TAGS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG")

# fmt: off
# First names that are also places, and places that are also first names: only the context decides.
AMBIGUOUS_NAMES = ("jordan", "georgia", "victoria", "florence", "austin", "madison", "sydney", "charlotte", "lincoln")
FIRST_NAMES = ("anna", "maria", "james", "peter", "laura", "david", "sofia", "omar", "yuki", "elena", "tomas", "amara")
# Surnames that are also common words (used as such below).
SURNAMES = (
    "smith", "garcia", "tanaka", "novak", "okafor", "rossi", "baker", "young", "king", "rose", "brown", "hill",
    "wood", "stone", "park", "long", "green", "bell", "hunter", "fox",
)
CITIES = ("berlin", "lagos", "lima", "oslo", "cairo", "madrid", "quito", "hanoi", "perth", "dublin")
MULTI_WORD_PLACES = (
    "new york", "green bay", "long beach", "rock hill", "park city", "palm springs", "salt lake city",
    "little rock", "san jose", "hong kong", "new delhi", "stone harbor",
)
ORG_SUFFIXES = ("group", "motors", "bank", "labs", "records", "foods", "airlines", "press")
ORG_WORDS = ("united", "general", "royal", "golden", "blue", "star", "rock", "green", "long", "new")
ROLES = ("teacher", "doctor", "painter", "lawyer", "farmer", "pilot", "singer", "banker")
DAYS = ("monday", "tuesday", "friday", "sunday")
# Sentences with no entity, built from the same ambiguous words.
ADJECTIVES = ("young", "brown", "green", "long", "little", "new", "royal", "golden", "blue", "old", "red", "quiet")
NOUNS = (
    "king", "rose", "hill", "wood", "stone", "park", "bell", "hunter", "fox", "bank", "city", "star", "rock",
    "group", "river", "garden", "road", "bay", "harbor", "beach", "press",
)
VERBS = ("saw", "found", "passed", "painted", "liked", "watched", "left", "built", "visited", "rose above")
PREPOSITIONS = ("near", "behind", "beside", "past", "under")
# fmt: on


def _words(text: str, tag: str | None = None) -> list[tuple[str, str]]:
    """``text``'s words tagged ``tag`` in IOB2 (B- on the first, I- on the rest), capitalised; None: all O."""
    words = text.split()
    if tag is None:
        return [(w, "O") for w in words]
    return [(w.capitalize(), ("B-" if i == 0 else "I-") + tag) for i, w in enumerate(words)]


def _person(rng: random.Random) -> list[tuple[str, str]]:
    first = rng.choice(AMBIGUOUS_NAMES if rng.random() < 0.4 else FIRST_NAMES)
    shape = rng.random()
    name = first if shape < 0.2 else rng.choice(SURNAMES) if shape < 0.35 else f"{first} {rng.choice(SURNAMES)}"
    return _words(name, "PER")


def _place(rng: random.Random) -> list[tuple[str, str]]:
    shape = rng.random()
    pool = AMBIGUOUS_NAMES if shape < 0.35 else MULTI_WORD_PLACES if shape < 0.7 else CITIES
    return _words(rng.choice(pool), "LOC")


def _organisation(rng: random.Random) -> list[tuple[str, str]]:
    shape = rng.random()
    if shape < 0.3:
        name = f"{rng.choice(SURNAMES)} {rng.choice(ORG_SUFFIXES)}"
    elif shape < 0.55:
        name = f"{rng.choice(ORG_WORDS)} {rng.choice(ORG_SUFFIXES)}"
    elif shape < 0.8:
        place = rng.choice(CITIES + MULTI_WORD_PLACES + AMBIGUOUS_NAMES)
        name = f"{rng.choice(('bank', 'university'))} of {place}"
    else:
        name = f"{rng.choice(CITIES + AMBIGUOUS_NAMES)} {rng.choice(ORG_SUFFIXES)}"
    tagged = _words(name, "ORG")
    return [("of", t) if w == "Of" else (w, t) for w, t in tagged]


def _plain_sentence(rng: random.Random) -> list[tuple[str, str]]:
    def thing() -> str:
        return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"

    return _words(f"{thing()} {rng.choice(VERBS)} {thing()} {rng.choice(PREPOSITIONS)} {thing()} .")


def generate_sentence(rng: random.Random) -> list[tuple[str, str]]:
    """One sentence as (word, IOB2 tag) pairs."""
    per, loc, org = (lambda: _person(rng)), (lambda: _place(rng)), (lambda: _organisation(rng))
    o = _words
    templates = (
        lambda: [*per(), *o(f"said on {rng.choice(DAYS)} that the plan would work .")],
        lambda: [*o("yesterday"), *per(), *o("met"), *per(), *o("for lunch .")],
        lambda: [*per(), *o(f", a {rng.choice(ROLES)} from"), *loc(), *o(", won the prize .")],
        lambda: [*o("according to"), *per(), *o(", prices will rise .")],
        lambda: [*o("heavy rain fell in"), *loc(), *o(f"on {rng.choice(DAYS)} .")],
        lambda: [*per(), *o("moved to"), *loc(), *o("last year .")],
        lambda: [*o("the train from"), *loc(), *o("to"), *loc(), *o("was late .")],
        lambda: [*org(), *o("opened a new office in"), *loc(), *o(".")],
        lambda: [*per(), *o("joined"), *org(), *o(f"as a {rng.choice(ROLES)} .")],
        lambda: [*o("shares of"), *org(), *o(f"rose {rng.randint(2, 9)} percent on {rng.choice(DAYS)} .")],
        lambda: [*org(), *o("hired"), *per(), *o(f"as its new {rng.choice(ROLES)} .")],
        lambda: [*org(), *o("signed a deal with"), *org(), *o(".")],
        lambda: [*o("a new store in"), *loc(), *o("belongs to"), *org(), *o(".")],
    )
    if rng.random() < 0.25:
        sentence = _plain_sentence(rng)
    else:
        sentence = rng.choice(templates)()
    word, tag = sentence[0]
    return [(word[0].upper() + word[1:], tag), *sentence[1:]]


def generate_sentences(rng: random.Random, count: int, seen: set[str]) -> list[list[tuple[str, str]]]:
    """``count`` sentences whose text is not in ``seen`` (updated), so splits never share a sentence."""
    out = []
    while len(out) < count:
        sentence = generate_sentence(rng)
        key = " ".join(w for w, _ in sentence)
        if key not in seen:
            seen.add(key)
            out.append(sentence)
    return out


def write_conll(path: str | os.PathLike, sentences: list[list[tuple[str, str]]]) -> None:
    """CoNLL-2003's layout: ``-DOCSTART-`` first, then one ``word tag`` line per word, a blank line after each
    sentence."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("-DOCSTART- O\n\n")
        for sentence in sentences:
            f.writelines(f"{word} {tag}\n" for word, tag in sentence)
            f.write("\n")


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[list[tuple[str, str]]]]:
    """The tagged sentences of each split; no sentence is in two splits."""
    rng, seen = random.Random(seed), set()
    return {name: generate_sentences(rng, count, seen) for name, count in sizes.items()}


def build_tokenizer(build: DemoBuild) -> Any:
    """Lowercasing WordPiece with a vocabulary of ``VOCAB_SIZE`` trained on the training sentences."""
    from rapidlite.data.tokenizers import write_wordpiece_vocab

    texts = [" ".join(w for w, _ in sentence) for sentence in build.splits["train"]]
    return build_wordpiece_tokenizer(write_wordpiece_vocab(texts, VOCAB_SIZE, build.scratch), MAX_POSITIONS)


# Flag values the demo starts from; any flag given on the command line wins.
# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 32, "lr": 2e-3, "epochs": 3, "seq_length": 64, "log_interval": 20, "weight_decay": 0.01,
    "clip_grad": 1.0,
}

# ``--task token_classification --demo``: a tiny BERT tagger and the sentences as CoNLL files.
demo = DemoSpec(
    "token-classification", GENERATOR_VERSION, model="BertForTokenClassification", labels=TAGS,
    splits={"train": 3000, "validation": 400, "test": 400}, generate=generate, write_split=write_conll,
    suffix=".conll", tokenizer=build_tokenizer, flags=DEMO_FLAGS,
    config={"max_position_embeddings": MAX_POSITIONS, **TINY_BERT},
)
# fmt: on
write_demo_assets = demo.write_assets
