"""Data pipeline: preprocessing throughput, dataset read throughput and the data path's share of a training step.

    python benchmarks/data_pipeline.py            # about 25 seconds on 2 cores
    python benchmarks/data_pipeline.py --quick    # a slice of the corpus and a tiny model, to check the script works

Everything runs in this one invocation, in a temporary directory, on the embedded corpus of
``rapidlite --task pretraining`` (the standard-library docstrings, ``write_corpus``; ``--quick``: the first
documents the library yields, unshuffled) with the demo's byte-level tokenizer (``train_byte_level_bpe(texts,
257, dir)``):

1. Preprocessing: ``preprocess(..., append_eod=True)`` with ``workers=1`` and ``workers=2``, alternated
   and repeated; median documents/s and MB/s (input JSON-lines bytes), the ratio workers 2 / workers 1.
   Check: every run writes byte-identical ``.bin``/``.idx`` files.
2. Reading, at the demo's shapes (seq 256, micro-batch 8): the GPT dataset
   (``build_train_valid_test_datasets``, mmap ``.bin``) through a ``DataLoader`` (batch 8, no worker
   processes), against the same samples stored in a Hugging Face ``datasets.Dataset``
   (``from_dict``, ``save_to_disk``, ``load_from_disk``, ``with_format("torch")``) read by the same
   ``DataLoader``. Both passes are alternated and repeated over the same K batches; median samples/s and
   tokens/s (a sample is seq + 1 tokens), the ratio mmap / datasets. Check: both serve identical tokens.
3. Cost in training: training steps of the demo model (``GPTModel``: 4 layers, hidden 256, 4 heads,
   seq 256; fp32, fused AdamW, gradient clipping 1.0, one micro-batch of 8 per step; ``--quick``: a
   1-layer hidden-64 model) that pull their batches from the mmap ``DataLoader``. Per step the batch fetch
   and the rest of the step (``gpt_batch``, forward, backward, optimizer) are timed apart; medians over
   the steps after the warmup. Target: the fetch costs under 2% of a step.

The table's ``speedup`` is a row's rate over the first row of its group (``workers=1``; ``datasets``);
the ``% of step`` column divides a fetch by the median training step measured in the same run.
Targets are reported, not asserted: the exit status is 1 only when a correctness check fails.
"""

from __future__ import annotations

import argparse
import filecmp
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rapidlite.data.gpt_dataset import build_train_valid_test_datasets, gpt_batch
from rapidlite.data.indexed_dataset import data_file_path, index_file_path
from rapidlite.data.preprocess import preprocess
from rapidlite.data.tokenizers import build_tokenizer, train_byte_level_bpe
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.tasks.pretraining_demo import VOCAB_SIZE, iter_stdlib_documents, write_corpus

SEQ_LENGTH, MICRO_BATCH = 256, 8  # the demo's (pretraining_demo.DEMO_FLAGS)
DEMO_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
TINY_MODEL = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 2}
TARGET_SHARE = 0.02
SEED = 1234


def settings(quick: bool) -> dict:
    if quick:
        return {"documents": 400, "repeats": 1, "batches": 40, "warmup": 1, "steps": 4, "model": TINY_MODEL}
    return {"documents": None, "repeats": 3, "batches": 1000, "warmup": 3, "steps": 12, "model": DEMO_MODEL}


# ----------------------------------------------------------------------------------------- corpus
def build_corpus(tmp: Path, documents: int | None) -> tuple[Path, list[str]]:
    """The corpus file (``write_corpus``: every document, shuffled) and its texts; with ``documents``, only the first
    the library yields, in the same format (the whole library's shuffle parses every file: 17 s of a 22 s quick run)."""
    corpus = tmp / "corpus.jsonl"
    if documents is None:
        write_corpus(corpus)
        texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    else:
        texts = list(itertools.islice(iter_stdlib_documents(), documents))
        corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return corpus, texts


# ------------------------------------------------------------------------------------ preprocessing
def bench_preprocess(corpus: Path, tokenizer, tmp: Path, repeats: int) -> tuple[dict, list[str], bool]:
    """Median seconds per worker count, the output prefixes, and whether every output is byte-identical."""
    times: dict[int, list[float]] = {1: [], 2: []}
    prefixes = []
    for r in range(repeats):
        for workers in (1, 2):
            start = time.perf_counter()
            prefix = str(tmp / f"w{workers}_r{r}")
            out = preprocess(str(corpus), prefix, tokenizer, append_eod=True, workers=workers, log=None)
            times[workers].append(time.perf_counter() - start)
            prefixes.append(out["text"])
    first = prefixes[0]
    identical = all(
        filecmp.cmp(data_file_path(first), data_file_path(p), shallow=False)
        and filecmp.cmp(index_file_path(first), index_file_path(p), shallow=False)
        for p in prefixes[1:]
    )
    return {w: statistics.median(t) for w, t in times.items()}, prefixes, identical


# ------------------------------------------------------------------------------------------ reading
def read_pass(loader: torch.utils.data.DataLoader, keep: list | None = None) -> tuple[float, list[float]]:
    """Seconds to iterate ``loader`` once (iterator creation included) and the seconds of each fetch."""
    fetches = []
    start = time.perf_counter()
    iterator = iter(loader)
    while True:
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        fetches.append(time.perf_counter() - before)
        if keep is not None:
            keep.append(batch["text"])
    return time.perf_counter() - start, fetches


def hf_dataset(gpt_dataset, tmp: Path):
    """The samples of ``gpt_dataset``, in its order, as a Hugging Face dataset saved to and loaded from disk."""
    import datasets

    samples = np.stack([gpt_dataset[i]["text"].numpy() for i in range(len(gpt_dataset))])
    datasets.Dataset.from_dict({"text": samples}).save_to_disk(str(tmp / "hf_dataset"))
    return datasets.load_from_disk(str(tmp / "hf_dataset")).with_format("torch")


def bench_read(gpt_dataset, hf, repeats: int) -> tuple[dict, bool]:
    loaders = {
        name: torch.utils.data.DataLoader(ds, batch_size=MICRO_BATCH, shuffle=False, num_workers=0)
        for name, ds in (("mmap", gpt_dataset), ("hf", hf))
    }
    kept: dict[str, list] = {"mmap": [], "hf": []}
    for name, loader in loaders.items():  # warm the page cache and check the tokens, untimed
        read_pass(loader, kept[name])
    same = len(kept["mmap"]) == len(kept["hf"]) and all(
        torch.equal(a, b) for a, b in zip(kept["mmap"], kept["hf"], strict=True)
    )
    seconds: dict[str, list[float]] = {"mmap": [], "hf": []}
    fetches: dict[str, list[float]] = {"mmap": [], "hf": []}
    for _ in range(repeats):
        for name, loader in loaders.items():
            total, per_batch = read_pass(loader)
            seconds[name].append(total)
            fetches[name].extend(per_batch)
    result = {
        name: {"seconds": statistics.median(seconds[name]), "fetch": statistics.median(fetches[name])}
        for name in loaders
    }
    return result, same


# ----------------------------------------------------------------------------------------- training
def bench_training(gpt_dataset, eod: int, model_size: dict, warmup: int, steps: int) -> dict:
    """Median seconds of the batch fetch and of the rest of a training step, measured step by step."""
    torch.manual_seed(SEED)
    config = GPTConfig(
        vocab_size=VOCAB_SIZE, seq_length=SEQ_LENGTH, hidden_dropout=0.0, attention_dropout=0.0, **model_size
    )
    model = GPTModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    loader = torch.utils.data.DataLoader(gpt_dataset, batch_size=MICRO_BATCH, shuffle=False, num_workers=0)
    iterator = iter(loader)
    fetch, compute = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        try:
            text = next(iterator)["text"]
        except StopIteration:
            iterator = iter(loader)
            text = next(iterator)["text"]
        fetched = time.perf_counter()
        batch = gpt_batch(text, eod)
        optimizer.zero_grad(set_to_none=True)
        loss_sum, n = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        (loss_sum / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        done = time.perf_counter()
        if step >= warmup:
            fetch.append(fetched - start)
            compute.append(done - fetched)
    return {
        "fetch": statistics.median(fetch),
        "compute": statistics.median(compute),
        "parameters": model.num_parameters(),
    }


# --------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a corpus slice and a tiny model: checks the script only")
    args = parser.parse_args()
    cfg = settings(args.quick)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never look for the hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="rapidlite-bench-") as name:
        tmp = Path(name)
        corpus, texts = build_corpus(tmp, cfg["documents"])
        vocab, merges = train_byte_level_bpe(texts, VOCAB_SIZE, tmp / "tokenizer")
        tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
        corpus_bytes = corpus.stat().st_size

        pre, prefixes, identical = bench_preprocess(corpus, tokenizer, tmp, cfg["repeats"])
        num_samples = cfg["batches"] * MICRO_BATCH
        train, _, _ = build_train_valid_test_datasets([prefixes[0]], "1", [num_samples, 0, 0], SEQ_LENGTH, SEED)
        tokens = int(train.indexed.sequence_lengths.sum())
        hf = hf_dataset(train, tmp)
        read, same_tokens = bench_read(train, hf, cfg["repeats"])
        step = bench_training(train, tokenizer.eod, cfg["model"], cfg["warmup"], cfg["steps"])
        del hf  # release the Arrow memory map before the directory goes

    docs = len(texts)
    sample_tokens = SEQ_LENGTH + 1
    print(
        f"corpus: {docs} documents, {corpus_bytes / 1e6:.2f} MB, {tokens} tokens; reads: {num_samples} samples "
        f"of {sample_tokens} tokens in batches of {MICRO_BATCH}; model: {step['parameters'] / 1e6:.2f}M parameters; "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"{'stage':<22} {'median s':>9} {'docs/s':>9} {'MB/s':>7} {'samples/s':>10} {'tokens/s':>10} {'speedup':>7}")
    for workers in (1, 2):
        s = pre[workers]
        print(
            f"{f'preprocess workers={workers}':<22} {s:>9.3f} {docs / s:>9.0f} {corpus_bytes / s / 1e6:>7.2f} "
            f"{'-':>10} {'-':>10} {pre[1] / s:>7.2f}"
        )
    for key, label in (("hf", "read HF datasets"), ("mmap", "read mmap GPTDataset")):
        s = read[key]["seconds"]
        print(
            f"{label:<22} {s:>9.3f} {'-':>9} {'-':>7} {num_samples / s:>10.0f} "
            f"{num_samples * sample_tokens / s:>10.0f} {read['hf']['seconds'] / s:>7.2f}"
        )
    share = step["fetch"] / step["compute"]
    print(f"{'step / fetch':<22} {'median ms':>9} {'% of step':>10}")
    print(f"{'train step':<22} {step['compute'] * 1e3:>9.2f} {'100.00':>10}")
    print(f"{'fetch in training':<22} {step['fetch'] * 1e3:>9.3f} {share * 100:>10.2f}")
    for key, label in (("mmap", "fetch mmap alone"), ("hf", "fetch HF alone")):
        print(f"{label:<22} {read[key]['fetch'] * 1e3:>9.3f} {read[key]['fetch'] / step['compute'] * 100:>10.2f}")

    print(f"check preprocess outputs byte-identical (workers 1 and 2): {'ok' if identical else 'FAILED'}")
    print(f"check mmap and datasets samples identical: {'ok' if same_tokens else 'FAILED'}")
    if args.quick:
        print("quick mode: speeds are not meaningful")
    print(f"preprocess workers 2 vs 1: x{pre[1] / pre[2]:.2f}")
    print(f"mmap vs datasets read: x{read['hf']['seconds'] / read['mmap']['seconds']:.2f}")
    met = "met" if share < TARGET_SHARE else "MISSED"
    print(f"data path: {share * 100:.2f}% of a step (target < {TARGET_SHARE * 100:.0f}%): {met}")
    return 0 if identical and same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
