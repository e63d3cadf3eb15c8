"""Host memory a CPU run gives back: glibc's malloc, which torch's CPU allocator calls, is set once per process so
that freed tensors of ``MMAP_THRESHOLD`` bytes or more go back to the system.

glibc's default mmap threshold is dynamic. It starts at 128 KiB, and each time a block served by ``mmap`` is freed
it rises to that block's size, up to 32 MiB. After a training step's first large free, nearly every tensor comes
from the heap instead, and the heap keeps what is freed in holes a later, larger tensor does not fit. Measured
here, a CPU run's resident peak then sits 10-45% above its live tensors and grows over its first steps, so
``--dry-run``'s plan could not be right on a CPU. Fixed at 4 MiB, the resident peak follows the live tensors (one
test run: 1,586 MiB with the dynamic threshold, 1,137 MiB fixed). The cost is the page faults of each large
tensor's fresh pages: steps were 2-17% slower on this project's CPU benchmarks (``benchmarks/cpu_allocator.py``
measures it against the default in one run).

``RAPIDLITE_DEFAULT_MALLOC=1`` keeps glibc's dynamic threshold (the faster steps, with its retention). A user's own
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``MALLOC_MMAP_MAX_`` (each turns the
dynamic threshold off too) is left as set. GPU runs keep glibc's default; their plan is device memory.

Below the threshold the heap keeps holes between freed tensors, which ``--dry-run`` does not count. glibc before
2.39 keeps more: torch allocates with ``posix_memalign``, whose split-off remainders went to glibc's per-thread
caches and fast bins, where they keep a freed block from merging with its neighbours, so a later block of the same
size does not fit it (glibc bug 30723, fixed in 2.39: ``COMPACT_MEMALIGN``). Measured on the dry-run sweep's 40
draws, the median draw's holes were 24 MiB under glibc 2.36 and 18.5 MiB under 2.41 (``docs/guides/dry-run.md``);
a CPU plan names a glibc before 2.39 (``glibc_version``).

What a run frees while it prepares (tokenising its data, loading its model) stays in glibc's heap until something
reuses it; ``release_freed`` gives it back (``malloc_trim``) right before the first step: 35-55 MiB of a
fine-tuning rank's resident peak here. Arrow's memory pool (mimalloc in pyarrow's wheels), which holds what
datasets' tables and tokenisation freed, keeps it too: ``release_freed`` empties it as well (6-10 MiB of a
question-answering rank's on small files; 94 MiB of Arrow buffers made and dropped kept 125 MiB resident until then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from rapidlite.runtime.environ import env_switch

MMAP_THRESHOLD = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
COMPACT_MEMALIGN = (2, 39)  # the first glibc whose posix_memalign remainders merge (bug 30723)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_done = False


def _libc() -> ctypes.CDLL | None:
    """glibc (Linux), where this process's malloc is glibc's; None elsewhere or where the environment keeps glibc's
    own behaviour (``RAPIDLITE_DEFAULT_MALLOC=1``)."""
    if not sys.platform.startswith("linux") or env_switch("RAPIDLITE_DEFAULT_MALLOC"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (musl and other libcs have neither)
    except (OSError, AttributeError):
        return None
    return libc


def glibc_version() -> tuple[int, int] | None:
    """This process's glibc as ``(major, minor)``; None where the C library is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):  # no confstr, no such name, or another C library's answer
        return None


def bound_cpu_retention() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` in this process (and the processes it forks), once; False
    where it is not glibc's malloc or the environment sets glibc's own (see the module docstring)."""
    global _done
    if _done:
        return True
    libc = _libc()
    if libc is None or any(name in os.environ for name in USER_SETTINGS):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return _done


def release_freed() -> bool:
    """Give the system back the heap pages nothing holds (glibc's ``malloc_trim(0)``): what preparing the run freed
    (the data's tokenisation, the model's loading), which glibc would keep until a later allocation reused it; and
    what Arrow's memory pool keeps of the same, where pyarrow is imported (whatever the malloc). False where the
    malloc is not glibc's or ``RAPIDLITE_DEFAULT_MALLOC=1`` is set."""
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    libc.malloc_trim(0)
    return True
