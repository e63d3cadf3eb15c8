"""Data-parallel layouts side by side: throughput, data-parallel efficiency and per-rank model-state bytes.

    python benchmarks/data_parallel.py            # about 3 minutes on 2 cores
    python benchmarks/data_parallel.py --quick    # a few steps, to check the script works

Every layout trains the same small GPT-style model (``examples/pretrain_custom_model.py``) on the same
global batch through the ``rapidlite`` command, one thread per rank, in this one invocation:
1 rank, then DDP, ZeRO-1, ZeRO-2 and ZeRO-3 on 2 ranks. Printed per layout: median tokens/s over the
timed steps, data-parallel efficiency (2-rank tokens/s / (2 x 1-rank tokens/s)) and rank 0's bytes of
parameters + gradients + optimizer state relative to DDP's. Targets: DDP efficiency >= 0.85; ZeRO-3
model-state bytes <= 0.55 of DDP's.
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

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [
    ("1 rank", 1, []),
    ("DDP", 2, []),
    ("ZeRO-1", 2, ["--zero-1-memory-optimization"]),
    ("ZeRO-2", 2, ["--zero-2-memory-optimization"]),
    ("ZeRO-3", 2, ["--zero-3-memory-optimization"]),
]


def run(name: str, nproc: int, flags: list[str], quick: bool, out: Path) -> dict:
    size = (
        ["--hidden-size", "64", "--num-layers", "2", "--seq-length", "32"]
        if quick
        else ["--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "8", "--seq-length", "128"]
    )
    iters = 4 if quick else 30
    global_batch = 16
    argv = [
        sys.executable,
        "-m",
        "rapidlite",
        "--user-script",
        str(REPO / "examples" / "pretrain_custom_model.py"),
        *size,
        "--train-iters",
        str(iters),
        "--micro-batch-size",
        str(global_batch // nproc // 2),
        "--global-batch-size",
        str(global_batch),
        "--log-interval",
        "1",
        "--eval-iters",
        "1",
        "--lr",
        "1e-3",
        "--hidden-dropout",
        "0",
        "--nproc-per-node",
        str(nproc),
        "--save",
        str(out),
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "split" not in r]
    timed = steps[len(steps) // 5 :] if not quick else steps[1:]  # the first steps warm up allocators and caches
    (state,) = [r for r in records if r.get("split") == "model_state"]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "state_bytes": state["param_bytes"] + state["grad_bytes"] + state["optimizer_bytes"],
        "final_loss": steps[-1]["loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model: checks the script only")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, flags in LAYOUTS:
            results[name] = run(name, nproc, flags, args.quick, Path(tmp) / name.replace(" ", "_"))
    base, ddp = results["1 rank"], results["DDP"]
    print(f"{'layout':<8} {'tokens/s':>10} {'DP efficiency':>14} {'state MiB/rank':>15} {'vs DDP':>7} {'loss':>8}")
    for name, r in results.items():
        efficiency = r["tokens_per_s"] / (2 * base["tokens_per_s"]) if name != "1 rank" else 1.0
        print(
            f"{name:<8} {r['tokens_per_s']:>10.0f} {efficiency:>14.2f} {r['state_bytes'] / 2**20:>15.2f} "
            f"{r['state_bytes'] / ddp['state_bytes']:>7.2f} {r['final_loss']:>8.4f}"
        )
    ddp_eff = ddp["tokens_per_s"] / (2 * base["tokens_per_s"])
    zero3_share = results["ZeRO-3"]["state_bytes"] / ddp["state_bytes"]
    if args.quick:
        print("quick mode: speeds are not meaningful")
        return 0
    print(f"target DDP efficiency >= 0.85: {ddp_eff:.2f} {'met' if ddp_eff >= 0.85 else 'MISSED'}")
    print(f"target ZeRO-3 state <= 0.55 of DDP: {zero3_share:.2f} {'met' if zero3_share <= 0.55 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
