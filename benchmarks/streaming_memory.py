"""``--streaming``'s memory: the peak resident size of a short run on a text file and on one ten times larger,
streamed and map-style.

    python benchmarks/streaming_memory.py            # 5 MB and 50 MB of text: a few minutes on 2 cores
    python benchmarks/streaming_memory.py --quick    # 0.2 MB and 2 MB: the test (tests/test_benchmarks.py)

In a temporary directory: the causal-LM demo's tiny LLaMA and tokenizer, and JSON-lines files of generated text
(``{"text": ...}`` rows of about 600 characters) of the two sizes. Each contender is ``rapidlite --task causal_lm
--packing`` for a fixed number of iterations (seq 128, micro-batch 4, global batch 8, one thread), run in a
process of its own whose peak resident size (``ru_maxrss`` of the child) is read by its parent:

    streamed     --streaming: rows read, encoded and packed as the steps consume them
    map-style    the default path: every row encoded and packed before the first step

Targets: the streamed peak on the larger file within 5% (or 8 MiB) of the smaller file's; the map-style peak
grows with the file. The lines starting ``check`` say whether they were met.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = (
    "the a river mountain quiet village morning light road garden house teacher farmer bird traveller keeps builds "
    "watches finds remembers carries paints follows likes sees today before dinner rain care summer near after school"
).split()

_MEASURE = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if proc.returncode:
    sys.stderr.write(proc.stderr[-3000:])
    sys.exit(proc.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_text(path: Path, megabytes: float, seed: int = 0) -> None:
    """Rows of generated text until the file holds ``megabytes``."""
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    written = 0
    with open(path, "w") as f:
        while written < target:
            text = " ".join(rng.choice(WORDS) for _ in range(100))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)


def peak_mib(argv: list[str], env: dict[str, str]) -> float:
    """The peak resident size (MiB) of ``rapidlite ARGV`` run in a process of its own."""
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "rapidlite", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"rapidlite {' '.join(argv)} failed:\n{proc.stderr}")
    return int(proc.stdout.strip().splitlines()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0.2 MB and 2 MB of text (the test)")
    parser.add_argument("--iters", type=int, default=4, help="training iterations of each run")
    args = parser.parse_args(argv)
    small = 0.2 if args.quick else 5.0
    sys.path.insert(0, str(REPO))
    from rapidlite.tasks.causal_lm_demo import write_demo_assets

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, _ = write_demo_assets(root / "demo", seed=5, num_train=40, num_validation=8)
        files = {}
        for scale in (1, 10):
            files[scale] = root / f"text_{scale}x.jsonl"
            write_text(files[scale], small * scale)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(root / "hf_cache"),  # the map-style path's Arrow copy stays in the temp dir
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        common = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--packing"]
        common += ["--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3"]
        common += ["--train-iters", str(args.iters), "--log-interval", str(args.iters), "--no-progress"]
        peaks: dict[tuple[str, int], float] = {}
        print(f"{'contender':<12}{'file':>10}{'peak RSS MiB':>15}")
        for name, extra in (("streamed", ["--streaming"]), ("map-style", ["--split", "100,0,0"])):
            for scale in (1, 10):
                peaks[name, scale] = peak_mib([*common, "--data-path", str(files[scale]), *extra], env)
                print(f"{name:<12}{small * scale:>8g}MB{peaks[name, scale]:>15.1f}")
        streamed = peaks["streamed", 10] - peaks["streamed", 1]
        grown = peaks["map-style", 10] - peaks["map-style", 1]
        flat = streamed <= max(0.05 * peaks["streamed", 1], 8.0)
        print(f"streamed peak, 10x file minus 1x: {streamed:+.1f} MiB")
        print(f"map-style peak, 10x file minus 1x: {grown:+.1f} MiB")
        print(f"check streamed peak flat (within 5% or 8 MiB): {'ok' if flat else 'FAILED'}")
        print(f"check map-style peak grows more than the streamed one: {'ok' if grown > streamed + 8 else 'FAILED'}")
        return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
