"""What a CPU rank's resident set holds beyond its tensors: the plan's "runtime" column.

A CPU run's logged peak is its process's resident set (``VmHWM``), which also holds the interpreter, torch,
transformers and the libraries the run imports (``config.libraries.run_libraries``). The planner has imported the
same, and loads the tokenizer a run that tokenises its data loads, so it reads its own resident set.

Part of that set is file-backed (the libraries' code, mapped from disk), and how much of it a process holds depends
on the page cache. A rank forked by rapidlite's launcher (``--start-method auto`` on a machine without CUDA) maps the
code again as it runs it: measured at a forked rank's peak, about 128 MiB right after the install (close to the
launcher's and this process's own), 52-80 MiB in an environment whose files had been partly evicted. The plan counts
this process's, which follows the same cache (``docs/guides/dry-run.md``).
"""

from __future__ import annotations

import contextlib
import importlib
import resource
import sys
from typing import Any

from rapidlite.config.libraries import run_libraries
from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TaskSpec
from rapidlite.runtime.allocator import release_freed


def runtime_bytes(settings: Sections, task: TaskSpec | None) -> int:
    """A CPU rank's resident bytes before its tensors (see the module docstring)."""
    libraries = run_libraries(settings, task)
    for name in libraries:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    tokenizer = _run_tokenizer(settings, libraries)  # held while the resident set is read
    release_freed()  # as the run does before its first step (rapidlite.runtime.allocator)
    resident = resident_bytes()
    del tokenizer
    return resident


def _run_tokenizer(settings: Sections, libraries: tuple[str, ...]) -> Any:
    """The tokenizer a run that tokenises its data loads, which every rank holds (its vocabulary and merges: 17
    MiB at 64k words); None where the run loads none or it cannot be loaded here (the run's own load says why)."""
    name = settings.model.pretrained_model_name_or_path
    if "datasets" not in libraries or not name:
        return None
    from rapidlite.models.hf import load_tokenizer

    try:
        return load_tokenizer(name)
    except Exception:  # a missing or unreadable tokenizer is the run's one line, not the plan's
        return None


def resident_bytes() -> int:
    """This process's resident set now (Linux: /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024
