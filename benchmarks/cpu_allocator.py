"""What fixing glibc's mmap threshold on a CPU run costs and saves (``rapidlite.runtime.allocator``): each
configuration trains with rapidlite's setting (a fixed 4 MiB threshold) and with glibc's dynamic default
(``RAPIDLITE_DEFAULT_MALLOC=1``), alternately, and the table prints the median step time and the logged peak
(``peak_memory_mb``) of each, as ratios to glibc's default measured in the same run.

    python benchmarks/cpu_allocator.py            # 4 configurations, 2 runs each way (about 6 minutes on 2 cores)
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


def run(argv: list[str], default_malloc: bool) -> tuple[float, float]:
    """(median step time after the first 3, highest logged peak MiB) of one run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RAPIDLITE_DEFAULT_MALLOC", None)
    if default_malloc:
        env["RAPIDLITE_DEFAULT_MALLOC"] = "1"
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
    print("| configuration | step, glibc default | step, fixed 4 MiB | step ratio | peak MiB, default | "
          "peak MiB, fixed | peak ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            argv = argv_of(config, Path(tmp) / f"c{i}", random.Random(0))
            argv[argv.index("--train-iters") + 1] = str(ITERS)
            argv[argv.index("--eval-interval") + 1] = str(ITERS)
            runs = {False: [], True: []}
            for _ in range(repeats):
                for default in (True, False):
                    runs[default].append(run(argv, default))
            step = {k: statistics.mean(s for s, _ in v) for k, v in runs.items()}
            peak = {k: max(p for _, p in v) for k, v in runs.items()}
            print(f"| {config.name} {' '.join(config.options)} | {step[True]:.3f} s | {step[False]:.3f} s | "
                  f"{step[False] / step[True]:.2f} | {peak[True]:,.0f} | {peak[False]:,.0f} | "
                  f"{peak[False] / peak[True]:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
