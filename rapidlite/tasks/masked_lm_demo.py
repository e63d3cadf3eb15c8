"""Offline assets for ``rapidlite --task masked_lm --demo``: domain text made on the machine and a tiny BERT.

The domain is clinic notes ("the patient reports palpitations and chest pain for 4 days . the echocardiogram
confirms a murmur ."): documents of 4-8 sentences from shared templates, each note in one of eight specialties
whose symptoms, findings, tests, treatments and body parts it draws from, written one document per line as
``train.txt`` and ``validation.txt``. The tokenizer is a WordPiece vocabulary of every generated word
(``rapidlite.tasks.demo_build.build_wordpiece_tokenizer``); the model a randomly initialised 2-layer BERT with a
masked-LM head, all in Hugging Face format in the rapidlite cache. The untrained model's perplexity is about the
vocabulary's size (about 250); a minute of masked-LM training on a CPU brings it to a fraction of that, first by
learning which words a note's specialty goes with.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from rapidlite.data.tokenizers import BERT_SPECIAL_TOKENS
from rapidlite.tasks.demo_build import TINY_BERT, DemoBuild, DemoSpec, parse_table, wordpiece_tokenizer, write_lines

# Bump when the generator, tokenizer or model changes, so cached assets are rebuilt.
GENERATOR_VERSION = 4
MAX_POSITIONS = 128
PUNCTUATION = (".", ",")
# specialty, then its symptoms, findings, tests, treatments and body parts
# fmt: off
SPECIALTIES = parse_table("""
cardiology
    palpitations, chest pain, breathlessness, fainting, swollen ankles, fatigue
    a murmur, an arrhythmia, high pressure, a weak pulse, fluid, an enlarged heart
    echocardiogram, ecg, stress test, angiogram
    beta blockers, aspirin, statins, diuretics, a pacemaker
    heart, chest, ankles, arteries
dermatology
    itching, a rash, dry skin, blisters, redness, scaling
    eczema, psoriasis, a mole, dermatitis, acne, hives
    biopsy, patch test, skin scraping, dermoscopy
    steroid cream, emollients, antihistamines, phototherapy, retinoids
    skin, scalp, elbows, face
neurology
    headaches, numbness, dizziness, tremor, seizures, weakness
    a migraine, neuropathy, a lesion, epilepsy, a stroke, slow reflexes
    mri, eeg, lumbar puncture, nerve study
    triptans, anticonvulsants, physiotherapy, gabapentin, rest
    brain, spine, nerves, hands
orthopedics
    knee pain, stiffness, a limp, back pain, swelling, clicking
    a fracture, arthritis, a torn ligament, a sprain, bursitis, a dislocation
    x ray, ct scan, ultrasound, bone scan
    a cast, a brace, surgery, ice, crutches
    knee, hip, wrist, shoulder
gastroenterology
    nausea, heartburn, bloating, abdominal pain, diarrhoea, vomiting
    reflux, gastritis, an ulcer, colitis, gallstones, a polyp
    endoscopy, colonoscopy, stool test, breath test
    antacids, omeprazole, a bland diet, probiotics, fluids
    stomach, bowel, liver, oesophagus
pulmonology
    coughing, wheezing, shortness of breath, sputum, night sweats, chest tightness
    asthma, bronchitis, pneumonia, a nodule, emphysema, crackles
    spirometry, chest x ray, oximetry, sputum culture
    inhalers, antibiotics, oxygen, nebulisers, prednisolone
    lungs, airways, throat, ribs
ophthalmology
    blurred vision, eye pain, floaters, watery eyes, light sensitivity, halos
    cataracts, glaucoma, conjunctivitis, a detached retina, dry eye, myopia
    eye exam, tonometry, retinal scan, field test
    eye drops, glasses, laser treatment, lubricants, an eye patch
    eyes, retina, cornea, eyelids
endocrinology
    thirst, weight gain, weight loss, tiredness, frequent urination, sweating
    diabetes, hypothyroidism, a goitre, low sugar, high sugar, an overactive thyroid
    blood test, glucose test, thyroid scan, hba1c
    insulin, metformin, levothyroxine, a diet plan, carbimazole
    thyroid, pancreas, glands, neck
""")
# fmt: on


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
    return list(BERT_SPECIAL_TOKENS) + sorted(words) + list(PUNCTUATION)


def generate(seed: int, sizes: Mapping[str, int]) -> dict[str, list[str]]:
    """The clinic notes of each split."""
    rng = random.Random(seed)
    return {name: [generate_document(rng) for _ in range(count)] for name, count in sizes.items()}


def build_tokenizer(build: DemoBuild) -> Any:
    """The WordPiece tokenizer over every word of the documents."""
    documents = [document for documents in build.splits.values() for document in documents]
    return wordpiece_tokenizer(build.model_dir, demo_vocabulary(documents), MAX_POSITIONS)


# A tiny BERT learns a masked word from its context only after a plateau at the words' frequencies (600-800
# steps here, longer with dropout): short blocks and small batches pass it in the first of three epochs.
# fmt: off
DEMO_FLAGS = {
    "micro_batch_size": 16, "hidden_dropout": 0.0, "attention_dropout": 0.0, "lr": 3e-3, "epochs": 3, "seq_length": 32,
    "log_interval": 100, "weight_decay": 0.01, "clip_grad": 1.0, "lr_warmup_iters": 20,
}

# ``--task masked_lm --demo``: a tiny BERT masked LM, and the notes one document per line (train.txt, validation.txt).
demo = DemoSpec(
    "masked-lm", GENERATOR_VERSION, splits={"train": 6000, "validation": 300}, flags=DEMO_FLAGS,
    generate=generate, write_split=write_lines, suffix=".txt", tokenizer=build_tokenizer,
    model="BertForMaskedLM", config={"max_position_embeddings": MAX_POSITIONS, **TINY_BERT},
)
# fmt: on
write_demo_assets = demo.write_assets
