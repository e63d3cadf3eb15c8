"""A worker forked from the launcher (``rapidlite.runtime.forked_workers``) starts as a new interpreter would:
the environment torchrun gives it, none of the launcher's exit or signal handlers, its own session, and its exit
code; torchrun's other commands are still started as new processes. Whole runs forked and spawned are compared in
``tests/test_distributed.py``."""

import atexit
import json
import os
import signal
import sys

import pytest

from rapidlite.runtime.forked_workers import ForkedProcess, fork_workers, python_command

CHILD = """
import atexit, json, os, signal, sys
record = {
    "argv": sys.argv, "rank": os.environ.get("RANK"), "exit_handlers": atexit._ncallbacks(),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "session_leader": os.getsid(0) == os.getpid(), "main": __name__,
}
open(os.environ["OUT"], "w").write(json.dumps(record))
sys.exit(int(os.environ["CODE"]))
"""


def test_a_forked_worker_starts_as_a_new_interpreter(tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "record.json"
    script.write_text(CHILD)
    atexit.register(print, "the launcher's exit handler")  # this process's; a worker must not run it
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        env = {**os.environ, "RANK": "1", "OUT": str(out), "CODE": "3"}
        proc = ForkedProcess((sys.executable, "-u", str(script), "--flag", "x"), env, None, None)
        assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    finally:
        signal.signal(signal.SIGTERM, previous)
        atexit.unregister(print)
    record = json.loads(out.read_text())
    assert record == {
        "argv": [str(script), "--flag", "x"], "rank": "1", "exit_handlers": 0, "sigterm_default": True,
        "session_leader": True, "main": "__main__",
    }  # fmt: skip


def test_a_worker_killed_by_a_signal_reports_it(tmp_path):
    """As ``Popen`` does: the negative signal number, which the launcher turns into its one line."""
    path = tmp_path / "sleeper.py"
    path.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    sleeper = ForkedProcess((sys.executable, "-u", str(path)), dict(os.environ), None, None)
    assert sleeper.poll() is None
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.parametrize(
    "args,expected",
    [
        ((sys.executable, "-u", "-m", "rapidlite", "--task", "x"), ("rapidlite", ["--task", "x"], True)),
        ((sys.executable, "-u", "train.py", "--lr", "1"), ("train.py", ["--lr", "1"], False)),
        (("numactl", "--cpunodebind=0", sys.executable, "-u", "train.py"), None),
        (("/other/python", "-u", "train.py"), None),
    ],
)
def test_only_torchruns_python_commands_are_forked(args, expected):
    assert python_command(args) == expected


def test_auto_forks_without_cuda():
    import torch

    assert fork_workers("auto") == (not torch.cuda.is_available())
    assert fork_workers("fork") and not fork_workers("spawn")
