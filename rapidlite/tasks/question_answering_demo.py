"""Offline assets for ``rapidlite --task question_answering --demo``: reading comprehension made on the machine.

Each context tells five facts about one person in a random order ("Olga moved to Porto during 1991. Olga likes
chess. Olga studied at Oslo. Olga dislikes tennis. Olga was born in Krakow in 1998."), and each question asks
for one of them ("Which city did Olga move to?", "During which year did Olga move?", "What is the hobby Olga
dislikes?"). Every context holds three cities, two years and two hobbies, so the kind of answer alone leaves
two or three candidates (guessing among them scores about 43% exact match): the model has to read which
words stand before each candidate. The data are SQuAD-style jsonl files (``id``, ``context``, ``question``,
``answers``); the tokenizer is a lower-casing WordPiece over the generator's words; the model a randomly
initialised tiny BERT, all in Hugging Face format in the rapidlite cache.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rapidlite.data.tokenizers import BERT_SPECIAL_TOKENS
from rapidlite.tasks.demo_build import TINY_BERT, DemoBuild, DemoSpec, wordpiece_tokenizer, write_jsonl

if TYPE_CHECKING:
    import torch

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 1
MAX_POSITIONS = 128
# Random weights, but sinusoidal position embeddings (Vaswani et al.) at this scale: an answer is found by the
# word before it ("moved to X"), and a learned table takes a tiny BERT minutes to relate neighbours.
POSITION_SCALE = 0.3
# fmt: off
NAMES = (
    "Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas", "Karin", "Lars",
    "Maria", "Nils", "Olga", "Peter", "Rosa", "Simon", "Tina", "Viktor", "Wanda", "Yusuf", "Zora", "Omar",
)
CITIES = (
    "Oslo", "Lyon", "Porto", "Krakow", "Vienna", "Dublin", "Riga", "Geneva", "Naples", "Bergen", "Seville",
    "Leipzig", "Turin", "Ghent", "Malmo", "Zagreb", "Tallinn", "Lisbon", "Munich", "Bruges",
)
PLACES = (
    "the bakery", "the library", "the city hospital", "a small bank", "the harbour", "the train station",
    "the old museum", "a flower shop", "the town school", "the post office", "a shoe factory", "the zoo",
)
HOBBIES = (
    "chess", "tennis", "painting", "sailing", "cooking", "jazz", "gardening", "poetry", "cycling", "football",
    "photography", "climbing",
)
# fmt: on
YEARS = tuple(str(y) for y in range(1940, 2000))
PUNCTUATION = (".", "?")
TEMPLATE_WORDS = (
    "was", "born", "in", "studied", "moved", "to", "during", "at", "likes", "dislikes", "where", "did", "which",
    "year", "city", "what", "study", "move", "is", "the", "hobby",
)  # fmt: skip
QUESTIONS_PER_CONTEXT = 3


def _facts(rng: random.Random) -> list[tuple[str, list[tuple[str, str]]]]:
    """One person's facts in a random order: each a sentence and the (question, answer) pairs it answers. Three
    cities, two years and two hobbies per person: an answer's kind alone leaves two or three candidates."""
    n = rng.choice(NAMES)
    born, studied, moved = rng.sample(CITIES, 3)
    y_born, y_moved = rng.sample(YEARS, 2)
    liked, disliked = rng.sample(HOBBIES, 2)
    facts = [
        (
            f"{n} was born in {born} in {y_born}.",
            [(f"Where was {n} born?", born), (f"In which year was {n} born?", y_born)],
        ),
        (f"{n} studied at {studied}.", [(f"Where did {n} study?", studied)]),
        (
            f"{n} moved to {moved} during {y_moved}.",
            [(f"Which city did {n} move to?", moved), (f"During which year did {n} move?", y_moved)],
        ),
        (f"{n} likes {liked}.", [(f"What is the hobby {n} likes?", liked)]),
        (f"{n} dislikes {disliked}.", [(f"What is the hobby {n} dislikes?", disliked)]),
    ]
    rng.shuffle(facts)
    return facts


def generate_rows(rng: random.Random, count: int, prefix: str) -> list[dict]:
    """``count`` SQuAD-style rows, a few questions per context, ids ``{prefix}-{n}``; an answer's offset is in
    the sentence that tells it."""
    rows: list[dict] = []
    while len(rows) < count:
        context, pairs = "", []
        for sentence, questions in _facts(rng):
            context += (" " if context else "") + sentence
            offset = len(context) - len(sentence)
            pairs += [(question, answer, context.index(answer, offset)) for question, answer in questions]
        for question, answer, start in rng.sample(pairs, QUESTIONS_PER_CONTEXT):
            rows.append(
                {
                    "id": f"{prefix}-{len(rows)}",
                    "context": context,
                    "question": question,
                    "answers": {"text": [answer], "answer_start": [start]},
                }
            )
    return rows[:count]


def sinusoids(positions: int, dim: int) -> torch.Tensor:
    """The Transformer's sinusoidal position table: sin on even, cos on odd dimensions."""
    import torch

    position = torch.arange(positions, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(positions, dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


def demo_vocabulary() -> list[str]:
    words: set[str] = set(TEMPLATE_WORDS) | {w.lower() for w in NAMES + CITIES + HOBBIES} | set(YEARS)
    for place in PLACES:
        words.update(place.split())
    return list(BERT_SPECIAL_TOKENS) + sorted(words) + list(PUNCTUATION)


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict]]:
    """The questions of each split, ids ``train-N`` and ``val-N``."""
    rng = random.Random(seed)
    return {name: generate_rows(rng, count, "val" if name == "validation" else name) for name, count in sizes.items()}


def build_tokenizer(build: DemoBuild) -> Any:
    """The WordPiece tokenizer over the generator's words, checked on the first training rows."""
    tokenizer = wordpiece_tokenizer(build.model_dir, demo_vocabulary(), MAX_POSITIONS)
    for row in build.splits["train"][:60]:  # the vocabulary must cover every generated word
        ids = tokenizer(row["question"], row["context"])["input_ids"]
        if tokenizer.unk_token_id in ids or len(ids) < 10:
            raise RuntimeError(f"demo tokenizer is broken: {row} -> {ids}")
    return tokenizer


def sinusoidal_positions(model: Any) -> None:
    """The randomly initialised model's position table replaced by the scaled sinusoids (``POSITION_SCALE``)."""
    import torch

    with torch.no_grad():
        model.bert.embeddings.position_embeddings.weight.copy_(
            POSITION_SCALE * sinusoids(MAX_POSITIONS, model.config.hidden_size)
        )


# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 16, "lr": 2e-3, "epochs": 8, "seq_length": 64, "doc_stride": 16, "log_interval": 50,
    "weight_decay": 0.01, "clip_grad": 1.0, "lr_warmup_iters": 20,
}

# ``--task question_answering --demo``: a tiny BERT with sinusoidal positions and the questions as jsonl.
demo = DemoSpec(
    "question-answering", GENERATOR_VERSION, splits={"train": 3000, "validation": 300}, flags=DEMO_FLAGS,
    generate=generate, write_split=write_jsonl, suffix=".jsonl", tokenizer=build_tokenizer,
    model="BertForQuestionAnswering", init=sinusoidal_positions,
    config={"max_position_embeddings": MAX_POSITIONS, **TINY_BERT},
)
# fmt: on
write_demo_assets = demo.write_assets
