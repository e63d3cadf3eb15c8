"""Offline assets for ``rapidlite --task multiple_choice --demo``: SWAG-style questions made on the machine.

Each question sets a scene in one of eight settings ("Maya went to the bakery .") and starts what happens
next ("Then maya"); of its four endings only one is something done there ("chopped the
onions ."), the other three belong to other settings ("changed the tyre .", ...). The rows are in SWAG's columns
(``sent1``, ``sent2``, ``ending0`` .. ``ending3``, ``label``) in ``train.csv`` and ``validation.csv``. The
tokenizer is a WordPiece vocabulary of every generated word (``rapidlite.tasks.demo.build_wordpiece_tokenizer``),
the model a randomly initialised 2-layer BERT with a multiple-choice head, all in Hugging Face format in the
rapidlite cache. The untrained model is right on about a quarter of the questions (chance); a few minutes of
fine-tuning on a CPU get most of them right.
"""

from __future__ import annotations

import csv
import os
import pathlib
import random

from rapidlite.cache import build_once, cache_root
from rapidlite.config.tasks import Demo

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 5
NUM_CHOICES = 4
MAX_POSITIONS = 64
MODEL_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PUNCTUATION = (".", ",")
# setting -> (places, things done there)
# fmt: off
SETTINGS = {
    "kitchen": (("kitchen", "bakery", "restaurant"),
                ("baked fresh bread", "chopped the onions", "washed the dishes", "stirred the soup",
                 "cracked two eggs", "heated the oven")),
    "beach": (("beach", "harbour", "seaside"),
              ("swam in the waves", "built a sand castle", "collected shells", "sailed a small boat",
               "watched the surfers", "put on sun cream")),
    "forest": (("forest", "woods", "mountain trail"),
               ("chopped some firewood", "watched a deer", "picked wild berries", "pitched a tent",
                "followed the stream", "climbed a tall pine")),
    "library": (("library", "bookshop", "reading room"),
                ("borrowed three novels", "read a history book", "returned the atlas", "studied for the exam",
                 "whispered to the librarian", "found an old map")),
    "garage": (("garage", "workshop", "car park"),
               ("changed the tyre", "fixed the engine", "checked the oil", "washed the car", "painted the bike",
                "sharpened the saw")),
    "garden": (("garden", "greenhouse", "allotment"),
               ("planted tomato seeds", "watered the roses", "mowed the lawn", "pulled the weeds",
                "picked ripe apples", "raked the leaves")),
    "gym": (("gym", "sports hall", "swimming pool"),
            ("lifted heavy weights", "ran on the treadmill", "stretched after training", "joined a yoga class",
             "skipped with a rope", "played basketball")),
    "office": (("office", "meeting room", "bank"),
               ("answered the emails", "printed the report", "called a client", "signed the contract",
                "planned the budget", "booked a meeting")),
}
NAMES = ("maya", "tom", "lena", "omar", "sara", "jonas", "ines", "ravi", "chen", "ada")
ARRIVALS = ("went to", "arrived at")
# fmt: on
# Whether an ending fits needs the context (no word of an ending is right or wrong alone): a tiny BERT learns it
# after a plateau at chance, which short questions, small batches and no dropout keep to a few hundred steps here
# (longer scenes, with a day and varied starts, stayed at chance for thousands). At 1e-3 and above some data orders
# fall into a state where every choice scores the same and the gradients vanish; 5e-4 escaped with every order tried.
DEMO_FLAGS = {
    "micro_batch_size": 8,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "lr": 5e-4,
    "epochs": 3,
    "seq_length": MAX_POSITIONS,
    "log_interval": 100,
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "lr_warmup_iters": 20,
}


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
    return list(SPECIAL_TOKENS) + sorted(words) + list(PUNCTUATION)


def write_demo_assets(
    out_dir: str | os.PathLike, seed: int = 1234, num_train: int = 4000, num_validation: int = 400
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write (once) ``out_dir/model`` (tokenizer and tiny BERT for multiple choice) and ``out_dir/data``
    (train.csv, validation.csv in SWAG's columns). Returns (model_dir, data_dir). Deterministic for a seed."""
    final = build_once(out_dir, lambda scratch: _build(scratch, seed, num_train, num_validation))
    return final / "model", final / "data"


def _build(out: pathlib.Path, seed: int, num_train: int, num_validation: int) -> None:
    import torch
    from transformers import BertConfig, BertForMultipleChoice

    from rapidlite.tasks.demo import build_wordpiece_tokenizer

    rng = random.Random(seed)
    splits = {
        "train": [generate_row(rng) for _ in range(num_train)],
        "validation": [generate_row(rng) for _ in range(num_validation)],
    }
    (out / "data").mkdir()
    columns = ["sent1", "sent2", *(f"ending{i}" for i in range(NUM_CHOICES)), "label"]
    for name, rows in splits.items():
        with open(out / "data" / f"{name}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
    model_dir = out / "model"
    model_dir.mkdir()
    vocab = demo_vocabulary()
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = build_wordpiece_tokenizer(model_dir / "vocab.txt", model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(model_dir)
    config = BertConfig(vocab_size=len(vocab), max_position_embeddings=MAX_POSITIONS, pad_token_id=0, **MODEL_SIZES)
    with torch.random.fork_rng(devices=[]):  # seeding must not change the caller's RNG stream
        torch.manual_seed(seed)
        BertForMultipleChoice(config).save_pretrained(model_dir)


def _demo_root() -> pathlib.Path:
    return pathlib.Path(cache_root()) / f"demo-multiple-choice-v{GENERATOR_VERSION}"


def prepare_demo() -> None:
    """Write (once) the embedded demo: a tiny BERT for multiple choice, its tokenizer and the questions."""
    write_demo_assets(_demo_root())


def demo() -> Demo:
    """``--task multiple_choice --demo``: where ``prepare_demo`` writes the model and the data."""
    root = _demo_root()
    assets = {"pretrained_model_name_or_path": str(root / "model"), "data_path": [str(root / "data")]}
    return Demo(defaults=DEMO_FLAGS, assets=assets, prepare=prepare_demo)
