"""The benchmark scripts run (quick mode: a few steps of a tiny model; nothing is asserted about speed)."""

import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.distributed
def test_data_parallel_benchmark_quick():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "data_parallel.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split()[0] for line in proc.stdout.splitlines()[1:6]]
    assert rows == ["1", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"], proc.stdout
