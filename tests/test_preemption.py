"""Never lose a run: SIGTERM/SIGUSR1 stop every rank after the same step with a checkpoint and exit code 143;
``--save D --load D`` starts fresh on the first launch; ``--max-restarts`` resumes from the latest checkpoint;
a rank killed by SIGKILL is named in one line; kill -9 at random moments (also mid-save) loses nothing.
Real signals to real processes; every resumed run is compared bit for bit with an uninterrupted one. The
repeated kills run under ``-m soak``; the default suite kills once."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import DP_COMMON, DP_ONE, DP_TWO, REPO, read_metrics
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.errors import CheckpointError
from rapidlite.resolve import parse_args
from rapidlite.runtime.preemption import EXIT_CODE

SCRIPT = str(REPO / "tests" / "scripts" / "preemptible.py")
ITERS = 24
FLAGS = [*DP_COMMON, "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS)]
LAYOUTS = {"one": DP_ONE, "two": DP_TWO}


def start(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``rapidlite --user-script preemptible.py ARGV`` in the background, output read line by line."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "rapidlite", "--user-script", SCRIPT, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def wait_for(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> list[str]:
    """Stdout lines up to and including the first one matching ``pattern``."""
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError(f"no line matching {pattern!r}:\n{''.join(lines)}\n{proc.stderr.read()[-3000:]}")


def finish(proc: subprocess.Popen, earlier: list[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, "".join(earlier) + out, err


def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = start(*argv, env=env)
    return finish(proc, [])


def losses(save: Path) -> dict[int, float]:
    """Training loss per iteration; a record written again after a resume replaces the earlier one."""
    return {r["iteration"]: r["loss"] for r in read_metrics(save) if "split" not in r}


def assert_same_run(save: Path, reference: Path) -> None:
    assert losses(save) == losses(reference)
    expected = read_model_tensors(reference / f"iter_{ITERS:07d}")
    actual = read_model_tensors(save / f"iter_{ITERS:07d}")
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each layout, trained once."""
    root, done = tmp_path_factory.mktemp("reference"), {}

    def get(layout: str) -> Path:
        if layout not in done:
            code, out, err = run(*FLAGS, *LAYOUTS[layout], "--save", str(root / layout))
            assert code == 0, err[-3000:]
            done[layout] = root / layout
        return done[layout]

    return get


def stop_with_signal(layout: str, sig: signal.Signals, save: Path | None, after: int = 4) -> tuple[int, str, str]:
    """Start a run and send ``sig`` to the process the user started once iteration ``after`` is logged."""
    keep = ["--save", str(save), "--load", str(save)] if save is not None else []
    proc = start(*FLAGS, *LAYOUTS[layout], *keep, env={"STEP_SLEEP": "0.05"})
    earlier = wait_for(proc, rf"iteration: {after} \|")
    proc.send_signal(sig)
    return finish(proc, earlier)


def assert_stopped(code: int, out: str, err: str, sig: signal.Signals, save: Path, after: int) -> int:
    """The run stopped on ``sig`` after a step past ``after`` with a checkpoint of it; returns that iteration."""
    assert code == EXIT_CODE, err[-3000:]
    (stopped,) = [line for line in out.splitlines() if "stopped after iteration" in line]
    stopped_at = int(re.search(r"stopped after iteration (\d+)", stopped).group(1))
    assert sig.name in stopped and f"saved a checkpoint in {save}" in stopped and "exit code 143" in stopped
    assert after <= stopped_at < ITERS
    assert (save / "latest").read_text().strip() == str(stopped_at)
    assert sorted(losses(save)) == list(range(1, stopped_at + 1))  # every rank stopped after that step
    assert "Traceback" not in err and "rapidlite: error" not in err, err[-3000:]
    return stopped_at


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,signals",
    [
        # one process: stopped by SIGUSR1, resumed and stopped again by SIGTERM, resumed to the end
        pytest.param("one", (signal.SIGUSR1, signal.SIGTERM), id="one-SIGUSR1-then-SIGTERM"),
        pytest.param("two", (signal.SIGTERM,), marks=pytest.mark.distributed, id="two-SIGTERM"),
    ],
)
def test_signal_saves_stops_and_the_same_command_resumes_bit_exact(tmp_path, reference, layout, signals):
    save = tmp_path / "run"
    stopped_at = 0
    for sig in signals:
        after = max(4, stopped_at + 2)
        code, out, err = stop_with_signal(layout, sig, save, after=after)
        if stopped_at == 0:
            assert f"--load {save} does not exist yet: starting fresh" in out  # the first launch of the requeue command
        else:
            assert f"resumed from {save} at iteration {stopped_at}" in out
        stopped_at = assert_stopped(code, out, err, sig, save, after)

    code, out, err = run(*FLAGS, *LAYOUTS[layout], "--save", str(save), "--load", str(save))  # the same command
    assert code == 0, err[-3000:]
    assert f"resumed from {save} at iteration {stopped_at}" in out
    assert_same_run(save, reference(layout))


@pytest.mark.slow
def test_signal_without_save_says_nothing_was_saved(tmp_path):
    code, out, err = stop_with_signal("one", signal.SIGTERM, None)
    assert code == EXIT_CODE, err[-3000:]
    (stopped,) = [line for line in out.splitlines() if "stopped after iteration" in line]
    assert "nothing saved (no --save)" in stopped


def test_save_and_load_of_one_directory_start_fresh_only_when_it_holds_no_checkpoint(tmp_path):
    """The first launch of a requeue command starts fresh (also after a crash in the first save); --load alone
    still names a checkpoint that must exist."""
    script = ["--user-script", SCRIPT, "--train-iters", "2"]
    d = tmp_path / "d"
    for prepare in (lambda: None, d.mkdir, lambda: (d / ".tmp_iter_0000001").mkdir()):
        prepare()
        config = parse_args([*script, "--save", str(d), "--load", str(d)])
        assert config.load is None
        assert any("starting fresh" in n for n in config.notices)
    with pytest.raises(CheckpointError, match="directory not found"):
        parse_args([*script, "--load", str(tmp_path / "missing")])
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        parse_args([*script, "--load", str(d)])  # not the --save directory: a mistake, not a first launch
    (d / "iter_0000001").mkdir()  # a checkpoint but no 'latest': resumed (verified when loaded), not started over
    config = parse_args([*script, "--save", str(d), "--load", str(d)])
    assert config.load == str(d) and not any("starting fresh" in n for n in config.notices)


@pytest.mark.slow
@pytest.mark.distributed
def test_max_restarts_resumes_from_the_latest_checkpoint(tmp_path, reference):
    """Rank 1 crashes in iteration 7 of the first attempt; the restarted attempt resumes at the checkpoint of
    iteration 6 (--save only, no --load) and the run ends as the uninterrupted one."""
    save = tmp_path / "run"
    argv = [*FLAGS, *DP_TWO, "--save-interval", "3", "--save", str(save), "--max-restarts", "1"]
    code, out, err = run(*argv, env={"CRASH_AT": "7"})
    assert code == 0, err[-3000:]
    assert f"restarted attempt 1 (--max-restarts): resuming from the latest checkpoint in {save}" in out
    assert f"resumed from {save} at iteration 6" in out
    assert_same_run(save, reference("two"))


def worker_pid(launcher: int, rank: int) -> int:
    """The pid of the worker of ``rank`` that the launcher started: its child named ``rapidlite-rRANK`` (forked),
    or with RANK=rank in its environment (a new process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        named = stat.split("(", 1)[1].rsplit(")", 1)[0] == f"rapidlite-r{rank}"
        if ppid == launcher and (named or f"RANK={rank}".encode() in environ):
            return int(entry.name)
    raise AssertionError(f"no rank {rank} worker under pid {launcher}")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("repeats", [pytest.param(1, id="once"), pytest.param(4, marks=pytest.mark.soak, id="4-times")])
def test_a_rank_killed_by_sigkill_is_named_once(tmp_path, repeats):
    """What an out-of-memory kill looks like: the dead rank and its signal, not its peer's gloo traceback.
    Repeated under ``-m soak`` (the race between the dead rank and its peer's error differs run to run)."""
    for _ in range(repeats):
        proc = start(*FLAGS, *DP_TWO, env={"STEP_SLEEP": "0.05"})
        earlier = wait_for(proc, r"iteration: 3 \|")
        os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
        code, out, err = finish(proc, earlier)
        assert code == 128 + signal.SIGKILL, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("rapidlite: error:")]
        assert len(errors) == 1 and "rank 1 was killed by SIGKILL" in errors[0], err[-3000:]
        assert "Traceback" not in err and "Connection reset" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_that_do_not_stop_are_ended_within_the_process_group_timeout(tmp_path):
    """Every rank hangs in a step, so none reaches the end of it to save: the launcher kills them once the process
    group's timeout has passed after SIGTERM (12 s here) and still ends with 143, naming them in one line."""
    proc = start(*FLAGS, *DP_TWO, "--distributed-timeout-minutes", "0.2", env={"HANG_AT": "4"})
    earlier = wait_for(proc, r"rank 0 hangs in iteration 4")  # signalled earlier, the ranks would stop after step 3
    workers = [worker_pid(proc.pid, rank) for rank in (0, 1)]
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, earlier)
    assert code == EXIT_CODE, err[-3000:]
    assert 12 <= time.monotonic() - signalled < 60
    (line,) = [line for line in err.splitlines() if line.startswith("rapidlite:")]
    assert "SIGTERM: ranks 0, 1 had not stopped 12 s after it" in line and "Traceback" not in err, err[-3000:]
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_failing_while_the_group_stops_still_ends_with_143(tmp_path):
    """SIGTERM reaches ranks that then fail instead of saving (here: 3 s into a hung step; a collective's timeout
    does the same): the job was preempted all the same, so the launcher ends with 143 and names the failure in one
    line, without a traceback."""
    proc = start(*FLAGS, *DP_TWO, env={"HANG_AT": "4", "HANG_FOR": "3"})
    earlier = wait_for(proc, r"rank 0 hangs in iteration 4")
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, earlier)
    assert code == EXIT_CODE, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("rapidlite:")]
    assert "SIGTERM: not every rank stopped cleanly (rank" in line and "gave up hanging" in line, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "attempts,least", [pytest.param(1, 1, id="once"), pytest.param(8, 3, marks=pytest.mark.soak, id="8-times")]
)
def test_kill_9_at_random_moments_loses_nothing(tmp_path, reference, attempts, least):
    """A checkpoint every step, so a kill may land mid-save; every resume is the same command, and the run
    ends as the uninterrupted one. The moments are seeded, so a failure can be replayed. One kill by default;
    ``-m soak`` kills it up to 8 times (at least 3 before it ends)."""
    rng = random.Random(20240611)
    save = tmp_path / "run"
    argv = [*FLAGS, *DP_ONE, "--save-interval", "1", "--save", str(save), "--load", str(save)]
    kills = 0
    for _ in range(attempts):
        proc = start(*argv, env={"STEP_SLEEP": "0.02"})
        earlier = wait_for(proc, r"iteration: \d+ \||evaluation \(validation\)")
        if "evaluation" in earlier[-1]:
            break  # the run reached its end before this kill
        time.sleep(rng.uniform(0, 0.6))
        proc.kill()
        finish(proc, earlier)
        kills += 1
    assert kills >= least
    code, out, err = run(*argv)
    assert code == 0, err[-3000:]
    assert_same_run(save, reference("one"))
    assert not list(save.glob(".tmp_*"))


STUBS = {
    # srun forwards signals to its tasks; the stub becomes its task instead.
    "srun": 'while [[ $1 == --* ]]; do shift; done; exec "$@"',
    "scontrol": 'echo "$*" >> "$STUB_LOG"',
    # rapidlite as it behaves: stops with 143 on USR1/TERM (after its step and save), else finishes with 0.
    "rapidlite": 'trap "exit 143" USR1 TERM; echo "$*" > "$STUB_READY"; for _ in $(seq 30); do sleep 0.1; done',
}


@pytest.mark.parametrize("sig,requeued", [(None, False), (signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_slurm_script_passes_signals_on_and_requeues_after_the_time_limit_signal(tmp_path, sig, requeued):
    """launch/slurm.sbatch with stand-ins for srun, scontrol and rapidlite: USR1 (--signal=B:USR1@120) reaches
    rapidlite and the job is requeued after its exit 143; TERM (scancel) reaches it and nothing is requeued."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log, ready = tmp_path / "scontrol.log", tmp_path / "ready"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "STUB_READY": str(ready),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_ID": "42",
        "SLURM_NODEID": "0",
        "NPROC_PER_NODE": "2",
    }
    script = subprocess.run(["bash", "-n", str(REPO / "launch" / "slurm.sbatch")], capture_output=True, text=True)
    assert script.returncode == 0, script.stderr
    proc = subprocess.Popen(
        ["bash", str(REPO / "launch" / "slurm.sbatch"), "--task", "pretraining", "--save", "d", "--load", "d"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert ready.read_text().split() == ["--nproc-per-node", "2", "--task", "pretraining", "--save", "d", "--load", "d"]
    if sig is not None:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == (0 if sig is None else EXIT_CODE), err
    assert (log.read_text() if log.exists() else "") == ("requeue 42\n" if requeued else "")


@pytest.mark.parametrize("layout", ["one", pytest.param("two", marks=pytest.mark.distributed)])
def test_a_loop_of_ones_own_stops_on_a_signal_through_engine_preemption(tmp_path, layout):
    """``with engine.preemption() as watch``: the loop saves and breaks after the step the signal came in, every
    rank agreeing on it, and the process ends with exit code 143."""
    script = str(REPO / "tests" / "scripts" / "own_loop_preemptible.py")
    saved = tmp_path / "saved"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = ["--nproc-per-node", "2"] if layout == "two" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "rapidlite", "--user-script", script, "--lr", "1e-3", "--train-iters", "10000", *ranks],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "SAVE_FILE": str(saved)},
    )  # fmt: skip
    earlier = wait_for(proc, r"^step 3$")
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, earlier)
    assert code == EXIT_CODE, err[-3000:]
    stopped = int(saved.read_text())
    assert 3 <= stopped < 200 and f"step {stopped}\n" in out
    assert "SIGTERM: the loop stopped (exit code 143)" in out + err
    assert "Traceback" not in err, err[-3000:]


def test_a_signal_at_an_epoch_end_loses_no_validation(tmp_path, monkeypatch, log_lines):
    """SIGTERM after an epoch's last step stops before its validation; the resumed run validates that epoch
    first, so the run ends with one validation per epoch, as an uninterrupted run does."""
    from helpers import ToyFinetuner, engine
    from rapidlite.runtime.preemption import Preempted
    from rapidlite.trainer.clock import RunClock

    flags = ("--micro-batch-size", "16", "--epochs", "3")  # 64 samples: 4 steps per epoch
    ToyFinetuner(engine(*flags, "--save", str(tmp_path / "whole"))).train()
    expected = [(r["iteration"], r["loss"]) for r in read_metrics(tmp_path / "whole") if r.get("split") == "validation"]
    assert [i for i, _ in expected] == [4, 8, 12]

    trainer = ToyFinetuner(engine(*flags, "--save", str(tmp_path / "run")))
    monkeypatch.setattr(RunClock, "signalled", lambda clock: int(signal.SIGTERM) if trainer.iteration == 4 else 0)
    with pytest.raises(Preempted):
        trainer.train()
    monkeypatch.undo()
    assert not [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    ToyFinetuner(engine(*flags, "--save", str(tmp_path / "run"), "--load", str(tmp_path / "run"))).train()
    got = [(r["iteration"], r["loss"]) for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert [i for i, _ in got] == [4, 8, 12]
    for (_, loss), (_, want) in zip(got, expected, strict=True):
        assert loss == pytest.approx(want, rel=1e-6)
    assert any("the end of epoch 1 that the stopped run did not validate" in line for line in log_lines)
