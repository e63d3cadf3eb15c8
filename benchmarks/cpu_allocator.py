"""What rapidlite's CPU allocator setting costs and saves (``rapidlite.runtime.allocator``): each configuration
trains with glibc's dynamic default (``RAPIDLITE_DEFAULT_MALLOC=1``), with rapidlite's fixed 4 MiB mmap threshold,
and with the threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``, which rapidlite leaves as set: no heap holes
between tensors of 64 KiB or more), in turn; the table prints the median step time and the logged peak
(``peak_memory_mb``) of each, as ratios to glibc's default measured in the same run.

    python benchmarks/cpu_allocator.py            # 4 configurations, 2 runs each way (about 12 minutes on 2 cores)
    python benchmarks/cpu_allocator.py --quick    # 1 small one: checks the script
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dry_run_sweep import Config, argv_of  # noqa: E402  (the sweep's models and data)

CONFIGS = [  # task, family, hidden, layers, heads, kv heads, vocab, seq, micro, layout, options
    Config("pretraining", "gpt", 256, 4, 4, 4, 8000, 512, 4, "single"),
    Config("masked_lm", "bert", 512, 4, 8, 8, 64000, 1024, 2, "zero2_offload", ["--lora-rank", "8"]),
    Config("causal_lm", "llama", 256, 4, 4, 2, 16000, 512, 4, "zero2"),
    Config("multiple_choice", "bert", 32, 4, 2, 2, 8000, 512, 8, "single", ["--lora-rank", "8"]),
]
QUICK = [Config("pretraining", "gpt", 128, 2, 2, 2, 1000, 256, 4, "single")]
ITERS = 8
# Each setting: its name in the table and the environment it runs with (the first is the baseline).
SETTINGS = {
    "glibc default": {"RAPIDLITE_DEFAULT_MALLOC": "1"},
    "fixed 4 MiB": {},
    "64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}


def run(argv: list[str], setting: dict[str, str]) -> tuple[float, float]:
    """(median step time after the first 3, highest logged peak MiB) of one run with ``setting``'s environment."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in {k for other in SETTINGS.values() for k in other}:  # no setting leaks into another's run
        env.pop(name, None)
    env.update(setting)
    proc = subprocess.run([sys.executable, "-m", "rapidlite", *argv], capture_output=True, text=True, env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {out.strip().splitlines()[-1]}")
    steps = [float(x) for x in re.findall(r"step_time_s: ([\d.]+)", out)][3:]
    peaks = [float(x) for x in re.findall(r"peak_memory_mb: ([\d.]+)", out)]
    return statistics.median(steps), max(peaks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small configuration, one run each way")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    configs, repeats = (QUICK, 1) if args.quick else (CONFIGS, args.repeats)
    others = list(SETTINGS)[1:]
    head = " | ".join(f"step, {n} | step ratio" for n in others) + " | peak MiB, glibc default | "
    head += " | ".join(f"peak MiB, {n} | peak ratio" for n in others)
    print(f"| configuration | step, glibc default | {head} |")
    print("|---" * (3 + 4 * len(others)) + "|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            argv = argv_of(config, Path(tmp) / f"c{i}", random.Random(0))
            argv[argv.index("--train-iters") + 1] = str(ITERS)
            argv[argv.index("--eval-interval") + 1] = str(ITERS)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
            for _ in range(repeats):
                for name, setting in SETTINGS.items():
                    runs[name].append(run(argv, setting))
            step = {k: statistics.mean(s for s, _ in v) for k, v in runs.items()}
            peak = {k: max(p for _, p in v) for k, v in runs.items()}
            base = next(iter(SETTINGS))
            steps = " | ".join(f"{step[n]:.3f} s | {step[n] / step[base]:.2f}" for n in others)
            peaks = " | ".join(f"{peak[n]:,.0f} | {peak[n] / peak[base]:.2f}" for n in others)
            print(f"| {config.name} {' '.join(config.options)} | {step[base]:.3f} s | {steps} | {peak[base]:,.0f} | "
                  f"{peaks} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
