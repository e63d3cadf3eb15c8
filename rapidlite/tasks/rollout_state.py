"""What online RL keeps between the steps of one rollout (``Rollout``: every rank holds the whole of it, so a
checkpoint keeps it and a resumed run, on any layout, trains on what was sampled), and the reward functions a
white-box script provides, made ``RewardFunction``s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.errors import DataError
from rapidlite.generation.rollout import RolloutBatch
from rapidlite.tasks.rewards import RewardFunction, load_reward_functions


@dataclass
class Rollout:
    """One rollout, whole (every rank holds all of it): per completion its prompt and completion tokens, advantage
    and, where the loss needs them, the rollout policy's and the reference's log-probabilities ``[N, C]``."""

    index: int
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollout:
        return cls(**state)


def as_reward_functions(provided: Sequence[Any]) -> list[RewardFunction]:
    """What ``reward_functions_provider`` returned: loaded ``RewardFunction``s, SPEC strings or plain callables
    (TRL's signature), as ``RewardFunction``s."""
    out = []
    for item in provided:
        if isinstance(item, RewardFunction):
            out.append(item)
        elif isinstance(item, str):
            out += load_reward_functions([item])
        elif callable(item):
            name = getattr(item, "__name__", type(item).__name__)
            out.append(RewardFunction(name, name, item, getattr(getattr(item, "__code__", None), "co_filename", None)))
        else:
            raise DataError(
                f"reward_functions_provider returned {item!r}: return callables f(prompts, completions, "
                "completion_ids, **kwargs), or --reward-funcs SPEC strings"
            )
    if not out:
        raise DataError("reward_functions_provider returned no reward function; return at least one")
    return out


def real_tokens(padded: RolloutBatch) -> torch.Tensor:
    """The completion tokens that are real (up to each completion's length), whatever the loss masks."""
    width = padded.completion_ids.shape[1]
    return (torch.arange(width)[None, :] < padded.lengths[:, None]).long()
