"""Long context: the longest sequence that trains within a fixed per-rank memory budget, with context parallelism.

    python benchmarks/long_context.py            # workload L: about 20 minutes on 2 cores
    python benchmarks/long_context.py --quick    # a tiny model, CP1 and CP2, no search: checks the script only

Workload L: ``rapidlite --task pretraining`` of a LLaMA-shaped config (4 layers, hidden 256, 8 heads, 4
key/value heads, SwiGLU 688, vocabulary 1024), fp32, micro-batch 1, AdamW, on a generated corpus. The layouts:
CP1 (one process), CP2 and CP4 (2 and 4 processes, one thread each), each of the last two by ring (p2p) and by
all-to-all (a2a). The budget is what ``--dry-run`` plans for CP1 at 4096 tokens (so CP1's longest is about
4096 by construction). For each layout:

    longest (plan)     the longest ``--seq-length`` (a multiple of 512) whose ``--dry-run`` peak fits the budget,
                       by doubling and bisection
    longest (run)      the same length, checked by a 2-step run whose logged peak must fit the budget (where it
                       does not, the length steps down by 512, at most three times)
    x CP1              longest (run) over CP1's
    tokens/s           at 4096 tokens (the common length), from a 3-step run's last step

On a CPU the peak is the process's own memory (its resident set without the libraries' file-backed pages): it
includes the Python runtime, which no layout divides, so the ratios here are below what a GPU's (whose peak is
the tensors) would be.

Targets: the longest sequence at least 1.8x CP1's with CP2 and 3.4x with CP4 (either communication).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 688
    vocab: int = 1024
    base: int = 4096  # the length the budget is planned at, and tokens/s is measured at
    step: int = 512
    cap: int = 16  # the search stops at cap x base
    layouts: tuple[str, ...] = ("cp1", "cp2_p2p", "cp2_a2a", "cp4_p2p", "cp4_a2a")
    search: bool = True  # --quick: each layout planned and run at the base length only


L = Workload()
QUICK = Workload(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, base=256, step=128, cap=1,
                 layouts=("cp1", "cp2_p2p"), search=False)  # fmt: skip


def layout_flags(layout: str) -> list[str]:
    cp = int(layout[2])
    if cp == 1:
        return []
    return ["--nproc-per-node", str(cp), "--context-parallel-size", str(cp), "--cp-comm-type", layout[-3:]]


def argv(w: Workload, work: Path, layout: str, seq: int, iterations: int) -> list[str]:
    return [
        "--task", "pretraining", "--pretrained-model-name-or-path", str(work / "config"),
        "--data-path", str(work / "corpus"), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(w.vocab - 1),
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
        "--no-progress", "--train-iters", str(iterations), "--log-interval", "1", *layout_flags(layout),
    ]  # fmt: skip


def rapidlite(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536", "RAPIDLITE_NO_CURVES": "1"}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "rapidlite", *args], capture_output=True, text=True, env=env)


def planned_peak(w: Workload, work: Path, layout: str, seq: int) -> float:
    """The peak ``--dry-run`` plans for rank 0, in bytes."""
    proc = rapidlite([*argv(w, work, layout, seq, 2), "--dry-run"])
    if proc.returncode != 0:
        raise SystemExit(f"{layout}: --dry-run at --seq-length {seq} failed:\n{proc.stderr[-2000:]}")
    row = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["0"])
    value, unit = row.split()[-2:]
    return float(value) * {"MiB": 2**20, "GiB": 2**30}[unit]


def run(w: Workload, work: Path, layout: str, seq: int, iterations: int) -> list[dict]:
    """The training records of a run of ``iterations`` steps at ``seq`` tokens."""
    save = work / f"{layout}-{seq}-{iterations}"
    proc = rapidlite([*argv(w, work, layout, seq, iterations), "--save", str(save), "--save-interval", "1000"])
    if proc.returncode != 0:
        raise SystemExit(f"{layout}: the run at --seq-length {seq} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "peak_memory_mb" in r and "split" not in r]


def longest(w: Workload, work: Path, layout: str, budget: float) -> tuple[int, int, float, float]:
    """``(planned, checked, its peak, tokens/s at the base length)``: the longest length the plan fits in
    ``budget``, and the longest whose run does (stepping down from the plan's at most three times)."""
    fits = lambda seq: planned_peak(w, work, layout, seq) <= budget
    if not w.search:  # --quick: the base length, planned and run once
        fits(w.base)
        records = run(w, work, layout, w.base, 3)
        return w.base, w.base, max(r["peak_memory_mb"] for r in records) * 2**20, records[-1]["tokens_per_s"]
    low, high = w.step, w.base
    while high < w.cap * w.base and fits(high):
        low, high = high, 2 * high
    while high - low > w.step:
        mid = (low + high) // 2 // w.step * w.step
        low, high = (mid, high) if fits(mid) else (low, mid)
    checked = low
    for _ in range(4):
        peak = max(r["peak_memory_mb"] for r in run(w, work, layout, checked, 2)) * 2**20
        if peak <= budget or checked - w.step < w.step:
            break
        checked -= w.step
    return low, checked, peak, run(w, work, layout, w.base, 3)[-1]["tokens_per_s"]


def write_assets(w: Workload, work: Path) -> None:
    import numpy as np
    from transformers import LlamaConfig

    from rapidlite.data.indexed_dataset import IndexedDatasetBuilder

    LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.ffn, num_hidden_layers=w.layers,
        num_attention_heads=w.heads, num_key_value_heads=w.kv_heads, max_position_embeddings=w.cap * w.base * 2,
        tie_word_embeddings=False, attention_dropout=0.0,
    ).save_pretrained(work / "config")  # fmt: skip
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{work / 'corpus'}.bin", dtype=np.int32)
    for _ in range(4):  # documents as long as the longest sequence searched
        builder.add_item(np.append(rng.integers(0, w.vocab - 1, size=w.cap * w.base + 1), w.vocab - 1))
        builder.end_document()
    builder.finalize(f"{work / 'corpus'}.idx")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, CP1 and CP2: checks the script only")
    w = QUICK if parser.parse_args().quick else L
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_assets(w, work)
        budget = planned_peak(w, work, "cp1", w.base)
        print(f"budget per rank: {budget / 2**20:.0f} MiB (the plan of CP1 at {w.base} tokens)")
        rows = {}
        for layout in w.layouts:
            rows[layout] = longest(w, work, layout, budget)
        print(f"\n{'layout':10s} {'longest (plan)':>15s} {'longest (run)':>14s} {'run peak MiB':>13s} {'x CP1':>6s} "
              f"{f'tokens/s at {w.base}':>18s}")  # fmt: skip
        base = rows["cp1"][1]
        for layout, (planned, checked, peak, tokens) in rows.items():
            print(f"{layout:10s} {planned:15d} {checked:14d} {peak / 2**20:13.0f} {checked / base:6.2f} {tokens:18.0f}")
        ratios = {cp: min(r[1] for k, r in rows.items() if k.startswith(f"cp{cp}")) / base for cp in (2, 4)
                  if any(k.startswith(f"cp{cp}") for k in rows)}  # fmt: skip
        verdicts = [f"CP{cp} {ratio:.2f}x (target {target}x)" for cp, ratio, target in
                    ((cp, ratios[cp], {2: 1.8, 4: 3.4}[cp]) for cp in ratios)]  # fmt: skip
        print(f"\ntargets (longest sequence against CP1, the lower of p2p and a2a): {', '.join(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
