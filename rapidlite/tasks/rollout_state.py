"""What online RL keeps between the steps of one rollout (``Rollout``: every rank holds the whole of it, so a
checkpoint keeps it and a resumed run, on any layout, trains on what was sampled), and the reward functions a
white-box script provides, made ``RewardFunction``s."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.errors import DataError
from rapidlite.evaluation.metrics import MeanMetrics
from rapidlite.generation.rollout import RolloutBatch
from rapidlite.tasks.rewards import RewardFunction, load_reward_functions


def completion_logps(
    model: Any, batch: dict[str, torch.Tensor], chunked: bool, temperature: float, cp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability ``[B, C]`` in a rollout batch (``batch_of``: left-padded prompts,
    right-padded completions) at the sampling ``temperature``, and its entropy. Under context parallelism
    (``cp_group``) each rank scores its shard of every row and the values are gathered whole; the left padding
    restarts the positions, so no real token attends it there either."""
    from rapidlite.models.head import output_logps
    from rapidlite.parallel.context_parallel import split_output_logps

    width = batch["completion_mask"].shape[1]
    prompt_width = batch["input_ids"].shape[1] - width
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, :prompt_width] = -100
    if cp_group is not None:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        logps, (entropy, _) = split_output_logps(model, inputs, labels, cp_group, chunked, True, temperature)
    else:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logps, (entropy, _) = output_logps(
            model, {**inputs, "use_cache": False}, labels, shift=True, chunked=chunked, stats=True,
            temperature=temperature,
        )  # fmt: skip
    # With shift, position t scores token t + 1: the completion's tokens are scored one position earlier.
    span = slice(prompt_width - 1, prompt_width - 1 + width)
    return logps[:, span], entropy[:, span]


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


def gather_ids(engine: Any, ids: list[list[int]], width: int) -> list[list[int]]:
    """Every data-parallel rank's token lists (each at most ``width`` long), in rank order."""
    padded = torch.full((len(ids), width + 1), -1, dtype=torch.long)
    for row, seq in enumerate(ids):
        padded[row, 0] = len(seq)
        padded[row, 1 : 1 + len(seq)] = torch.tensor(seq, dtype=torch.long)
    whole = engine.dist.all_gather(padded.to(engine.device)).cpu()
    return [r[1 : 1 + int(r[0])].tolist() for r in whole]


def reduced_metrics(engine: Any, logged: MeanMetrics) -> dict[str, float]:
    """What the reward functions logged (``log_metric``) on every rank, as means over the ranks' values: the
    names are agreed first, since a function may log a name on some ranks only."""
    names = set(logged.sums)
    if engine.dp_size > 1:
        import torch.distributed as dist

        everyone: list[Any] = [None] * engine.dp_size
        dist.all_gather_object(everyone, sorted(names), group=engine.dist.dp_group)
        names = set().union(*everyone)
    if not names:
        return {}
    for name in names - set(logged.sums):
        logged.add(name, 0.0, 0.0)
    return logged.means(engine.all_reduce_sum(logged.vector().to(engine.device)).cpu())


COMPLETIONS_FILE = "completions.jsonl"


def completion_row(step, rollout, prompt, text, tokens, rewards: torch.Tensor, weights, names) -> dict[str, Any]:
    """One line of ``completions.jsonl``: a completion, its prompt and its rewards (each function's, None where it
    gave none, and their weighted sum)."""
    values = [v if v == v else None for v in rewards.tolist()]  # NaN: no reward from that function
    total = sum(w * v for w, v in zip(weights.tolist(), values, strict=True) if v is not None)
    return {
        "iteration": step, "rollout": rollout, "prompt": prompt.prompt, "completion": text, "tokens": tokens,
        "reward": total, "rewards": dict(zip(names, values, strict=True)),
    }  # fmt: skip


def write_completions(engine: Any, save: str | None, trackers: Any, rows: list[dict[str, Any]], step: int) -> None:
    """Every rank's ``rows`` (in rank order) appended to ``save``'s ``completions.jsonl`` by the main process, and
    logged as a table to the trackers that keep tables (W&B)."""
    if engine.dp_size > 1:
        import torch.distributed as dist

        everyone: list[Any] = [None] * engine.dp_size
        dist.all_gather_object(everyone, rows, group=engine.dist.dp_group)
        rows = [row for part in everyone for row in part]
    if not engine.is_main_process:
        return
    if save is not None:
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, COMPLETIONS_FILE), "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    trackers.log_table("completions", rows, step)
