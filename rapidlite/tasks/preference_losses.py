"""The preference losses of ``--task dpo`` and ``--task kto``, and the per-sequence log-probabilities they read.

Each follows TRL's own code, term for term (TRL 1.16; its trainer named beside each), so that a run here and a
run there on the same batch give the same loss and metrics:

- ``sigmoid``, ``hinge``, ``ipo``, ``robust``: ``DPOTrainer._compute_loss``. ``sigmoid`` also takes
  ``--label-smoothing`` (conservative DPO, as TRL's sigmoid did before 1.0; at 0, TRL 1.16's).
- ``simpo``: ``CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` (length-averaged log-probabilities).
- ``orpo``: ``ORPOTrainer.odds_ratio_loss`` (length-averaged log-probabilities, the NLL of the chosen sequence).
- ``--rpo-alpha``: DPO 1.16's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, rpo_alpha]`` (TRL before
  1.0 called it ``rpo_alpha``).
- KTO: ``KTOTrainer._compute_loss`` (the batch's KL estimate from mismatched completions).

The per-token log-probabilities come from ``rapidlite.models.head.output_logps`` (the chunked output layer where
it serves the model, else the whole logits); ``sequence_sums`` adds them up per sequence.

A loss here is a sum over the batch's pairs (rows), to be divided by the pairs of the whole global batch, so
any split into micro-batches and ranks trains as one batch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sequence_sums(
    per_token: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, tokens)``, each ``[n]``: per sequence, the sum of ``per_token`` (``[rows, length]``, position t
    scoring token t+1: ``rapidlite.models.head.output_logps(shift=True)``'s layout) over its labelled targets
    (``labels`` ``[rows, length]``, -100: not scored), and how many there are. ``segments`` ``[rows, length]``:
    the sequence (0..n-1) each position belongs to (a row's index, or a packed row's sequence)."""
    mask = labels[:, 1:] != -100
    owner = segments[:, 1:][mask]
    sums = torch.zeros(n, dtype=torch.float32, device=per_token.device).index_add(0, owner, per_token[:, :-1][mask])
    tokens = torch.zeros(n, dtype=torch.int64, device=per_token.device).index_add(0, owner, torch.ones_like(owner))
    return sums, tokens


@dataclass
class PairScores:
    """Per pair ``[pairs]``: the policy's summed log-probabilities of the chosen and rejected responses, their
    token counts, and the reference's (None without one)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None

    @property
    def chosen_avg(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens.clamp(min=1)

    @property
    def rejected_avg(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens.clamp(min=1)


@dataclass
class PairLoss:
    """The per-pair loss ``[pairs]`` (its NLL term is added apart) and the rewards the metrics report."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: dict[str, torch.Tensor]  # per-pair values logged as their mean (ORPO's log odds)


def _smoothed_sigmoid(logits: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (TRL's ``log1mexp``)."""
    return torch.where(x > -0.693, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_loss(loss_type: str, s: PairScores, beta: float, label_smoothing: float, simpo_gamma: float) -> PairLoss:
    """The loss of each pair under ``loss_type`` (see the module's docstring for whose code each follows)."""
    if loss_type == "simpo":
        logits = s.chosen_avg - s.rejected_avg - simpo_gamma / beta
        losses = _smoothed_sigmoid(logits, beta, label_smoothing)
        return PairLoss(losses, beta * s.chosen_avg.detach(), beta * s.rejected_avg.detach(), {})
    if loss_type == "orpo":
        chosen, rejected = s.chosen_avg, s.rejected_avg
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        extra = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        return PairLoss(-beta * ratio, beta * chosen.detach(), beta * rejected.detach(), extra)
    chosen_ratio = s.chosen - s.ref_chosen
    rejected_ratio = s.rejected - s.ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid(delta, beta, label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        # Normalised by the completion lengths, as TRL does (confirmed with IPO's authors).
        avg = chosen_ratio / s.chosen_tokens.clamp(min=1) - rejected_ratio / s.rejected_tokens.clamp(min=1)
        losses = (avg - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"unknown preference loss {loss_type!r}")
    return PairLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), {})


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses, rewards)`` per completion ``[rows]``, TRL's ``KTOTrainer._compute_loss`` with ``loss_type="kto"``
    (eq. 7 of the KTO paper): a desirable completion's loss is ``1 - sigmoid(beta (ratio - kl))``, an undesirable
    one's ``1 - sigmoid(beta (kl - ratio))``, times its weight; the reward is ``beta ratio``. ``kl`` is the global
    batch's KL estimate, clamped at 0, a constant (no gradient)."""
    ratio = logps - ref_logps
    desirable_losses = 1 - torch.sigmoid(beta * (ratio - kl))
    undesirable_losses = 1 - torch.sigmoid(beta * (kl - ratio))
    losses = torch.where(desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses)
    return losses, beta * ratio.detach()
