"""A CPU run fixes glibc's mmap threshold (rapidlite.runtime.allocator): freed large tensors go back to the system
instead of raising the threshold and staying in the heap."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# After one 5 MiB tensor is freed, glibc's dynamic threshold rises to 5 MiB and serves the next one from the heap
# (mallinfo2's mapped blocks do not grow); with the threshold fixed it is mapped on its own (one more) and
# unmapped when freed.
PROBE = """
import ctypes, sys
import torch
from rapidlite.runtime import allocator
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                                "keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "init":
    from rapidlite.config.runtime import ParallelConfig
    from rapidlite.config.topology import Topology
    from rapidlite.runtime.distributed import init_distributed
    init_distributed(Topology(), ParallelConfig())
    fixed = allocator._done
else:
    fixed = allocator.bound_cpu_retention()
a = torch.ones(5 * 2**18)
del a
before = libc.mallinfo2().hblks
b = torch.ones(5 * 2**18)
print(fixed, libc.mallinfo2().hblks - before)
"""


def _probe(how: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RAPIDLITE_DEFAULT_MALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how], capture_output=True, text=True, env={**environ, **env}, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_threshold_fixed_returns_freed_blocks():
    assert _probe("call") == ("True", 1)


def test_a_cpu_process_group_fixes_it():
    assert _probe("init") == ("True", 1)


@pytest.mark.parametrize("env", [{"RAPIDLITE_DEFAULT_MALLOC": "1"}, {"MALLOC_TOP_PAD_": "0"}])
def test_the_users_setting_is_kept(env):
    fixed, mapped = _probe("call", **env)
    assert fixed == "False"
    # glibc's dynamic threshold (RAPIDLITE_DEFAULT_MALLOC) serves the second block from the heap; the user's own
    # MALLOC_* setting fixes glibc's default threshold (128 KiB), which maps it
    assert mapped == (0 if "RAPIDLITE_DEFAULT_MALLOC" in env else 1)


# A heap of small blocks, every other one freed: glibc keeps the freed ones (their neighbours pin the heap's top),
# and malloc_trim gives their pages back. Resident anonymous bytes before and after release_freed().
TRIM_PROBE = """
import ctypes, sys
from rapidlite.runtime import allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)
def anon():
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1]) * 1024
blocks = [libc.malloc(64 * 1024) for _ in range(1600)]  # 100 MiB of heap blocks (under the mmap threshold)
for b in blocks:
    libc.memset(b, 1, 64 * 1024)
for b in blocks[::2]:
    libc.free(b)
before = anon()
released = allocator.release_freed()
print(released, (before - anon()) // 2**20)
"""


def _trim(**env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RAPIDLITE_DEFAULT_MALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, env={**environ, **env}, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_release_freed_gives_back_what_the_heap_kept():
    released, mib = _trim()
    assert released == "True"
    assert mib >= 40  # the 50 MiB freed, less what glibc keeps in its bins' headers


def test_release_freed_keeps_glibcs_own_behaviour_when_asked():
    released, mib = _trim(RAPIDLITE_DEFAULT_MALLOC="1")
    assert released == "False" and abs(mib) <= 2  # nothing given back (a page or two of noise)


# Arrow buffers made and dropped (32 KiB each, 94 MiB): pyarrow's pool keeps their pages, and release_freed() empties
# it. Own bytes (anonymous and shared) before and after; glibc's trim is off (RAPIDLITE_DEFAULT_MALLOC), so what is
# given back is the pool's.
ARROW_PROBE = """
import gc, sys
import pyarrow as pa, pyarrow.compute as pc
from rapidlite.observe.logging import process_memory
from rapidlite.runtime import allocator
base = pa.array(range(4096))
buffers = [pc.add(base, i) for i in range(3000)]
del buffers
gc.collect()
before = process_memory()["own"]
allocator.release_freed()
print((before - process_memory()["own"]) // 2**20)
"""


def test_release_freed_empties_arrows_pool():
    pytest.importorskip("pyarrow")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", ARROW_PROBE], capture_output=True, text=True, check=True,
        env={**env, "RAPIDLITE_DEFAULT_MALLOC": "1"},
    ).stdout  # fmt: skip
    assert int(out) >= 60, out  # of the 94 MiB the buffers held


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("glibc 2.36", (2, 36)), ("glibc 2.41", (2, 41)), ("glibc 2.39.9000", (2, 39)), ("musl 1.2", None), (None, None)],
)
def test_glibc_version_reads_the_c_librarys_answer(monkeypatch, answer, expected):
    from rapidlite.runtime import allocator

    def confstr(name):
        if answer is None:
            raise ValueError("unrecognized configuration name")
        return answer

    monkeypatch.setattr(allocator.os, "confstr", confstr)
    assert allocator.glibc_version() == expected
