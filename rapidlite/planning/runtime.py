"""What a CPU rank holds beyond its tensors: the plan's "runtime" column.

A CPU run's logged peak is its process's own memory (``rapidlite.observe.logging.process_memory``: anonymous and
shared pages, without the libraries' file-backed ones), which also holds the interpreter, torch, transformers and
the libraries the run imports (``config.libraries.run_libraries``). The planner has imported the same, and loads the
tokenizer a run that tokenises its data loads, so it reads its own.

A rank forked by rapidlite's launcher (``--start-method auto`` on a machine without CUDA) holds the launcher's
anonymous pages as its own (copy-on-write pages count in each process that maps them), and the launcher has imported
the same libraries. The file-backed pages are left out on both sides: how many a process maps depends on the page
cache (``docs/guides/dry-run.md``), not on the run.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from rapidlite.config.libraries import run_libraries
from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TaskSpec
from rapidlite.observe.logging import process_memory
from rapidlite.runtime.allocator import release_freed


def runtime_bytes(settings: Sections, task: TaskSpec | None) -> int:
    """A CPU rank's own bytes before its tensors (see the module docstring)."""
    libraries = run_libraries(settings, task)
    for name in libraries:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    tokenizer = _run_tokenizer(settings, libraries)  # held while its memory is read
    release_freed()  # as the run does before its first step (rapidlite.runtime.allocator)
    own = process_memory()["own"]
    del tokenizer
    return own


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
