"""What the checkpoint manifest costs: ``rapidlite.checkpoint.dcp.save_checkpoint`` of a model and its AdamW state
with the CRC-32 manifest and with hashing turned off, saves taking turns, plus the verification a load does.

The model is ``examples/pretrain_custom_model.py``'s (4 blocks, hidden 256: 3.2M parameters, a 38 MB
checkpoint with the optimizer state). ``--quick``: a tiny model, two saves each (checks the script works).

    python benchmarks/checkpoint_hashing.py [--quick] [--saves 7] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from pretrain_custom_model import TinyCausalLM  # noqa: E402

from rapidlite.checkpoint import dcp, integrity  # noqa: E402
from rapidlite.checkpoint.integrity import _checkpoint_files  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--saves", type=int, default=7, help="saves of each kind (median reported)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()
    torch.manual_seed(0)
    hidden, layers = (32, 1) if a.quick else (256, 4)
    saves = 2 if a.quick else a.saves
    model = TinyCausalLM(vocab=64, hidden=hidden, layers=layers, heads=4, seq=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()  # AdamW state exists: exp_avg and exp_avg_sq, twice the weights again
    n_params = sum(q.numel() for q in model.parameters())

    root = Path(a.dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    hash_files = integrity._hash_own_files
    sizes_only = lambda d, r, w: {n: {"size": (d / n).stat().st_size, "crc32": 0} for n in _checkpoint_files(d)}  # noqa: E731
    times: dict[str, list[float]] = {"with manifest": [], "without hashing": []}
    verify: list[float] = []
    try:
        for i in range(saves * 2 + 1):  # the first save warms the page cache and allocator up: not counted
            kind = "with manifest" if i % 2 else "without hashing"
            integrity._hash_own_files = hash_files if kind == "with manifest" else sizes_only
            start = time.perf_counter()
            path = dcp.save_checkpoint(root, i, model, optimizer, {"trainer": {}})
            seconds = time.perf_counter() - start
            if i:
                times[kind].append(seconds)
            if kind == "with manifest":
                start = time.perf_counter()
                assert integrity.verify_checkpoint(path) is None
                verify.append(time.perf_counter() - start)
            shutil.rmtree(path)
    finally:
        integrity._hash_own_files = hash_files
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    with_hash, without = (statistics.median(times[k]) for k in ("with manifest", "without hashing"))
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
    print(f"model: {n_params / 1e6:.2f}M parameters, checkpoint about {mb:.1f} MB (weights + AdamW state)")
    print(f"save without hashing   {without * 1000:8.1f} ms (median of {saves})")
    print(f"save with manifest     {with_hash * 1000:8.1f} ms (median of {saves})")
    print(f"hashing overhead       {(with_hash - without) * 1000:8.1f} ms = {(with_hash / without - 1) * 100:.1f}%")
    print(f"verify on load         {statistics.median(verify) * 1000:8.1f} ms (CRC-32 of every file, page cache warm)")


if __name__ == "__main__":
    main()
