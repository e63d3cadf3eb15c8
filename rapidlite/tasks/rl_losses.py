"""The online-RL losses of ``--task grpo`` (GRPO, DAPO, Dr. GRPO, BNPO; GSPO's sequence-level ratios) and
``--task rloo``: advantages from rewards, the clipped policy-gradient loss and its metrics.

Each follows TRL's own code term for term (TRL 1.16), so a batch scored here and there gives the same numbers:

- ``group_advantages``: ``GRPOTrainer._generate_and_score_completions`` (``multi_objective_aggregation=
  "sum_then_normalize"``, its default): weighted rewards, the group's mean as the baseline, divided by the group's
  or the batch's standard deviation (``--scale-rewards``); a completion no reward function scored has none.
- ``rloo_advantages``: ``RLOOTrainer``'s leave-one-out baseline (each completion against the mean of the others
  of its prompt).
- ``policy_terms`` and ``loss_numerator``: ``GRPOTrainer._compute_loss`` (token- or sequence-level importance
  ratios, the clip at ``1 - epsilon`` and ``1 + epsilon_high``, ``--delta``'s two-sided clip, the k3 KL estimate
  against the reference at ``--beta``).

A loss here is a sum over a micro-batch's completions, to be divided by ``loss_denominator`` of the whole global
batch, so that any split into micro-batches and ranks trains as one batch does. TRL's normalisers are those of
one micro-batch; they agree with these wherever the step is one micro-batch on one process (the case the tests
compare), and for ``grpo``, ``dr_grpo`` and ``dapo`` wherever the micro-batches are equal. ``bnpo`` is by
definition a mean over each micro-batch's tokens (TRL's): its step averages those means, so its value depends on
the micro-batch size, as TRL's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
# TRL adds this to the standard deviation it divides by.
STD_EPSILON = 1e-4


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel's correction) of the values that are not NaN; NaN for fewer than two."""
    keep = ~torch.isnan(x)
    count = keep.sum(dim) if dim is not None else keep.sum()
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, float("nan")))
    return (variance * correction).sqrt()


@dataclass
class Advantages:
    """Per completion ``[N]``: its advantage, its weighted reward (NaN where no function scored it) and whether its
    group's (or the batch's) rewards had zero spread; per reward function ``[F]``: the mean and spread of its
    rewards over the completions it scored."""

    advantages: torch.Tensor
    rewards: torch.Tensor
    zero_std: torch.Tensor
    function_means: torch.Tensor
    function_stds: torch.Tensor

    def metrics(self, names: list[str]) -> dict[str, float]:
        """TRL's names: ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``rewards/<name>/mean`` and ``/std``."""
        out = {
            "reward": float(torch.nanmean(self.rewards)),
            "reward_std": float(nanstd(self.rewards)),
            "frac_reward_zero_std": float(self.zero_std.float().mean()),
        }
        for i, name in enumerate(names):
            out[f"rewards/{name}/mean"] = float(self.function_means[i])
            out[f"rewards/{name}/std"] = float(self.function_stds[i])
        return out


def _weighted(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum over the functions that scored each completion (NaN: none did) and that "none did" mask."""
    unscored = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(unscored, float("nan")), unscored


def _function_stats(rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    columns = rewards_per_func.unbind(1)
    return torch.stack([torch.nanmean(c) for c in columns]), torch.stack([nanstd(c) for c in columns])


def group_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str
) -> Advantages:
    """GRPO's advantages for the completions of whole prompt groups (``[N, F]`` rewards, a group's
    ``num_generations`` completions consecutive; NaN: that function gave no reward): the weighted reward minus
    its group's mean, divided by the group's (``group``) or the whole batch's (``batch``) standard deviation plus
    1e-4, or not divided (``none``). A completion no function scored is left out of its group's mean and gets 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}: choose one of {SCALE_REWARDS}")
    rewards, _ = _weighted(rewards_per_func, weights)
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    means, stds = _function_stats(rewards_per_func)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, zero_std, means, stds)


def rloo_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    normalize: bool,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_range: tuple[float, float] | None = None,
) -> Advantages:
    """RLOO's advantages: each completion's weighted reward (clipped to ``clip_range``; minus ``beta`` times its
    summed KL estimate ``kl`` ``[N]``, the rollout policy's log-probabilities minus the reference's) minus the
    mean of the other scored completions of its prompt (``num_generations`` consecutive); with ``normalize``,
    standardised over the batch (plus 1e-4). A completion no function scored, or the only one scored in its
    group, gets 0."""
    rewards, unscored = _weighted(rewards_per_func, weights)
    logged = rewards.clone()
    if clip_range is not None:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    if beta != 0.0:
        if kl is None:
            raise ValueError("beta is not 0: the completions' KL estimates are needed")
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, num_generations)
    if num_generations > 1:
        std = nanstd(grouped, dim=1)
        scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
        advantages = rewards - baselines.flatten()
    else:
        std = torch.zeros(grouped.shape[0], dtype=rewards.dtype, device=rewards.device)
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    means, stds = _function_stats(rewards_per_func)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), logged, zero_std, means, stds)


def rloo_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
) -> PolicyTerms:
    """RLOO's clipped surrogate per completion (``RLOOTrainer._compute_loss``): the ratio of the summed
    log-probabilities of its tokens (``[B, T]``, ``mask``) to the rollout policy's (``old_logps`` ``[B]``, summed;
    None: this policy). ``per_token_loss`` is ``[B, 1]``: one value per completion; the loss is their sum divided
    by the completions of the global batch (``loss_denominator("grpo", ...)``)."""
    high = epsilon if epsilon_high is None else epsilon_high
    summed = (logps * mask.to(logps.dtype)).sum(1)
    old = summed.detach() if old_logps is None else old_logps
    ratio = torch.exp(summed - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high_clipped = (ratio > 1 + high) & (advantages > 0)
    return PolicyTerms(loss.unsqueeze(1), None, ratio.unsqueeze(1), low.unsqueeze(1), high_clipped.unsqueeze(1))


@dataclass(frozen=True)
class ClipSettings:
    """``--loss-type``, ``--importance-sampling-level``, ``--epsilon``, ``--epsilon-high`` (None: ``--epsilon``),
    ``--delta``, ``--beta`` and ``--use-bias-correction-kl`` (the KL estimate times the importance ratio, so that its
    gradient is the reverse KL's; TRL's default since DeepSeek-V3.2), TRL's names and defaults."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    bias_correction_kl: bool = True

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class PolicyTerms:
    """The per-token loss ``[B, T]`` (the KL term included; padding not yet masked), the per-token KL estimate
    (None at beta 0), the importance ratios (``[B, T]`` token-level, ``[B, 1]`` sequence-level) and where they were
    clipped below, above, or either."""

    per_token_loss: torch.Tensor
    per_token_kl: torch.Tensor | None
    ratios: torch.Tensor
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor

    @property
    def region_clipped(self) -> torch.Tensor:
        return self.low_clipped | self.high_clipped


def policy_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: ClipSettings,
) -> PolicyTerms:
    """The clipped surrogate of each completion token (``logps``, ``old_logps``, ``ref_logps``, ``mask``:
    ``[B, T]``; ``advantages``: ``[B]``). ``old_logps`` None: the rollout's policy is this one (one optimizer step
    per rollout), so the ratio is 1 with this step's gradient."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    mask = mask.to(logps.dtype)
    if clip.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, its tokens' mean
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif clip.importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level {clip.importance_sampling_level!r}: choose token or sequence")
    ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - clip.epsilon, 1 + clip.high)
    unclipped = ratio if clip.delta is None else torch.clamp(ratio, max=clip.delta)
    per_token_loss = -torch.min(unclipped * advantages, clipped * advantages)
    kl = None
    if clip.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta is not 0: the reference's log-probabilities are needed")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if clip.bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + clip.beta * kl
    low = (ratio < 1 - clip.epsilon) & (advantages < 0)
    high = (ratio > 1 + clip.high) & (advantages > 0)
    return PolicyTerms(per_token_loss, kl, ratio, low, high)


def loss_numerator(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """A micro-batch's share of the loss before ``loss_denominator``: ``grpo`` each completion's mean over its
    tokens, summed; ``dapo`` and ``dr_grpo`` the sum over every token; ``bnpo`` the mean over the micro-batch's
    tokens."""
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in ("dapo", "dr_grpo"):
        return masked.sum()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"loss_type {loss_type!r}: choose one of {LOSS_TYPES}")


def loss_denominator(
    loss_type: str, completions: int, tokens: int, micro_batches: int, max_completion_length: int
) -> float:
    """What the numerators of a whole global batch (``completions`` of them, ``tokens`` completion tokens over
    ``micro_batches`` micro-batches on every rank) are divided by: completions (``grpo``), tokens (``dapo``),
    completions times ``--max-completion-length`` (``dr_grpo``), micro-batches (``bnpo``)."""
    if loss_type == "grpo":
        return float(completions)
    if loss_type == "dapo":
        return float(max(tokens, 1))
    if loss_type == "dr_grpo":
        return float(completions * max_completion_length)
    if loss_type == "bnpo":
        return float(micro_batches)
    raise ValueError(f"loss_type {loss_type!r}: choose one of {LOSS_TYPES}")


def masked_sums(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` of a per-token ``[B, T]`` quantity over the completion tokens, or of a per-completion
    ``[B, 1]`` one over the completions: a metric's mean over any number of micro-batches and ranks is the sums'
    ratio (TRL's ``global_masked_mean``)."""
    if values.shape[1] == 1:
        return values.sum(), torch.tensor(float(values.shape[0]), device=values.device)
    mask = mask.to(values.dtype)
    return (values * mask).sum(), mask.sum()
