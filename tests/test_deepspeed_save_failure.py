"""A rank failing inside DeepSpeed's checkpoint write (a full disk) on 2 processes: the other rank, left in
DeepSpeed's own collectives, is ended by the save's watchdog instead of waiting for the process group's timeout
(rapidlite.checkpoint.watchdog)."""

import time

import pytest

from helpers import DP_COMMON, DP_TWO, PRETRAIN, rapidlite
from rapidlite.checkpoint.integrity import verify_checkpoint

pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow]

# Run as --user-script: rank 1's DeepSpeed shard of iteration 4 meets a full disk, then the example trains.
FAILING_RANK_1 = f"""
import errno, os, runpy

if os.environ.get("RANK") == "1":
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    real = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        if "iter_0000004" in str(path) and "optim_states" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, state_dict, path)

    TorchCheckpointEngine.save = save
runpy.run_path({PRETRAIN!r}, run_name="__main__")
"""


def test_a_rank_failing_inside_deepspeeds_save_ends_every_rank_in_one_line(tmp_path):
    script, save = tmp_path / "failing_rank_1.py", tmp_path / "run"
    script.write_text(FAILING_RANK_1)
    argv = [*DP_COMMON, *DP_TWO, "--deepspeed", "--zero-2-memory-optimization", "--train-iters", "4"]
    # A 30-second process-group timeout: the watchdog's grace is half of it (15 s). Without the watchdog the ranks
    # wait in mismatched collectives until that timeout, then end with a traceback and exit code 1.
    argv += ["--save-interval", "2", "--save", str(save), "--distributed-timeout-minutes", "0.5"]
    start = time.monotonic()
    proc = rapidlite("--user-script", str(script), *argv, timeout=150)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("rapidlite: error: --save ") and "Traceback" not in proc.stderr
    assert "cannot write the checkpoint of iteration 4: rank 1: the disk is full (no space left on device)" in line
    assert "the partial checkpoint was removed and 'latest' still points at iteration 2" in line
    assert elapsed < 90, elapsed  # the run itself takes ~10 s, the grace 15 s
    assert (save / "latest").read_text().strip() == "2"
    assert verify_checkpoint(save / "iter_0000002") is None
    assert not list(save.glob(".tmp_*")) and not (save / "iter_0000004").exists()
