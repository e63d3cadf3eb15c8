"""Exit codes are right on every layout: a crash in a user's script is non-zero (1 for a bug, 2 for a user error),
also when rapidlite started a process group of its own (ZeRO or DeepSpeed on one process) and under torchrun,
whether the script runs through ``rapidlite --user-script`` or ``python script.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO, run_cli

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from rapidlite import RapidliteEngine, ConfigError

engine = RapidliteEngine()
what = sys.argv[sys.argv.index("--then") + 1] if "--then" in sys.argv else "{then}"
if what == "crash":
    raise RuntimeError("boom in user code")
if what == "user-error":
    raise ConfigError("a mistake the user can fix")
if what == "exit-3":
    sys.exit(3)
print("finished")
"""

LAYOUTS = {
    "one process": [],
    "ZeRO-2 on one process": ["--zero-2-memory-optimization"],
    "DeepSpeed on one process": ["--deepspeed", "--zero-2-memory-optimization"],
    "2 ranks": ["--nproc-per-node", "2"],
}


def run(tmp_path, how: str, layout: list[str], then: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"script_{then}.py"
    script.write_text(SCRIPT.replace("{then}", then))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    prefix = [sys.executable, "-m", "rapidlite", "--user-script"] if how == "rapidlite" else [sys.executable]
    return subprocess.run([*prefix, str(script), *layout], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("how", ["rapidlite", "python"])
def test_a_crash_exits_non_zero_and_success_exits_zero(tmp_path, how, layout):
    if "DeepSpeed" in layout:
        pytest.importorskip("deepspeed")
    argv = LAYOUTS[layout]
    crash = run(tmp_path, how, argv, "crash")
    assert crash.returncode == 1, (crash.returncode, crash.stderr[-2000:])
    assert "boom in user code" in crash.stderr
    user_error = run(tmp_path, how, argv, "user-error")
    assert user_error.returncode == 2, (user_error.returncode, user_error.stderr[-2000:])
    assert "a mistake the user can fix" in user_error.stderr and "Traceback" not in user_error.stderr
    done = run(tmp_path, how, argv, "finish")
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]
    exit3 = run(tmp_path, how, argv, "exit-3")  # the script's own exit code, also from launched workers
    assert exit3.returncode == 3, (exit3.returncode, exit3.stderr[-2000:])


ENDING = """
import atexit, os, pathlib, sys, threading, time
import torch
from rapidlite import RapidliteEngine

out = pathlib.Path(os.environ["OUT"])
RapidliteEngine()
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.5)
    (out / "thread").write_text("finished")
threading.Thread(target=late, daemon=os.environ["THREAD"] == "daemon").start()
print("buffered", end="")  # no newline, no flush: the end of the process flushes it
sys.exit(4)
"""


@pytest.mark.parametrize("thread", ["daemon", "non-daemon"])
def test_the_fast_end_of_a_command_keeps_exit_handlers_output_and_threads(tmp_path, thread):
    """``rapidlite`` ends without the interpreter's teardown once torch is loaded: exit handlers still run,
    buffered output is flushed, the exit code is kept, and a running non-daemon thread is waited for."""
    script = tmp_path / "script.py"
    script.write_text(ENDING)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path), "THREAD": thread}
    argv = [sys.executable, "-m", "rapidlite", "--user-script", str(script)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert proc.stdout.endswith("buffered")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").exists() == (thread == "non-daemon")


NO_TRAINING = {
    "a trainer never run": (
        "from rapidlite import Finetuner\n\nclass MyTrainer(Finetuner):\n    pass\n",
        "ran but started no training: it defines MyTrainer but never runs it; end it with MyTrainer().train()",
    ),
    "nothing at all": ("print('hello')\n", "it defines no Finetuner or PreTrainer subclass"),
}


@pytest.mark.parametrize("case", list(NO_TRAINING))
def test_a_user_script_that_starts_no_training_is_one_line(tmp_path, case):
    """It ended with 0 and nothing said: the run looked done."""
    source, says = NO_TRAINING[case]
    script = tmp_path / "train.py"
    script.write_text(source)
    proc = run_cli("--user-script", str(script), "--train-iters", "2", "--save", str(tmp_path / "run"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rapidlite: error: --user-script {script} ") and says in last, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


OWN_ERRORS = {
    "syntax": ("import os\ndef f(:\n    pass\n", "SyntaxError: invalid syntax"),
    "import": ("import os\nimport no_such_module_xyz\n", "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    "runtime": ("def f():\n    return 1 / 0\n\nf()\n", "ZeroDivisionError: division by zero"),
}


@pytest.mark.parametrize("case", list(OWN_ERRORS))
def test_a_user_scripts_own_error_shows_its_frames_then_one_line(tmp_path, case):
    """The traceback starts at the script (it was about 20 lines of rapidlite's and runpy's frames first); the
    last line names the script and the error; the exit code is a crash's."""
    source, error = OWN_ERRORS[case]
    script = tmp_path / "train.py"
    script.write_text(source)
    proc = run_cli("--user-script", str(script), "--train-iters", "2")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"rapidlite: error: --user-script {script} raised {error.split(':')[0]}"), lines
    assert error in lines[-2], lines
    assert f'File "{script}", line 2' in proc.stderr
    assert "runpy" not in proc.stderr and "rapidlite/cli/main.py" not in proc.stderr, proc.stderr
    assert len(lines) <= 8, proc.stderr


NO_BASE = """
class MyFinetuner:
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        return None, None, None

    def run_forward_step(self, batch, model):
        return None


trainer = MyFinetuner(engine=None)
trainer.train()
"""


def test_a_trainer_class_without_its_base_is_named(tmp_path):
    """ "MyFinetuner() takes no arguments" said nothing of the missing base class."""
    from helpers import rapidlite_captured

    script = tmp_path / "train.py"
    script.write_text(NO_BASE)
    proc = rapidlite_captured("--user-script", str(script), "--train-iters", "2")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == (
        f"rapidlite: error: --user-script {script} raised TypeError: MyFinetuner() takes no arguments; MyFinetuner "
        "defines train_valid_test_datasets_provider, run_forward_step but subclasses neither Finetuner nor "
        "PreTrainer: class MyFinetuner(Finetuner) (from rapidlite import Finetuner)"
    )


def test_a_user_scripts_own_error_on_two_ranks_shows_its_frames(tmp_path):
    """Under the launcher, the failing rank's traceback starts at the script too."""
    script = tmp_path / "train.py"
    script.write_text("import os\nimport no_such_module_xyz\n")
    proc = run_cli("--user-script", str(script), "--nproc-per-node", "2")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "failed: ModuleNotFoundError: No module named 'no_such_module_xyz'" in proc.stderr
    assert f'File "{script}", line 2' in proc.stderr
    assert "runpy" not in proc.stderr and "rapidlite/cli/main.py" not in proc.stderr, proc.stderr
