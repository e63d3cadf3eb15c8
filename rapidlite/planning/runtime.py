"""What a CPU rank's resident set holds beyond its tensors: the plan's "runtime" column.

A CPU run's logged peak is its process's resident set (``VmHWM``), which also holds the interpreter, torch,
transformers and the libraries the run imports (``config.libraries.run_libraries``). The planner has imported the
same, and loads the tokenizer a run that tokenises its data loads, so it reads its own resident set, in two parts
(``/proc/self/status``):

- **anonymous pages** (the interpreter's and the libraries' objects): every rank has them; a rank forked from the
  launcher inherits the launcher's, which imported the same list, and counts them as its own;
- **file-backed pages** (the libraries' code and data, mapped from disk): a process that imports a library touches
  its pages as it loads it, so one process, or a rank started as a new interpreter (``--start-method spawn``,
  torchrun or Slurm starting each rank), holds what importing touched. A rank forked by rapidlite's launcher
  (``--start-method auto`` on a machine without CUDA) maps the code again only as it runs it: its file-backed pages
  are the code a training rank runs, measured at the peak of forked ranks here (``docs/guides/dry-run.md``): 57-58
  MiB in pretraining ranks (torch's kernels, the interpreter, gloo), 66-80 MiB in ranks that read their data
  through datasets (pyarrow's and the tokenizer's code besides). The planner's own were 89-152 MiB.
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

MiB = 2**20
FORKED_RANK_CODE = 58 * MiB  # the code a forked training rank runs: torch's kernels, the interpreter, gloo
FORKED_DATA_CODE = 16 * MiB  # and, reading its data through datasets, pyarrow's and the tokenizer's


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
    if not forked_ranks(settings):
        return anonymous + file_backed
    code = FORKED_RANK_CODE + (FORKED_DATA_CODE if "datasets" in libraries else 0)
    return anonymous + min(file_backed, code)


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


def forked_ranks(settings: Sections) -> bool:
    """Whether the run's ranks are forked from rapidlite's launcher: it launches them (more than one process, not
    already a launched worker) and forks (``--start-method``)."""
    from rapidlite.runtime.forked_workers import fork_workers
    from rapidlite.runtime.launcher import needs_launch

    return needs_launch(settings.parallel) and fork_workers(settings.parallel.start_method)


def resident_parts() -> tuple[int, int]:
    """This process's resident (anonymous, file-backed) bytes now; off Linux, the peak so far as anonymous."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return tuple(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile"))  # type: ignore[return-value]
    except (OSError, KeyError, ValueError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (rss if sys.platform == "darwin" else rss * 1024), 0
