"""``rapidlite-bench``: machine measurements for the speed reports (``peak``: the matrix-multiply peak to pass as
``--peak-flops``, measured by ``rapidlite.models.flops.measure_matmul_peak``)."""

from __future__ import annotations

import argparse
import sys

import torch

from rapidlite.models.flops import measure_matmul_peak


def _peak_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rapidlite-bench peak",
        description="Measure this machine's matrix-multiply peak (FLOP/s) per precision, to pass as --peak-flops.",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--sizes", default="1024,2048,3072", help="square matrix sizes tried (comma-separated)")
    p.add_argument("--quick", action="store_true", help="small matrices, to check the command works")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = (128, 256) if args.quick else tuple(int(s) for s in args.sizes.split(","))
    device = torch.device(args.device)
    print(f"matrix-multiply peak on {device} ({torch.get_num_threads()} threads), sizes {list(sizes)}")
    print(f"{'precision':<10} {'GFLOP/s':>10} {'at size':>8}")
    results = {}
    precisions = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    if device.type == "cuda":  # CPUs have no fast fp16 matmul (about 17x slower than bf16): not worth timing
        precisions.append(("fp16", torch.float16))
    for name, dtype in precisions:
        flops, n = measure_matmul_peak(dtype, device, sizes, repeats=2 if args.quick else 5)
        results[name] = flops
        print(f"{name:<10} {flops / 1e9:>10.1f} {n:>8}")
    print(f"pass --peak-flops {results['fp32']:.3g} for fp32 training, {results['bf16']:.3g} with --bf16")
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    """``rapidlite-bench``: machine measurements for the speed reports (``peak``)."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"peak": _peak_main}
    if not argv or argv[0] not in commands:
        print(f"usage: rapidlite-bench {{{','.join(commands)}}} [options]: choose a command", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(bench_main())
