"""Offline assets for ``rapidlite --task masked_lm --demo``: domain text made on the machine and a tiny BERT.

The domain is clinic notes ("the patient reports palpitations and chest pain for 4 days . the echocardiogram
confirms a murmur ."): documents of 4-8 sentences from shared templates, each note in one of eight specialties
whose symptoms, findings, tests, treatments and body parts it draws from, written one document per line as
``train.txt`` and ``validation.txt``. The tokenizer is a WordPiece vocabulary of every generated word
(``rapidlite.tasks.demo.build_wordpiece_tokenizer``); the model a randomly initialised 2-layer BERT with a
masked-LM head, all in Hugging Face format in the rapidlite cache. The untrained model's perplexity is about the
vocabulary's size (about 250); a minute of masked-LM training on a CPU brings it to a fraction of that, first by
learning which words a note's specialty goes with.
"""

from __future__ import annotations

import os
import pathlib
import random

from rapidlite.cache import build_once, cache_root
from rapidlite.config.tasks import Demo

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 4
MAX_POSITIONS = 128
MODEL_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PUNCTUATION = (".", ",")
# specialty -> (symptoms, findings, tests, treatments, body parts)
# fmt: off
SPECIALTIES = {
    "cardiology": (("palpitations", "chest pain", "breathlessness", "fainting", "swollen ankles", "fatigue"),
                   ("a murmur", "an arrhythmia", "high pressure", "a weak pulse", "fluid", "an enlarged heart"),
                   ("echocardiogram", "ecg", "stress test", "angiogram"),
                   ("beta blockers", "aspirin", "statins", "diuretics", "a pacemaker"),
                   ("heart", "chest", "ankles", "arteries")),
    "dermatology": (("itching", "a rash", "dry skin", "blisters", "redness", "scaling"),
                    ("eczema", "psoriasis", "a mole", "dermatitis", "acne", "hives"),
                    ("biopsy", "patch test", "skin scraping", "dermoscopy"),
                    ("steroid cream", "emollients", "antihistamines", "phototherapy", "retinoids"),
                    ("skin", "scalp", "elbows", "face")),
    "neurology": (("headaches", "numbness", "dizziness", "tremor", "seizures", "weakness"),
                  ("a migraine", "neuropathy", "a lesion", "epilepsy", "a stroke", "slow reflexes"),
                  ("mri", "eeg", "lumbar puncture", "nerve study"),
                  ("triptans", "anticonvulsants", "physiotherapy", "gabapentin", "rest"),
                  ("brain", "spine", "nerves", "hands")),
    "orthopedics": (("knee pain", "stiffness", "a limp", "back pain", "swelling", "clicking"),
                    ("a fracture", "arthritis", "a torn ligament", "a sprain", "bursitis", "a dislocation"),
                    ("x ray", "ct scan", "ultrasound", "bone scan"),
                    ("a cast", "a brace", "surgery", "ice", "crutches"),
                    ("knee", "hip", "wrist", "shoulder")),
    "gastroenterology": (("nausea", "heartburn", "bloating", "abdominal pain", "diarrhoea", "vomiting"),
                         ("reflux", "gastritis", "an ulcer", "colitis", "gallstones", "a polyp"),
                         ("endoscopy", "colonoscopy", "stool test", "breath test"),
                         ("antacids", "omeprazole", "a bland diet", "probiotics", "fluids"),
                         ("stomach", "bowel", "liver", "oesophagus")),
    "pulmonology": (("coughing", "wheezing", "shortness of breath", "sputum", "night sweats", "chest tightness"),
                    ("asthma", "bronchitis", "pneumonia", "a nodule", "emphysema", "crackles"),
                    ("spirometry", "chest x ray", "oximetry", "sputum culture"),
                    ("inhalers", "antibiotics", "oxygen", "nebulisers", "prednisolone"),
                    ("lungs", "airways", "throat", "ribs")),
    "ophthalmology": (("blurred vision", "eye pain", "floaters", "watery eyes", "light sensitivity", "halos"),
                      ("cataracts", "glaucoma", "conjunctivitis", "a detached retina", "dry eye", "myopia"),
                      ("eye exam", "tonometry", "retinal scan", "field test"),
                      ("eye drops", "glasses", "laser treatment", "lubricants", "an eye patch"),
                      ("eyes", "retina", "cornea", "eyelids")),
    "endocrinology": (("thirst", "weight gain", "weight loss", "tiredness", "frequent urination", "sweating"),
                      ("diabetes", "hypothyroidism", "a goitre", "low sugar", "high sugar", "an overactive thyroid"),
                      ("blood test", "glucose test", "thyroid scan", "hba1c"),
                      ("insulin", "metformin", "levothyroxine", "a diet plan", "carbimazole"),
                      ("thyroid", "pancreas", "glands", "neck")),
}
# fmt: on
# A tiny BERT learns a masked word from its context only after a plateau at the words' frequencies (600-800
# steps here, longer with dropout): short blocks and small batches pass it in the first of three epochs.
DEMO_FLAGS = {
    "micro_batch_size": 16,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "lr": 3e-3,
    "epochs": 3,
    "seq_length": 32,
    "log_interval": 100,
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "lr_warmup_iters": 20,
}


def _sentence(rng: random.Random, specialty: str) -> str:
    symptoms, findings, tests, treatments, parts = SPECIALTIES[specialty]
    kind = rng.randrange(6)
    if kind == 0:
        first, second = rng.sample(symptoms, 2)
        return f"the patient reports {first} and {second} for {rng.randint(2, 14)} days ."
    if kind == 1:
        return f"examination of the {rng.choice(parts)} shows {rng.choice(findings)} ."
    if kind == 2:
        return f"the {rng.choice(tests)} confirms {rng.choice(findings)} ."
    if kind == 3:
        return f"we start {rng.choice(treatments)} and review in {rng.randint(2, 14)} weeks ."
    if kind == 4:
        return f"{rng.choice(symptoms)} improved after {rng.choice(treatments)} ."
    return f"referred to {specialty} for {rng.choice(symptoms)} , {rng.choice(tests)} booked ."


def generate_document(rng: random.Random) -> str:
    """One clinic note: 4-8 sentences of one specialty."""
    specialty = rng.choice(sorted(SPECIALTIES))
    return " ".join(_sentence(rng, specialty) for _ in range(rng.randint(4, 8)))


def demo_vocabulary(documents: list[str]) -> list[str]:
    words = {w for doc in documents for w in doc.split()} - set(PUNCTUATION)
    return list(SPECIAL_TOKENS) + sorted(words) + list(PUNCTUATION)


def write_demo_assets(
    out_dir: str | os.PathLike, seed: int = 1234, num_train: int = 6000, num_validation: int = 300
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write (once) ``out_dir/model`` (tokenizer and tiny BERT masked LM) and ``out_dir/data`` (train.txt,
    validation.txt: one document per line). Returns (model_dir, data_dir). Deterministic for a seed."""
    final = build_once(out_dir, lambda scratch: _build(scratch, seed, num_train, num_validation))
    return final / "model", final / "data"


def _build(out: pathlib.Path, seed: int, num_train: int, num_validation: int) -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from rapidlite.tasks.demo import build_wordpiece_tokenizer

    rng = random.Random(seed)
    splits = {
        "train": [generate_document(rng) for _ in range(num_train)],
        "validation": [generate_document(rng) for _ in range(num_validation)],
    }
    (out / "data").mkdir()
    for name, documents in splits.items():
        (out / "data" / f"{name}.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    model_dir = out / "model"
    model_dir.mkdir()
    vocab = demo_vocabulary(splits["train"] + splits["validation"])
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = build_wordpiece_tokenizer(model_dir / "vocab.txt", model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(model_dir)
    config = BertConfig(vocab_size=len(vocab), max_position_embeddings=MAX_POSITIONS, pad_token_id=0, **MODEL_SIZES)
    with torch.random.fork_rng(devices=[]):  # seeding must not change the caller's RNG stream
        torch.manual_seed(seed)
        BertForMaskedLM(config).save_pretrained(model_dir)


def _demo_root() -> pathlib.Path:
    return pathlib.Path(cache_root()) / f"demo-masked-lm-v{GENERATOR_VERSION}"


def prepare_demo() -> None:
    """Write (once) the embedded demo: a tiny BERT masked LM, its tokenizer and the clinic notes in the cache."""
    write_demo_assets(_demo_root())


def demo() -> Demo:
    """``--task masked_lm --demo``: where ``prepare_demo`` writes the model and the data."""
    root = _demo_root()
    assets = {"pretrained_model_name_or_path": str(root / "model"), "data_path": [str(root / "data")]}
    return Demo(defaults=DEMO_FLAGS, assets=assets, prepare=prepare_demo)
