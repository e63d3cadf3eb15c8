"""The plan's "runtime" on a CPU (rapidlite.planning.runtime): this process's own memory (without the libraries'
file-backed pages), read with what the run imports and its tokenizer loaded; and that reading itself
(rapidlite.observe.logging.process_memory), which a CPU run's logged peak uses too."""

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


def test_the_runtime_is_this_processs_own_memory(monkeypatch):
    own = 550 * 2**20
    monkeypatch.setattr(runtime, "process_memory", lambda: {"own": own, "peak": 2 * own, "files": 250 * 2**20})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # one process, and ranks forked from the launcher (which hold the launcher's anonymous pages as their own)
    for flags in ((), ("--nproc-per-node", "2", "--start-method", "fork")):
        assert runtime.runtime_bytes(_settings(*flags), None) == own


def test_process_memory_leaves_out_file_backed_pages(tmp_path):
    """Anonymous pages (a tensor's) count in the process's own memory and its peak; a file mapped and read (as a
    library's code is) counts in neither, only in ``files``: how much of it a process holds follows the page
    cache. The anonymous pages are a mapping of their own, written: a block from malloc could reuse heap pages
    already resident in a long-lived test worker."""
    import mmap

    from rapidlite.observe.logging import process_memory

    MiB = 2**20
    path = tmp_path / "library.so"
    path.write_bytes(b"\1" * (64 * MiB))
    before = process_memory()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == 64 * MiB // 4096  # every page touched
        mapped_now = process_memory()
    assert mapped_now["files"] - before["files"] > 48 * MiB
    assert abs(mapped_now["own"] - before["own"]) < 8 * MiB
    assert mapped_now["peak"] - before["peak"] < 8 * MiB

    held = mmap.mmap(-1, 48 * MiB)  # 48 MiB of anonymous pages, every one written
    for i in range(0, 48 * MiB, 4096):
        held[i] = 1
    holding = process_memory()
    assert 40 * MiB < holding["own"] - before["own"] < 56 * MiB
    held.close()
    after = process_memory()
    assert after["own"] < holding["own"] - 40 * MiB  # given back
    assert after["peak"] >= holding["own"]  # the high-water mark keeps it


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
    the same one and reads its memory while it holds it."""
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
    reading = lambda: (held.append(loaded[-1][1]() is not None), {"own": 1})[1]  # noqa: E731
    monkeypatch.setattr(runtime, "process_memory", reading)
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", "some/model", "--data-path", "unused"]
    runtime.runtime_bytes(parse_args(argv).sections, get_task("causal_lm"))
    assert [name for name, _ in loaded] == ["some/model"] and held == [True]
    assert loaded[-1][1]() is None  # let go afterwards
    runtime.runtime_bytes(_settings(), get_task("pretraining"))  # pretraining's data is tokenised already
    assert len(loaded) == 1


def test_a_forked_childs_peak_is_its_own():
    """The peak is held as a running maximum per process: a rank forked by the launcher reports its own high-water
    mark, not the launcher's (which had built and freed 200 MiB here)."""
    import mmap
    import os

    from rapidlite.observe.logging import process_memory

    with mmap.mmap(-1, 200 * 2**20) as held:  # 200 MiB of anonymous pages, written, then given back
        for i in range(0, len(held), 4096):
            held[i] = 1
        process_memory()
    parent = process_memory()["peak"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its peak, through the pipe
        os.write(write, str(process_memory()["peak"]).encode())
        os._exit(0)
    os.close(write)
    child = int(os.read(read, 64))
    os.waitpid(pid, 0)
    assert parent - child > 150 * 2**20, (parent, child)
