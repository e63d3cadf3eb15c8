"""The CPU image: docker/test-image.sh builds it and runs rapidlite --help, rapidlite env, a 2-process pretraining
run, the fine-tuning demo and a DeepSpeed run inside it. Needs a Docker daemon (skipped without one); the build's
settings (base image, local torch wheels, CA certificates) come from the environment, see docker/README.md."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # not from helpers: that imports torch, and this module skips at once

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _daemon_unreachable() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker command"
    try:
        proc = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 10 s"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return f"no Docker daemon reachable: {lines[-1] if lines else 'docker info failed'}"
    return None


def test_cpu_image_builds_and_runs():
    reason = _daemon_unreachable()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(
        ["bash", str(REPO / "docker" / "test-image.sh")],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    summary = proc.stdout[proc.stdout.rfind("\nimage ") :]
    print(summary)  # the image's size and each step's time (shown with -s or -rP)
    assert proc.returncode == 0, summary + proc.stderr[-3000:]
    for step in ("build", "image", "help", "env", "pretrain", "demo"):
        assert f"  {step} " in summary and "FAILED" not in summary, summary
