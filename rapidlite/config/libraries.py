"""What a run imports beyond torch, transformers and rapidlite, in one list: a launcher that forks its workers
imports it once, and the planner imports it before it reads a CPU run's resident size."""

from __future__ import annotations

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TaskSpec


def run_libraries(settings: Sections, task: TaskSpec | None) -> tuple[str, ...]:
    """The task's libraries (``TaskSpec.libraries``), DeepSpeed under ``--deepspeed`` (about 150 MiB of a CPU
    rank's resident set) and bitsandbytes for an 8-bit optimizer or a quantised base."""
    names = list(task.libraries) if task is not None else []
    if settings.topology.deepspeed:
        names.append("deepspeed")
    if settings.optim.eight_bit or settings.lora.quantized:
        names.append("bitsandbytes")
    return tuple(names)
