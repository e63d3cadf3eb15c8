"""A rollout's tensors and its completion metrics, as TRL's ``GRPOTrainer._generate_and_score_completions`` makes
them: prompts left-padded, completions right-padded (each up to and including its first EOS), the masks of their
real tokens; with ``--mask-truncated-completions`` a completion cut at the length limit is masked whole (it
neither trains nor counts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """``prompt_ids``/``prompt_mask`` ``[N, P]`` (left-padded), ``completion_ids``/``completion_mask`` ``[N, C]``
    (right-padded), and per completion its length and whether it was cut at the limit (``truncated``)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, span] = torch.tensor(list(row), dtype=torch.long)
            mask[i, span] = 1
    return ids, mask


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    mask_truncated: bool = False,
) -> RolloutBatch:
    """The padded tensors of ``prompts[i]`` and ``completions[i]``. A completion is truncated when its last token
    is neither an EOS nor the pad token (TRL's rule)."""
    prompt_ids, prompt_mask = _pad(prompts, pad_token_id, left=True)
    completion_ids, completion_mask = _pad(completions, pad_token_id, left=False)
    ends = {*eos_token_ids, pad_token_id}
    truncated = torch.tensor([not c or c[-1] not in ends for c in completions], dtype=torch.bool)
    if mask_truncated:
        completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths, truncated)


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's ``completions/*`` metrics of a whole rollout (every rank's completions): the lengths' mean, min and
    max, the share cut at the limit (``clipped_ratio``), and the lengths of those that ended (0 when none did)."""
    lengths = lengths.double()
    ended = lengths[~truncated]
    if ended.numel() == 0:
        ended = torch.zeros(1, dtype=torch.float64)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.double().mean()),
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
    }
