"""What a CPU rank's resident set holds beyond its tensors: the plan's "runtime" column.

A CPU run's logged peak is its process's resident set (``VmHWM``), which also holds the interpreter, torch,
transformers and the libraries the run imports (``config.libraries.run_libraries``). The planner has imported the
same, and loads the tokenizer a run that tokenises its data loads, so it reads its own resident set, in two parts
(``/proc/self/status``):

- **anonymous pages** (the interpreter's and the libraries' objects): every rank has them; a rank forked from the
  launcher inherits the launcher's, which imported the same list, and counts them as its own;
- **file-backed pages** (the libraries' code and data, mapped from disk). A rank forked by rapidlite's launcher
  (``--start-method auto`` on a machine without CUDA) maps the code again as it runs it, and how many pages each
  fault maps depends on how much of the libraries' files the page cache holds: measured at a forked rank's peak,
  about 128 MiB right after the install (close to the launcher's and this process's own) but 52-80 MiB in an
  environment whose files had been partly evicted. The plan counts this process's, which follows the same cache.
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
    anonymous, file_backed = resident_parts()
    del tokenizer
    return anonymous + file_backed


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


def resident_parts() -> tuple[int, int]:
    """This process's resident (anonymous, file-backed) bytes now; off Linux, the peak so far as anonymous."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return tuple(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile"))  # type: ignore[return-value]
    except (OSError, KeyError, ValueError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (rss if sys.platform == "darwin" else rss * 1024), 0
