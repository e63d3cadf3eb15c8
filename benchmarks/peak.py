"""The machine's matrix-multiply peak per precision, for ``--peak-flops`` and the MFU of the benchmarks.

python -m benchmarks.peak [--threads 2]      # same as: rapidlite-bench peak
"""

import sys

from rapidlite.cli.bench import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["peak", *sys.argv[1:]]))
