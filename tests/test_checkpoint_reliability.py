"""Checkpoints that are damaged, incomplete or unwritable: each is either loaded in place of a good one with one
warning line naming both, or refused in one line (exit 2); never loaded silently. The checksum manifest, the
fallback, ``latest`` derived when missing or behind, ``--keep-last``, shape mismatches and a full disk."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    DP_COMMON,
    DP_ONE,
    DP_TWO,
    MLP,
    PRETRAIN,
    ToyFinetuner,
    engine,
    params,
    rapidlite,
    rapidlite_here,
    read_metrics,
)
from rapidlite.checkpoint import dcp, integrity, layout, selection, watchdog
from rapidlite.errors import CheckpointError

ARGV = ["--micro-batch-size", "8", "--lr", "0.01", "--log-interval", "1", "--seed", "3"]


def train(*argv, trainer_cls=ToyFinetuner):
    trainer = trainer_cls(engine(*ARGV, *argv))
    trainer.train()
    return trainer


def resume(save, *argv, iters=8):
    """Resume ``save`` into a fresh directory (so ``save`` stays as damaged as the test made it)."""
    out = save.parent / f"{save.name}_resumed"
    return train("--train-iters", str(iters), "--load", str(save), "--save", str(out), *argv)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """6 iterations with checkpoints at 2, 4 and 6; ``latest`` is 6."""
    save = tmp_path_factory.mktemp("base") / "run"
    train("--train-iters", "6", "--save-interval", "2", "--save", str(save))
    return save


@pytest.fixture(scope="module")
def from_iter4(base, tmp_path_factory):
    """The reference for a fallback: the run resumed from iter_0000004 (nothing else present) to iteration 8."""
    save = tmp_path_factory.mktemp("ref") / "run"
    save.mkdir()
    shutil.copytree(base / "iter_0000004", save / "iter_0000004")
    (save / "latest").write_text("4\n")
    trainer = resume(save)
    return params(trainer.model), read_metrics(save.parent / "run_resumed")


@pytest.fixture
def copy(base, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(base, save)
    return save


# --------------------------------------------------------------------------------- damage to iter_6
def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def scribble_4k(path):
    data = bytearray(path.read_bytes())
    start = len(data) // 4
    data[start : start + 4096] = os.urandom(min(4096, len(data) - start))
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def zero_fill(path):
    path.write_bytes(bytes(path.stat().st_size))


def delete(path):
    path.unlink()


DAMAGE = {
    "flipped byte in .distcp": ("__0_0.distcp", flip_byte),
    "4 KB scribble in .distcp": ("__0_0.distcp", scribble_4k),
    "truncated .distcp": ("__0_0.distcp", truncate),
    "zero-filled .distcp": ("__0_0.distcp", zero_fill),
    "deleted .distcp": ("__0_0.distcp", delete),
    "deleted .metadata": (".metadata", delete),
    "zero-filled .metadata": (".metadata", zero_fill),
    "flipped byte in state.pt": ("state.pt", flip_byte),
    "truncated rng_rank0.pt": ("rng_rank0.pt", truncate),
    "garbage manifest.json": ("manifest.json", zero_fill),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_falls_back_to_the_previous_good_one(copy, case, log_lines):
    name, damage = DAMAGE[case]
    damage(copy / "iter_0000006" / name)
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 4
    (warning,) = [line for line in log_lines if " is damaged" in line]
    assert "iter_0000006 is damaged" in warning and "loading iter_0000004 instead" in warning, warning
    assert name in warning or "manifest" in warning, warning


def test_resume_after_a_fallback_continues_as_from_the_good_checkpoint(copy, from_iter4):
    flip_byte(copy / "iter_0000006" / "__0_0.distcp")
    trainer = resume(copy)
    reference, reference_metrics = from_iter4
    for key, value in params(trainer.model).items():
        assert torch.equal(value, reference[key]), key
    losses = [r["loss"] for r in read_metrics(copy.parent / "run_resumed") if "split" not in r]
    assert losses == [r["loss"] for r in reference_metrics if "split" not in r]


def test_nothing_verifies_is_one_line(copy):
    for iteration in (2, 4, 6):
        flip_byte(copy / layout.checkpoint_name(iteration) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="no checkpoint verifies") as e:
        resume(copy)
    assert "\n" not in str(e.value)
    assert "iter_0000006: __0_0.distcp fails its checksum" in str(e.value)


# ----------------------------------------------------------------------------------------- latest
def test_missing_latest_loads_the_newest_verified(copy, log_lines):
    (copy / "latest").unlink()
    assert resume(copy).iteration == 8
    assert any("no 'latest' file: loading iter_0000006 instead" in line for line in log_lines), log_lines
    assert any("resumed from" in line and "at iteration 6" in line for line in log_lines)


def test_garbage_latest_loads_the_newest_verified(copy, log_lines):
    (copy / "latest").write_bytes(b"\x00\xffnot a number")
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 6
    assert any("'latest' is corrupt" in line and "loading iter_0000006" in line for line in log_lines)


def test_latest_behind_a_newer_complete_checkpoint(copy, log_lines):
    """Killed after iter_6 was renamed into place, before 'latest' was updated: iter_6 is newer than 'latest'."""
    (copy / "latest").write_text("4\n")
    then = (copy / "latest").stat().st_mtime
    os.utime(copy / "iter_0000006" / "manifest.json", (then + 5, then + 5))
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 6
    assert any("names iteration 4 but iter_0000006 was completed after it" in line for line in log_lines)


KILL_BEFORE_LATEST = """
import os, sys
sys.path.insert(0, {tests!r})
from helpers import ToyFinetuner, engine
from rapidlite.checkpoint import layout
real, calls = layout._write_latest, []
def dying(save_dir, iteration):
    calls.append(iteration)
    if len(calls) == {kill_at}:  # iter_N is complete and renamed into place; the machine dies before 'latest'
        os._exit(9)
    real(save_dir, iteration)
layout._write_latest = dying
ToyFinetuner(engine(*sys.argv[1:])).train()
"""


@pytest.mark.parametrize("kill_at", [1, 2])
def test_killed_before_latest_is_written_resumes_from_the_complete_checkpoint(tmp_path, kill_at, log_lines):
    save = tmp_path / "run"
    script = tmp_path / "die.py"
    script.write_text(KILL_BEFORE_LATEST.format(tests=str(Path(__file__).parent), kill_at=kill_at))
    argv = [*ARGV, "--train-iters", "6", "--save-interval", "2", "--save", str(save)]
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr[-3000:]
    newest = layout.checkpoint_name(2 * kill_at)
    assert (save / "latest").is_file() == (kill_at > 1) and (save / newest / "manifest.json").is_file()
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "6", "--load", str(save)))
    trainer.setup_model(6)
    assert trainer.iteration == 2 * kill_at
    assert any(f"loading {newest} instead" in line for line in log_lines), log_lines


def test_latest_written_after_a_newer_checkpoint_is_obeyed(copy, log_lines):
    """A 'latest' set back by hand (or a run resumed from an earlier checkpoint into the same directory) wins over
    the older newer-numbered checkpoint."""
    then = (copy / "iter_0000006" / "manifest.json").stat().st_mtime
    (copy / "latest").write_text("4\n")
    os.utime(copy / "latest", (then + 5, then + 5))
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 4
    assert not any("instead" in line for line in log_lines)


def test_latest_naming_a_missing_checkpoint(copy, log_lines):
    shutil.rmtree(copy / "iter_0000006")
    (copy / "latest").write_text("6\n")
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 4
    assert any("names iter_0000006, which is missing: loading iter_0000004 instead" in line for line in log_lines)


def test_checkpoint_without_manifest_loads_unverified_once(copy, log_lines):
    for path in copy.glob("iter_*/manifest.json"):  # as an earlier version wrote them
        path.unlink()
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(copy)))
    trainer.setup_model(8)
    assert trainer.iteration == 6
    assert len([line for line in log_lines if "unverified" in line]) == 1


# -------------------------------------------------------------------------------------- --keep-last
def test_keep_last_prunes_older_checkpoints(tmp_path, log_lines):
    save = tmp_path / "run"
    train("--train-iters", "10", "--save-interval", "2", "--keep-last", "2", "--save", str(save))
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000008", "iter_0000010"]
    assert not list(save.glob(".tmp_*"))
    assert len([line for line in log_lines if "--keep-last 2: deleted" in line]) == 3


def test_keep_last_never_deletes_the_good_one_for_a_damaged_newer(copy, monkeypatch):
    """iter_6 damaged: the run falls back to 4 and saves 5, then 6 again; pruning leaves the damaged newer one
    alone until it is replaced, and the newest good checkpoint always stays."""
    flip_byte(copy / "iter_0000006" / "__0_0.distcp")
    seen = []
    real = selection.prune_checkpoints

    def watching(save_dir, keep, saved):
        deleted = real(save_dir, keep, saved)
        seen.append((saved, sorted(p.name for p in copy.glob("iter_*"))))
        return deleted

    monkeypatch.setattr(selection, "prune_checkpoints", watching)
    train("--train-iters", "6", "--save-interval", "1", "--keep-last", "1", "--load", str(copy), "--save", str(copy))
    assert seen == [(5, ["iter_0000005", "iter_0000006"]), (6, ["iter_0000006"])]
    assert integrity.verify_checkpoint(copy / "iter_0000006") is None


# ------------------------------------------------------------------------------------ shapes, disk full
class WideFinetuner(ToyFinetuner):
    def model_optimizer_lr_scheduler_provider(self):
        return MLP(hidden=48), None, None


def test_shape_mismatch_names_the_parameter_and_both_shapes(base):
    with pytest.raises(CheckpointError) as e:
        WideFinetuner(engine(*ARGV, "--train-iters", "8", "--load", str(base))).setup_model(8)
    assert "parameter net.0.weight has shape (32, 8) in the checkpoint but (48, 8) in the model" in str(e.value)
    assert "\n" not in str(e.value)


def test_shapes_are_checked_against_tensors_too():
    """The weights of a DeepSpeed checkpoint (or one loaded into DeepSpeed) are tensors, not DCP metadata."""
    dcp.check_shapes("ckpt", {"w": torch.zeros(2, 3)}, {"w": torch.ones(2, 3), "other": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"parameter w has shape \(3, 3\) in the checkpoint but \(2, 3\)"):
        dcp.check_shapes("ckpt", {"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 3)})


def _no_space(*args, **kwargs):
    raise OSError(_ERRNO["n"], os.strerror(_ERRNO["n"]))


_ERRNO = {"n": errno.ENOSPC}


@pytest.mark.parametrize("where,cause", [("dcp", "full"), ("torch.save", "full"), ("dcp", "permissions")])
def test_full_disk_while_saving_is_one_line_and_keeps_latest(tmp_path, monkeypatch, where, cause):
    """A full disk (or another refusal of the file system: permissions) while saving: one line with the cause and
    its fix, the partial checkpoint removed, ``latest`` on the last good one."""
    monkeypatch.setitem(_ERRNO, "n", errno.ENOSPC if cause == "full" else errno.EACCES)
    save = tmp_path / "run"
    trainer = ToyFinetuner(engine(*ARGV, "--train-iters", "4", "--save-interval", "2", "--save", str(save)))
    calls = {"n": 0}
    if where == "dcp":
        import torch.distributed.checkpoint.filesystem as fs

        real, real_writer = fs._write_item, fs.FileSystemWriter

        def writer(*args, **kwargs):  # one per checkpoint
            calls["n"] += 1
            return real_writer(*args, **kwargs)

        def write_item(*args, **kwargs):
            return _no_space() if calls["n"] == 2 else real(*args, **kwargs)

        monkeypatch.setattr(fs, "_write_item", write_item)
        monkeypatch.setattr(dcp.dcp, "FileSystemWriter", writer)
    else:
        real = torch.save

        def save_fn(obj, f, *args, **kwargs):
            if str(f).endswith("state.pt"):
                calls["n"] += 1
                if calls["n"] == 2:
                    _no_space()
            return real(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save_fn)
    with pytest.raises(CheckpointError) as e:
        trainer.train()
    message = str(e.value)
    assert "\n" not in message
    if cause == "full":
        assert "no space left on device" in message and f"(free space in {save}, then resume" in message, message
    else:  # not a full disk: the advice is not to free space
        assert "Permission denied" in message and "(fix that, then resume" in message, message
    assert "'latest' still points at iteration 2" in message
    assert (save / "latest").read_text().strip() == "2"
    assert not list(save.glob(".tmp_*")) and not (save / "iter_0000004").exists()
    assert integrity.verify_checkpoint(save / "iter_0000002") is None


@pytest.fixture
def stops(monkeypatch):
    """The watchdog's ends, recorded instead of ending this process; a short grace and poll."""
    ended = []
    monkeypatch.setattr(watchdog, "grace_seconds", lambda: 0.2)
    monkeypatch.setattr(watchdog, "POLL_SECONDS", 0.02)
    monkeypatch.setattr(watchdog, "_end_rank", ended.append)
    return ended


def test_the_save_watchdog_ends_a_rank_only_after_a_recorded_failure(tmp_path, stops):
    save, tmp = tmp_path / "run", tmp_path / "run" / ".tmp_iter_0000004"
    tmp.mkdir(parents=True)
    (save / "latest").write_text("2\n")
    with watchdog.SaveWatchdog(save, tmp, 4, rank=0, world=2):
        time.sleep(0.6)  # a slow healthy save: nothing recorded, nothing ended
        assert stops == []
        watchdog.record_failure(tmp, 1, "the disk is full (no space left on device)")
        deadline = time.monotonic() + 5
        while not stops and time.monotonic() < deadline:
            time.sleep(0.02)
    (error,) = stops[:1]
    assert isinstance(error, CheckpointError) and "\n" not in str(error)
    assert "iteration 4: rank 1: the disk is full (no space left on device); the ranks still inside" in str(error)
    assert "the partial checkpoint was removed and 'latest' still points at iteration 2" in str(error)
    assert not tmp.exists()


def test_the_save_watchdog_stops_with_the_save(tmp_path, stops):
    tmp = tmp_path / ".tmp_iter_0000004"
    tmp.mkdir()
    with watchdog.SaveWatchdog(tmp_path, tmp, 4, rank=1, world=2) as dog:
        dog.record(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "the disk is full (no space left on device)")
    assert watchdog.recorded_failure(tmp) == (1, "the disk is full (no space left on device)")
    time.sleep(0.6)  # the collectives lined up: the save's own one line ended it, the watchdog ends nothing
    assert stops == []


# ------------------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``rapidlite --user-script examples/pretrain_custom_model.py``, 4 iterations, checkpoints at 2 and 4 (in
    this process: the commands that load it are the ones launched)."""
    save = tmp_path_factory.mktemp("cli") / "run"
    argv = ["--user-script", PRETRAIN, *DP_COMMON, *DP_ONE, "--train-iters", "4", "--save-interval", "2"]
    assert rapidlite_here(*argv, "--save", str(save)) == 0
    return save


@pytest.mark.slow
def test_cli_falls_back_with_one_warning_line_then_refuses_in_one_line(cli_run, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(cli_run, save)
    scribble_4k(save / "iter_0000004" / "__0_0.distcp")
    argv = ["--user-script", PRETRAIN, *DP_COMMON, *DP_ONE, "--train-iters", "4", "--load", str(save)]
    proc = rapidlite(*argv, "--save", str(tmp_path / "resumed"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (warning,) = [line for line in proc.stdout.splitlines() if " is damaged" in line]
    assert "iter_0000004 is damaged: __0_0.distcp fails its checksum: loading iter_0000002 instead" in warning
    assert "resumed from" in proc.stdout and "at iteration 2" in proc.stdout
    assert "Traceback" not in proc.stderr

    zero_fill(save / "iter_0000002" / "__0_0.distcp")
    proc = rapidlite(*argv)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no checkpoint verifies" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_hash_their_own_files_and_agree_on_the_fallback(tmp_path):
    save = tmp_path / "run"
    argv = ["--user-script", PRETRAIN, *DP_COMMON, *DP_TWO, "--zero-3-memory-optimization"]
    proc = rapidlite(*argv, "--train-iters", "4", "--save-interval", "2", "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((save / "iter_0000004" / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt", ".metadata", "state.pt"} <= set(manifest)
    flip_byte(save / "iter_0000004" / "__1_0.distcp")  # rank 1's file: rank 1 finds it, both ranks fall back
    proc = rapidlite(*argv, "--train-iters", "4", "--load", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iter_0000004 is damaged: __1_0.distcp fails its checksum: loading iter_0000002 instead" in proc.stdout
    assert "at iteration 2" in proc.stdout


def test_hashing_is_shared_by_the_ranks_that_wrote_the_files():
    names = ["__0_0.distcp", "__1_0.distcp", "rng_rank1.pt", "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert [integrity._writer_rank(n, 2) for n in names] == [0, 1, 1, 1]
    assert integrity._writer_rank("deepspeed/mp_rank_00_model_states.pt", 2) == 0
    assert integrity._writer_rank("state.pt", 2) == integrity._writer_rank(".metadata", 2) == 0


def test_a_traceback_never_reaches_the_user_on_a_zero_filled_metadata_without_manifest(copy):
    """A checkpoint of an earlier version (no manifest) whose file is damaged: still one line, never a traceback
    (DCP's CheckpointException is a BaseException)."""
    for path in copy.glob("iter_*/manifest.json"):
        path.unlink()
    zero_fill(copy / "iter_0000006" / "__0_0.distcp")
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from helpers import ToyFinetuner, engine\n"
        f"ToyFinetuner(engine('--micro-batch-size', '8', '--train-iters', '8', '--load', {str(copy)!r})).train()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "cannot read the checkpoint" in proc.stderr, proc.stderr
