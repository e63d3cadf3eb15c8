"""``--task causal_lm``'s declaration and options (torch-free; the trainer is ``causal_lm.py``).

The prompt and chat templates, ``--packing`` and ``--eval-generate`` are shared (``TaskConfig``): other tasks read
them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class CausalLmOptions:
    """The columns of prompt/response data and whether the prompt trains."""

    prompt_key: str | None = flag(None, "causal_lm: the prompt column of prompt/response data")
    response_key: str | None = flag(None, "causal_lm: the response column of prompt/response data")
    train_on_prompt: bool = flag(False, "causal_lm: the prompt tokens train too")


def check_split_sequences(settings: Sections) -> None:
    """Context parallelism splits training and evaluation batches; what runs whole sequences through the model
    (greedy generation, the harness) or packs a micro-batch into one row its own way does not split yet (the
    causal LM tasks' shared rule)."""
    cp = settings.topology.cp
    if cp <= 1:
        return
    for given, flag_name in (
        (settings.task.eval_generate, "--eval-generate"),
        (settings.task.eval_harness, "--eval-harness"),
        (settings.data.padding_free, "--padding-free"),
    ):
        if given:
            raise ConfigError(
                f"--context-parallel-size {cp} with {flag_name}: not built for split sequences yet; drop {flag_name}"
                + (" (--packing packs rows that context parallelism splits)" if flag_name == "--padding-free" else "")
            )


TASK = TaskSpec(
    name="causal_lm",
    summary="fine-tune AutoModelForCausalLM on instructions, prompt/response pairs, chats or text",
    trainer="rapidlite.tasks.causal_lm:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=CausalLmOptions,
    demo="rapidlite.tasks.causal_lm_demo:demo",
    named_demos={"vision": "rapidlite.tasks.vision_demo:demo"},
    defaults={"seq_length": 512},
    load_model_dir=True,
    eval_only=True,
    auto_class="AutoModelForCausalLM",
    chunked_loss="sum",
    eval_harness=True,
    streaming=True,
    check=check_split_sequences,
    context_parallel=True,
    images=True,
)
