"""The built-in mixture-of-experts GPT against a dense GPT of the same active parameters, at equal steps, on the
embedded corpus; and ``--moe-grouped-gemm`` against the per-expert loop.

    python benchmarks/moe.py            # about 25 minutes on 2 cores
    python benchmarks/moe.py --quick    # a 1-block model for 8 steps: checks the script only

Each contender is ``rapidlite --task pretraining --demo`` (the standard library's docstrings, byte-level tokens;
4 blocks of hidden 256, sequences of 256, global batch 16, cosine schedule from 2e-3) for ``--steps`` optimizer
steps, one after the other, one process and one thread each:

    dense            the demo's GELU MLP, 4 x 256 = 1024 wide
    moe loop         8 experts of 512, top 2 (a token goes through 2 x 512 = 1024: the dense model's active
                     parameters), Megatron's load-balancing loss x0.01, one matmul per expert
    moe grouped      the same with --moe-grouped-gemm (torch._grouped_mm)

The table gives each one's validation loss at the last step, its median step time over the steps after the
first 5, and the ratios: the mixture against the dense model's loss (lower is better at equal steps and equal
active parameters; it holds 4 x the MLP parameters), the grouped matmul against the loop's step time. The
step times are the same machine's in one invocation, one contender at a time.
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

REPO = Path(__file__).resolve().parent.parent
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512"]
CONTENDERS = {"dense": [], "moe loop": MOE, "moe grouped": [*MOE, "--moe-grouped-gemm"]}


def run(name: str, flags: list[str], steps: int, quick: bool, root: Path) -> dict[str, float]:
    save = root / name.replace(" ", "_")
    argv = ["--task", "pretraining", "--demo", "--train-iters", str(steps), "--time-budget", "600", "--no-progress"]
    argv += ["--eval-interval", str(steps), "--log-interval", "1", "--save", str(save), "--save-interval", "100000"]
    if quick:
        argv += ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64"]
        argv += ["--eval-iters", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "rapidlite", *argv, *flags], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{name}: rapidlite failed\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["step_time_s"] for r in records if "step_time_s" in r and "split" not in r]
    validation = [r["loss"] for r in records if r.get("split") == "validation"]
    timed = steps_s[5:] or steps_s
    return {"validation loss": validation[-1], "step s": statistics.median(timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    steps = 8 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, flags, steps, args.quick, Path(tmp)) for name, flags in CONTENDERS.items()}
    print(f"\n{steps} steps each (global batch 16), validation loss at the last step, median step time")
    print("| contender | validation loss | step time (s) |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['validation loss']:.4f} | {r['step s']:.3f} |")
    dense, loop, grouped = (results[n] for n in CONTENDERS)
    print(f"moe vs dense validation loss: {grouped['validation loss'] - dense['validation loss']:+.4f} nats")
    print(f"moe grouped vs loop step time: x{loop['step s'] / grouped['step s']:.2f} faster")
    print(f"moe grouped vs dense step time: x{grouped['step s'] / dense['step s']:.2f}")


if __name__ == "__main__":
    main()
