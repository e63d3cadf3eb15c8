"""What a run imports beyond torch, transformers and rapidlite, in one list: a launcher that forks its workers
imports it once, and the planner imports it before it reads a CPU rank's own memory (its runtime)."""

from __future__ import annotations

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TaskSpec

# DeepSpeed, and what its engine imports when it checks the optimizer it is given (0.19 here: a Muon optimizer
# compiled by torch's compiler, which brings networkx, sympy and inductor: about 45 MiB of a CPU rank).
DEEPSPEED_LIBRARIES = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")


def run_libraries(settings: Sections, task: TaskSpec | None) -> tuple[str, ...]:
    """The task's libraries (``TaskSpec.libraries``), DeepSpeed under ``--deepspeed`` (about 200 MiB of a CPU
    rank's resident set, file-backed pages included) and bitsandbytes for an 8-bit optimizer or a quantised base."""
    names = list(task.libraries) if task is not None else []
    if settings.topology.deepspeed:
        names += DEEPSPEED_LIBRARIES
    if settings.optim.eight_bit or settings.lora.quantized:
        names.append("bitsandbytes")
    return tuple(names)
