"""``--task causal_lm``'s declaration and options (torch-free; the trainer is ``causal_lm.py``).

The prompt and chat templates, ``--packing`` and ``--eval-generate`` are shared (``TaskConfig``): other tasks read
them too."""

from __future__ import annotations

from dataclasses import dataclass

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec


@dataclass(frozen=True)
class CausalLmOptions:
    """The columns of prompt/response data and whether the prompt trains."""

    prompt_key: str | None = flag(None, "causal_lm: the prompt column of prompt/response data")
    response_key: str | None = flag(None, "causal_lm: the response column of prompt/response data")
    train_on_prompt: bool = flag(False, "causal_lm: the prompt tokens train too")


TASK = TaskSpec(
    name="causal_lm",
    summary="fine-tune AutoModelForCausalLM on instructions, prompt/response pairs, chats or text",
    trainer="rapidlite.tasks.causal_lm:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=CausalLmOptions,
    demo="rapidlite.tasks.causal_lm_demo:demo",
    defaults={"seq_length": 512},
    load_model_dir=True,
    eval_only=True,
    auto_class="AutoModelForCausalLM",
    chunked_loss="sum",
    eval_harness=True,
    streaming=True,
)
