"""The embedded default of ``rapidlite --task pretraining``: a corpus every machine with Python has.

The text is extracted at run time from the installed Python standard library — the docstrings of its
modules, classes and functions, read with ``ast`` (nothing is imported or executed), and the reference
topics of ``pydoc_data`` — a few MB of English prose. It is written once to the rapidlite cache as JSONL
(documents in a seeded shuffled order, so the validation split samples the whole library), a byte-level
tokenizer (GPT-2's byte-level BPE files with no merges: 256 bytes and ``<|endoftext|>``) is trained on it,
and ``rapidlite-preprocess`` turns it into Megatron's ``.bin/.idx``. Nothing is downloaded and no text is
stored in the repository. Byte-level tokens make a small model learn visibly within minutes on a CPU; the
unigram entropy of the tokens is logged as the baseline a model that ignores context would reach.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import random
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator

from rapidlite.config.tasks import Demo
from rapidlite.runtime.cache import build_once, cache_root

# Bump when the extraction, tokenizer or preprocessing changes, so cached assets are rebuilt.
CORPUS_VERSION = 1
VOCAB_SIZE = 257  # byte-level: the 256 bytes and <|endoftext|>
STATS = "stats.json"
MIN_CHARS = 40  # shorter docstrings ("Return x.") carry little prose

# Flag values the embedded run starts from; any flag given on the command line wins. The run is sized to end
# within TIME_BUDGET minutes of the command's start (corpus preparation included) on whatever machine runs it:
# after a few timed steps it takes the iterations that fit, at most train_iters (--train-iters N runs N).
TIME_BUDGET = 3.5
DEMO_FLAGS = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "seq_length": 256,
    "micro_batch_size": 8,
    "global_batch_size": 16,
    "train_iters": 2000,
    "time_budget": TIME_BUDGET,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "lr_decay_style": "cosine",
    "lr_warmup_iters": 30,
    "weight_decay": 0.1,
    "eval_interval": 100,
    "eval_iters": 4,
    "log_interval": 25,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "split": "98,2,0",
}


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """The module and its statements (and except/case clauses) in ``ast.walk``'s breadth-first order, without
    visiting expressions: docstrings only sit on statements, and walking every expression node took half of the
    corpus preparation."""
    queue = deque([tree])
    while queue:
        node = queue.popleft()
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                queue.extend(item for item in value if isinstance(item, _BLOCKS))
        yield node


def iter_stdlib_documents() -> Iterator[str]:
    """Docstrings of the standard library's Python files, in a fixed order, then the reference topics."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse((pathlib.Path(directory) / name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            for node in _statements(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= MIN_CHARS:
                        yield doc
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        return
    for key in sorted(topics):
        if len(topics[key]) >= MIN_CHARS:
            yield topics[key]


def write_corpus(path: pathlib.Path, seed: int = 1234) -> int:
    """Write the corpus as JSONL (``{"text": ...}`` per line) in a seeded shuffled order, so the
    document-level train/valid split draws both from every part of the library; returns the count."""
    docs = list(iter_stdlib_documents())
    random.Random(seed).shuffle(docs)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    return len(docs)


def demo_dir() -> pathlib.Path:
    version = f"v{CORPUS_VERSION}-vocab{VOCAB_SIZE}-py{sys.version_info.major}{sys.version_info.minor}"
    return pathlib.Path(cache_root()) / f"demo-pretraining-{version}"


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of the best model that ignores context."""
    import numpy as np

    from rapidlite.data.indexed_dataset import IndexedDataset

    tokens = np.concatenate([np.asarray(seq) for seq in IndexedDataset(prefix)])
    counts = np.bincount(tokens).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def demo() -> Demo:
    """``--task pretraining`` without data (or with ``--demo``): the embedded corpus, its tokenizer and its
    mmap data, where ``prepare_pretraining_demo`` builds them."""
    final = demo_dir()
    assets = {
        "data_path": [str(final / "corpus_text_document")],
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": str(final / "vocab.json"),
        "merge_file": str(final / "merges.txt"),
    }
    return Demo(defaults=DEMO_FLAGS, assets=assets, prepare=prepare_pretraining_demo)


def prepare_pretraining_demo() -> None:
    """Build (once) the embedded corpus, its tokenizer and its mmap data."""
    from rapidlite.data.indexed_dataset import IndexedDataset
    from rapidlite.data.preprocess import preprocess
    from rapidlite.data.tokenizers import build_tokenizer, train_byte_level_bpe

    def build(scratch: pathlib.Path) -> None:
        print(
            f"rapidlite: preparing the embedded corpus (standard-library docstrings) in {final} — once",
            file=sys.stderr,
            flush=True,
        )
        corpus = scratch / "corpus.jsonl"
        write_corpus(corpus)
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        vocab, merges = train_byte_level_bpe(texts, VOCAB_SIZE, scratch)
        tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
        workers = min(2, os.cpu_count() or 1)
        preprocess(str(corpus), str(scratch / "corpus"), tokenizer, append_eod=True, workers=workers, log=None)
        stats = {
            "documents": len(texts),
            "tokens": int(sum(len(s) for s in IndexedDataset(str(scratch / "corpus_text_document")))),
            "unigram_entropy": unigram_entropy(str(scratch / "corpus_text_document")),
        }
        (scratch / STATS).write_text(json.dumps(stats))

    final = demo_dir()
    build_once(final, build)
    stats = json.loads((final / STATS).read_text())
    print(
        f"rapidlite: embedded corpus: {stats['documents']} documents, {stats['tokens']} tokens (byte-level); "
        f"a model that ignores context (unigram) scores {stats['unigram_entropy']:.3f} nats/token",
        file=sys.stderr,
        flush=True,
    )
