"""Model-parallel layouts of the built-in GPT side by side: step time, tokens/s and per-rank memory.

    python benchmarks/model_parallel.py            # about 95 seconds on 2 cores
    python benchmarks/model_parallel.py --quick    # a few steps of a tiny model, to check the script works
                                                   # (one pipeline schedule of each kind: 1F1B, interleaved)

Every layout trains the built-in GPT (``rapidlite --task pretraining``, 4 layers, hidden 256, 8 heads,
seq 256; dropout 0) on the same synthetic mmap corpus (random token ids, NullTokenizer vocabulary of 8000,
written in a temporary directory with ``IndexedDatasetBuilder``) and the same global batch, through the
``rapidlite`` command, one thread per rank (``OMP_NUM_THREADS=1``), in this one invocation: 1 rank; DDP on
2 ranks (dp2); tensor parallel 2 (tp2); tp2 with sequence parallelism; tp2 x DDP dp2 on 4 ranks; tp2 with
sequence parallelism x FSDP2 (``--zero-3-memory-optimization``) dp2 on 4 ranks. The micro-batch is
global batch / data-parallel size, so every layout takes one micro-batch per step.

Printed per layout: median step time over the timed steps (all but the first 2), tokens/s and its ratio to
the 1-rank run, rank 0's parameter / gradient / optimizer-state MiB and their fraction of the 1-rank run's,
rank 0's peak memory (process peak RSS on CPU) and the final loss. Then a check that every layout's
per-iteration losses equal the 1-rank run's within 1e-4 relative (exit 1 on a mismatch), and the memory
target: tp2 parameter bytes per rank 0.50 of 1 rank for the split weights; the replicated norms, biases and
position embedding put the whole model at about 0.51, so the printed check allows <= 0.55.

Pipeline layouts (``--pipeline-model-parallel-size 2``) run with m micro-batches per global batch (the
micro-batch is global / m), under 1F1B for m = 2, 4, 8, GPipe and interleaved 1F1B (2 virtual stages per
rank) for m = 4, 1F1B with m = 8 and the layers split 3,1 (the last stage also holds the output layer, the
largest matrix here); then pp2 x dp2 and tp2 x pp2 on 4 ranks. The 1-rank run is repeated with the same
micro-batch for each m, so the pipeline's idle share can be measured against the work it splits:
``bubble = 1 - t_1rank(m) / (p * t_pp(m))``, the fraction of a pipeline step a stage does not spend on its
share of the work (bubbles, plus the send/receive and any imbalance between the stages), printed beside
the schedule's theoretical bubble ``(p - 1) / (m + p - 1)`` (``(p - 1) / (v m + p - 1)`` interleaved with v
stages per rank).

The 4-rank layouts run 4 processes on the 2 cores of the development machine: they are oversubscribed, so
their times measure that the layout works (and its communication pattern) more than its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rapidlite.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

VOCAB = 8000  # NullTokenizer ids 0..7999, EOD = 8000
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
GLOBAL_BATCH = 8
LAYOUTS = [  # (label, ranks, micro-batch size, flags)
    ("1 rank", 1, 8, []),
    ("dp2", 2, 4, []),
    ("tp2", 2, 8, TP2),
    ("tp2 + sp", 2, 8, [*TP2, "--sequence-parallel"]),
    ("tp2 x dp2", 4, 4, TP2),
    ("tp2+sp x fsdp dp2", 4, 4, [*TP2, "--sequence-parallel", "--zero-3-memory-optimization"]),
    ("1 rank m=2", 1, 4, []),
    ("1 rank m=4", 1, 2, []),
    ("1 rank m=8", 1, 1, []),
    ("pp2 1f1b m=2", 2, 4, PP2),
    ("pp2 1f1b m=4", 2, 2, PP2),
    ("pp2 1f1b m=8", 2, 1, PP2),
    ("pp2 gpipe m=4", 2, 2, [*PP2, "--pipeline-schedule", "gpipe"]),
    ("pp2 interleaved m=4", 2, 2, [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("pp2 1f1b m=8 split3,1", 2, 1, [*PP2, "--pipeline-split", "3,1"]),
    ("pp2 x dp2 m=2", 4, 2, PP2),
    ("tp2 x pp2 m=4", 4, 2, [*TP2, *PP2]),
]
BUBBLES = [  # (pipeline layout, 1-rank layout with the same micro-batch, m, virtual stages per rank)
    ("pp2 1f1b m=2", "1 rank m=2", 2, 1),
    ("pp2 1f1b m=4", "1 rank m=4", 4, 1),
    ("pp2 1f1b m=8", "1 rank m=8", 8, 1),
    ("pp2 gpipe m=4", "1 rank m=4", 4, 1),
    ("pp2 interleaved m=4", "1 rank m=4", 4, 2),
    ("pp2 1f1b m=8 split3,1", "1 rank m=8", 8, 1),
]
# --quick checks the script, not the layouts (each is proved against one process in tests/test_tensor_parallel.py and
# tests/test_pipeline_parallel.py): the baseline, tensor parallelism (for its parameter-share line), and one
# interleaved pipeline with its 1-rank baseline for the second table; every layout is 1 or 2 processes.
QUICK = ("1 rank", "tp2", "1 rank m=4", "pp2 interleaved m=4")
SKIP = 2  # the first steps warm up allocators, caches and the process group


def write_corpus(prefix: Path, docs: int, seed: int = 0) -> None:
    """``docs`` documents of 20-400 random token ids, each ending in EOD."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(docs):
        tokens = rng.integers(0, VOCAB, size=int(rng.integers(20, 400)))
        builder.add_item(np.append(tokens, VOCAB))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def run(name: str, nproc: int, micro: int, flags: list[str], quick: bool, data: Path, out: Path) -> dict:
    model = (
        ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
        if quick
        else ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256"]
    )
    iters = 4 if quick else 12
    global_batch = GLOBAL_BATCH
    argv = [
        sys.executable,
        "-m",
        "rapidlite",
        "--task",
        "pretraining",
        "--data-path",
        str(data),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        *model,
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--micro-batch-size",
        str(micro),
        "--global-batch-size",
        str(global_batch),
        "--train-iters",
        str(iters),
        "--lr",
        "1e-3",
        "--log-interval",
        "1",
        "--eval-interval",
        str(iters),
        "--eval-iters",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--save",
        str(out),
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "split" not in r]
    timed = steps[SKIP:]
    (state,) = [r for r in records if r.get("split") == "model_state"]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "param_bytes": state["param_bytes"],
        "grad_bytes": state["grad_bytes"],
        "optimizer_bytes": state["optimizer_bytes"],
        "strategy": state.get("strategy", ""),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in steps),
        "losses": [r["loss"] for r in steps],
    }


def fraction(part: float, whole: float) -> float:
    return part / whole if whole else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model: checks the script only")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "synthetic_text_document"
        write_corpus(data, docs=400 if args.quick else 2000)
        layouts = [layout for layout in LAYOUTS if not args.quick or layout[0] in QUICK]
        for name, nproc, micro, flags in layouts:
            out = Path(tmp) / name.replace(" ", "_").replace("+", "p").replace("=", "")
            results[name] = run(name, nproc, micro, flags, args.quick, data, out)
    base = results["1 rank"]
    header = (
        f"{'layout':<22} {'ranks':>5} {'step s':>7} {'tokens/s':>9} {'vs 1':>5} {'param MiB':>9} {'grad MiB':>8} "
        f"{'optim MiB':>9} {'param':>5} {'grad':>5} {'optim':>5} {'peak MB':>8} {'loss':>8}"
    )
    print(header)
    for (name, nproc, _, _), r in zip(layouts, results.values(), strict=True):
        print(
            f"{name:<22} {nproc:>5} {r['step_time_s']:>7.3f} {r['tokens_per_s']:>9.0f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>5.2f} {r['param_bytes'] / 2**20:>9.2f} "
            f"{r['grad_bytes'] / 2**20:>8.2f} {r['optimizer_bytes'] / 2**20:>9.2f} "
            f"{fraction(r['param_bytes'], base['param_bytes']):>5.2f} "
            f"{fraction(r['grad_bytes'], base['grad_bytes']):>5.2f} "
            f"{fraction(r['optimizer_bytes'], base['optimizer_bytes']):>5.2f} "
            f"{r['peak_memory_mb']:>8.0f} {r['losses'][-1]:>8.4f}"
        )
    print("(param/grad/optim: rank 0's bytes as a fraction of the 1-rank run's; step s, tokens/s: medians)")
    mismatched = []
    for name, r in results.items():
        same = len(r["losses"]) == len(base["losses"]) and all(
            abs(a - e) <= 1e-4 * abs(e) for a, e in zip(r["losses"], base["losses"], strict=True)
        )
        if not same:
            mismatched.append(name)
            print(f"{name}: losses {r['losses']}\n1 rank: losses {base['losses']}")
    steps = len(base["losses"])
    if mismatched:
        print(f"check per-iteration losses equal 1 rank's within 1e-4 ({steps} steps): MISMATCH {mismatched}")
    else:
        print(f"check per-iteration losses equal 1 rank's within 1e-4 ({steps} steps): ok")
    tp2_share = results["tp2"]["param_bytes"] / base["param_bytes"]
    verdict = "met" if tp2_share <= 0.55 else "MISSED"
    print(f"tp2 parameter bytes per rank: {tp2_share:.2f} of 1 rank (target <= 0.55: {verdict})")
    print(f"\n{'pipeline':<20} {'m':>3} {'1 rank s':>8} {'pp2 s':>7} {'speedup':>7} {'bubble':>7} {'theory':>7}")
    for name, single, m, virtual in (bubble for bubble in BUBBLES if bubble[0] in results):
        t_pp, t_1 = results[name]["step_time_s"], results[single]["step_time_s"]
        p = 2
        theory = (p - 1) / (virtual * m + p - 1)
        print(
            f"{name:<20} {m:>3} {t_1:>8.3f} {t_pp:>7.3f} {t_1 / t_pp:>7.2f} {1 - t_1 / (p * t_pp):>7.2f} {theory:>7.2f}"
        )
    print("(bubble: 1 - t_1rank / (2 t_pp2), the idle share of a stage; theory: (p-1)/(v m + p-1))")
    if args.quick:
        print("quick mode: speeds are not meaningful")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
