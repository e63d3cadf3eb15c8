"""Offline assets for ``rapidlite --task multiple_choice --demo``: SWAG-style questions made on the machine.

Each question sets a scene in one of eight settings ("Maya went to the bakery .") and starts what happens
next ("Then maya"); of its four endings only one is something done there ("chopped the
onions ."), the other three belong to other settings ("changed the tyre .", ...). The rows are in SWAG's columns
(``sent1``, ``sent2``, ``ending0`` .. ``ending3``, ``label``) in ``train.csv`` and ``validation.csv``. The
tokenizer is a WordPiece vocabulary of every generated word (``rapidlite.tasks.demo_build.build_wordpiece_tokenizer``),
the model a randomly initialised 2-layer BERT with a multiple-choice head, all in Hugging Face format in the
rapidlite cache. The untrained model is right on about a quarter of the questions (chance); a few minutes of
fine-tuning on a CPU get most of them right.
"""

from __future__ import annotations

import pathlib
import random
from collections.abc import Mapping

from rapidlite.data.tokenizers import BERT_SPECIAL_TOKENS
from rapidlite.tasks.demo_build import TINY_BERT, DemoSpec, parse_table, wordpiece_tokenizer, write_csv

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 5
NUM_CHOICES = 4
MAX_POSITIONS = 64
PUNCTUATION = (".", ",")
# setting, then its places and the things done there
# fmt: off
SETTINGS = parse_table("""
kitchen
    kitchen, bakery, restaurant
    baked fresh bread, chopped the onions, washed the dishes, stirred the soup, cracked two eggs, heated the oven
beach
    beach, harbour, seaside
    swam in the waves, built a sand castle, collected shells, sailed a small boat, watched the surfers,
        put on sun cream
forest
    forest, woods, mountain trail
    chopped some firewood, watched a deer, picked wild berries, pitched a tent, followed the stream,
        climbed a tall pine
library
    library, bookshop, reading room
    borrowed three novels, read a history book, returned the atlas, studied for the exam,
        whispered to the librarian, found an old map
garage
    garage, workshop, car park
    changed the tyre, fixed the engine, checked the oil, washed the car, painted the bike, sharpened the saw
garden
    garden, greenhouse, allotment
    planted tomato seeds, watered the roses, mowed the lawn, pulled the weeds, picked ripe apples, raked the leaves
gym
    gym, sports hall, swimming pool
    lifted heavy weights, ran on the treadmill, stretched after training, joined a yoga class, skipped with a rope,
        played basketball
office
    office, meeting room, bank
    answered the emails, printed the report, called a client, signed the contract, planned the budget,
        booked a meeting
""")
NAMES = ("maya", "tom", "lena", "omar", "sara", "jonas", "ines", "ravi", "chen", "ada")
ARRIVALS = ("went to", "arrived at")
# fmt: on


def generate_row(rng: random.Random) -> dict[str, str | int]:
    """One question in SWAG's columns: the scene, the start of the next sentence, four endings, the right one."""
    setting, *others = rng.sample(sorted(SETTINGS), NUM_CHOICES)
    places, actions = SETTINGS[setting]
    name = rng.choice(NAMES)
    sent1 = f"{name} {rng.choice(ARRIVALS)} the {rng.choice(places)} ."
    endings = [rng.choice(actions)] + [rng.choice(SETTINGS[other][1]) for other in others]
    order = list(range(NUM_CHOICES))
    rng.shuffle(order)
    row: dict[str, str | int] = {"sent1": sent1.capitalize(), "sent2": f"Then {name}"}
    for position, source in enumerate(order):
        row[f"ending{position}"] = endings[source] + " ."
    row["label"] = order.index(0)
    return row


def demo_vocabulary() -> list[str]:
    words = set(NAMES)
    for places, actions in SETTINGS.values():
        for phrase in (*places, *actions):
            words.update(phrase.split())
    for phrase in ARRIVALS:
        words.update(phrase.split())
    words.update(("the", "then"))
    return list(BERT_SPECIAL_TOKENS) + sorted(words) + list(PUNCTUATION)


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[dict[str, str | int]]]:
    """The questions of each split."""
    rng = random.Random(seed)
    return {name: [generate_row(rng) for _ in range(count)] for name, count in sizes.items()}


def write_split(path: pathlib.Path, rows: list[dict[str, str | int]]) -> None:
    """SWAG's columns, in its order."""
    columns = ["sent1", "sent2", *(f"ending{i}" for i in range(NUM_CHOICES)), "label"]
    write_csv(path, columns, ([row[c] for c in columns] for row in rows))


# Whether an ending fits needs the context (no word of an ending is right or wrong alone): a tiny BERT learns it
# after a plateau at chance, which short questions, small batches and no dropout keep to a few hundred steps here
# (longer scenes, with a day and varied starts, stayed at chance for thousands). At 1e-3 and above some data orders
# fall into a state where every choice scores the same and the gradients vanish; 5e-4 escaped with every order tried.
# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 8, "hidden_dropout": 0.0, "attention_dropout": 0.0, "lr": 5e-4, "epochs": 3,
    "seq_length": MAX_POSITIONS, "log_interval": 100, "weight_decay": 0.01, "clip_grad": 1.0, "lr_warmup_iters": 20,
}

# ``--task multiple_choice --demo``: a tiny BERT for multiple choice, the WordPiece tokenizer over every word the
# generator can produce, and the questions (train.csv, validation.csv).
demo = DemoSpec(
    "multiple-choice", GENERATOR_VERSION, generate=generate, splits={"train": 4000, "validation": 400},
    write_split=write_split, suffix=".csv", model="BertForMultipleChoice", flags=DEMO_FLAGS,
    tokenizer=lambda build: wordpiece_tokenizer(build.model_dir, demo_vocabulary(), MAX_POSITIONS),
    config={"max_position_embeddings": MAX_POSITIONS, **TINY_BERT},
)
# fmt: on
write_demo_assets = demo.write_assets
