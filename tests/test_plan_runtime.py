"""The plan's "runtime" on a CPU (rapidlite.planning.runtime): this process's resident set, read with what the run
imports and its tokenizer loaded."""

import sys

import pytest

from rapidlite.planning import runtime
from rapidlite.resolve import parse_args

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")

BASE = ["--task", "pretraining", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
BASE += ["--seq-length", "64", "--micro-batch-size", "1", "--data-path", "unused", "--vocab-size", "1000"]
BASE += ["--train-iters", "2", "--tokenizer-type", "NullTokenizer"]


def _settings(*flags: str):
    return parse_args([*BASE, *flags]).sections


def test_the_runtime_is_this_processs_resident_set(monkeypatch):
    resident = 550 * 2**20
    monkeypatch.setattr(runtime, "resident_bytes", lambda: resident)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # one process, and ranks forked from the launcher (their file-backed pages follow the page cache as ours do)
    for flags in ((), ("--nproc-per-node", "2", "--start-method", "fork")):
        assert runtime.runtime_bytes(_settings(*flags), None) == resident


def test_resident_bytes_are_this_processs():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss = int(status["VmRSS"].split()[0]) * 1024
    assert abs(runtime.resident_bytes() - rss) < 16 * 2**20  # a few pages apart, read a moment later


def test_the_run_libraries_the_plan_imports_exist_here():
    """The planner imports what a run imports (``run_libraries``), skipping a missing one; a module renamed by a
    library's new version would leave that memory uncounted, so each one named must be found here."""
    import importlib.util

    from rapidlite.config.libraries import run_libraries
    from rapidlite.config.tasks import get_task

    pytest.importorskip("deepspeed")
    settings = parse_args(
        ["--task", "seq2seq", "--pretrained-model-name-or-path", "t5-small", "--data-path", "unused"]
        + ["--nproc-per-node", "2", "--deepspeed", "--zero-2-memory-optimization"]
    ).sections
    names = run_libraries(settings, get_task("seq2seq"))
    assert "deepspeed" in names and "datasets" in names and "torchmetrics" in names
    assert [n for n in names if importlib.util.find_spec(n) is None] == []


def test_the_runtime_is_read_with_the_runs_tokenizer_loaded(monkeypatch):
    """Every rank of a run that tokenises its data holds its tokenizer (17 MiB at 64k words): the planner loads
    the same one and reads its resident set while it holds it."""
    import weakref

    from rapidlite.config.tasks import get_task
    from rapidlite.models import hf

    class Tokenizer:
        pass

    loaded: list = []

    def load(name):
        loaded.append((name, weakref.ref(tokenizer := Tokenizer())))
        return tokenizer

    held: list = []
    monkeypatch.setattr(hf, "load_tokenizer", load)
    monkeypatch.setattr(runtime, "resident_bytes", lambda: (held.append(loaded[-1][1]() is not None), 1)[1])
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", "some/model", "--data-path", "unused"]
    runtime.runtime_bytes(parse_args(argv).sections, get_task("causal_lm"))
    assert [name for name, _ in loaded] == ["some/model"] and held == [True]
    assert loaded[-1][1]() is None  # let go afterwards
    runtime.runtime_bytes(_settings(), get_task("pretraining"))  # pretraining's data is tokenised already
    assert len(loaded) == 1
