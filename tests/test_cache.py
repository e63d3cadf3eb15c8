"""build_once: what rapidlite builds into its cache (embedded demos) is built once, whole, by racing ranks."""

from __future__ import annotations

import os
import threading
import time

import pytest

from rapidlite.runtime.cache import COMPLETE, build_once


def test_racing_builders_leave_one_whole_directory_and_no_scratch(tmp_path):
    calls = []

    def build(scratch):
        calls.append(1)
        time.sleep(0.1)
        (scratch / "data").write_text("ok")

    threads = [threading.Thread(target=build_once, args=(tmp_path / "demo", build)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [COMPLETE, "data"]
    assert not list(tmp_path.glob(".tmp-*"))
    build_once(tmp_path / "demo", build)  # complete: not built again
    assert len(calls) == 3


def test_a_crashed_build_leaves_nothing_and_an_incomplete_directory_is_rebuilt(tmp_path):
    def crash(scratch):
        (scratch / "half").write_text("")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "demo", crash)
    assert not (tmp_path / "demo").exists() and not list(tmp_path.glob(".tmp-*"))
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "stale").write_text("")  # an older layout without the marker
    build_once(tmp_path / "demo", lambda scratch: (scratch / "data").write_text("ok"))
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [COMPLETE, "data"]


def test_a_cache_under_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """RAPIDLITE_CACHE under a file (or unwritable): the run that needs the cache says so in one line, exit 2."""
    from rapidlite.cli.main import main
    from rapidlite.runtime.cache import CacheError, build_once, cache_root

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("RAPIDLITE_CACHE", str(blocker / "cache"))
    with pytest.raises(CacheError, match=r"cannot write the cache directory .*file/cache .*set RAPIDLITE_CACHE"):
        build_once(os.path.join(cache_root(), "thing"), lambda scratch: None)
    assert main(["--task", "sequence_classification", "--demo", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rapidlite: error: cannot write the cache directory "), err
    assert blocker.read_text() == "x"
