"""The code reads one way: ruff's lint and format checks pass on the whole tree (config in pyproject.toml)."""

import shutil
import subprocess

import pytest

from helpers import REPO

ruff = shutil.which("ruff")


@pytest.mark.skipif(ruff is None, reason="ruff not installed (it comes with the [test] extra)")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run([ruff, *command, str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
