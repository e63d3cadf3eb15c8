"""The plan's "runtime" on a CPU (rapidlite.planning.runtime): this process's resident set, with a forked rank's
code pages in place of what importing touched."""

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


@pytest.mark.parametrize(
    "flags, env, forked",
    [
        ((), {}, False),  # one process
        (("--nproc-per-node", "2"), {}, True),  # rapidlite's launcher forks on a machine without CUDA
        (("--nproc-per-node", "2", "--start-method", "spawn"), {}, False),  # new interpreters
        (("--nproc-per-node", "2", "--start-method", "fork"), {}, True),
        (("--nproc-per-node", "2"), {"WORLD_SIZE": "2"}, False),  # started by torchrun or Slurm: not forked
    ],
)
def test_which_ranks_are_forked(monkeypatch, flags, env, forked):
    if "--start-method" not in flags and forked:
        import torch

        if torch.cuda.is_available():
            pytest.skip("auto spawns on a machine with CUDA")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert runtime.forked_ranks(_settings(*flags)) is forked


def test_a_forked_rank_counts_the_code_it_runs_not_what_importing_touched(monkeypatch):
    parts = (400 * runtime.MiB, 150 * runtime.MiB)  # anonymous, file-backed
    monkeypatch.setattr(runtime, "resident_parts", lambda: parts)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert runtime.runtime_bytes(_settings(), None) == sum(parts)
    forked = _settings("--nproc-per-node", "2", "--start-method", "fork")
    assert runtime.runtime_bytes(forked, None) == parts[0] + runtime.FORKED_RANK_CODE
    from rapidlite.config.tasks import get_task

    reads_data = get_task("causal_lm")  # its data through datasets: that code too
    assert runtime.runtime_bytes(forked, reads_data) == parts[0] + runtime.FORKED_RANK_CODE + runtime.FORKED_DATA_CODE
    small = (400 * runtime.MiB, 30 * runtime.MiB)  # never more than this process maps
    monkeypatch.setattr(runtime, "resident_parts", lambda: small)
    assert runtime.runtime_bytes(forked, None) == sum(small)


def test_resident_parts_are_this_processs():
    anonymous, file_backed = runtime.resident_parts()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    rss = int(status["VmRSS"].split()[0]) * 1024
    assert anonymous > 0 and file_backed > 0
    assert abs(anonymous + file_backed - rss) < 16 * runtime.MiB  # and shared memory, a few pages


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
    monkeypatch.setattr(runtime, "resident_parts", lambda: (held.append(loaded[-1][1]() is not None), (1, 1))[1])
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", "some/model", "--data-path", "unused"]
    runtime.runtime_bytes(parse_args(argv).sections, get_task("causal_lm"))
    assert [name for name, _ in loaded] == ["some/model"] and held == [True]
    assert loaded[-1][1]() is None  # let go afterwards
    runtime.runtime_bytes(_settings(), get_task("pretraining"))  # pretraining's data is tokenised already
    assert len(loaded) == 1
