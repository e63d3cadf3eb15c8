"""build_once: what rapidlite builds into its cache (embedded demos) is built once, whole, by racing ranks."""

from __future__ import annotations

import threading
import time

import pytest

from rapidlite.cache import COMPLETE, build_once


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
