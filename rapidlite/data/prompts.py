"""Prompts for online RL (``--task grpo``, ``--task rloo``), in TRL's dataset layout.

A row has a ``prompt``: text, or a conversation (a list of ``{"role", "content"}`` messages, or JSON text of one,
as a CSV holds it) rendered by the chat template with its generation prompt. Its ids are made as TRL's
``GRPOTrainer._tokenize_prompts`` makes them: the tokenizer on text (with its special tokens), the chat template on
a conversation. Every other column is handed, as it is, to the reward functions (an ``answer`` to check against).
``--max-prompt-length`` keeps a prompt's end, where the question and the generation prompt are, and the rows cut
are counted in the data line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rapidlite.data.preference import Encoder, as_conversation
from rapidlite.errors import DataError

PROMPT_LAYOUT = "a prompt column (text, or conversation messages); every other column goes to the reward functions"


@dataclass
class Prompt:
    """One row: its prompt as the reward functions receive it (text, or the messages), its token ids, and its
    other columns."""

    prompt: Any
    ids: list[int]
    columns: dict[str, Any]


@dataclass
class PromptCounts:
    rows: int = 0
    cut: int = 0  # prompts whose start was cut to --max-prompt-length
    conversations: int = 0

    def describe(self, max_prompt_length: int | None) -> str:
        kind = "conversations" if self.conversations == self.rows else "texts" if not self.conversations else "mixed"
        cut = f", {self.cut} cut to their last {max_prompt_length} tokens" if max_prompt_length else ""
        return f"{self.rows} prompts ({kind}{cut})"


def check_layout(columns: Sequence[str]) -> None:
    if "prompt" not in columns:
        raise DataError(
            f"online RL data needs {PROMPT_LAYOUT}; the data has {', '.join(columns) or 'no columns'}: rename the "
            "prompt column to 'prompt'"
        )


def read_prompts(
    rows: Sequence[Mapping[str, Any]], tokenizer: Any, max_prompt_length: int | None
) -> tuple[list[Prompt], PromptCounts]:
    """Every row's ``Prompt`` (see the module's docstring) and the counts the data line reports. A row without a
    prompt is one line naming it."""
    encoder = Encoder(tokenizer)
    counts = PromptCounts()
    out = []
    for index, row in enumerate(rows):
        value = row.get("prompt")
        messages = as_conversation(value)
        if messages is None and (value is None or not str(value).strip()):
            raise DataError(f"row {index} has an empty prompt; every row needs one ({PROMPT_LAYOUT})")
        prompt = messages if messages is not None else str(value)
        ids = encoder.ids(prompt, generation_prompt=True)
        if max_prompt_length and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
            counts.cut += 1
        counts.rows += 1
        counts.conversations += messages is not None
        out.append(Prompt(prompt, ids, {k: v for k, v in row.items() if k != "prompt"}))
    return out, counts
