"""``--task rloo``: REINFORCE Leave-One-Out (TRL's ``RLOOTrainer``) on ``--task grpo``'s loop (``grpo.py``): the
same rollouts, rewards and layouts; its own advantages (each completion's reward, less ``--beta`` times its KL to
the reference, minus the mean of its group's others) and loss (a clipped ratio of whole-completion
probabilities)."""

from __future__ import annotations

import torch

from rapidlite.config.settings import Sections
from rapidlite.tasks.grpo import GRPOFinetuner
from rapidlite.tasks.rl_losses import rloo_advantages, rloo_terms
from rapidlite.tasks.rollout_state import Rollout


class RLOOFinetuner(GRPOFinetuner):
    """REINFORCE Leave-One-Out (TRL's ``RLOOTrainer``): each completion's reward, less ``--beta`` times its KL to
    the reference, minus the mean of its group's others; a clipped ratio of whole-completion probabilities."""

    task_name = "rloo"

    def needs_old_logps(self) -> bool:
        o = self.settings.task_options
        return o.num_iterations > 1 or o.beta != 0.0  # the KL in the reward is the rollout policy's

    def advantages(self, rollout: Rollout, rewards: torch.Tensor):
        o = self.settings.task_options
        kl = None
        if o.beta != 0.0:
            mask = torch.tensor(
                [[j < len(c) for j in range(rollout.old_logps.shape[1])] for c in rollout.completion_ids],
                dtype=torch.float32,
            )
            kl = ((rollout.old_logps - rollout.ref_logps) * mask).sum(1)
            rollout.metrics["kl"] = float(kl.mean())
        clip = tuple(o.reward_clip_range) if o.reward_clip_range else None
        return rloo_advantages(rewards, self.weights, o.num_generations, o.normalize_advantages, kl, o.beta, clip)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["completion_mask"].shape[0]

    def run_forward_step(self, batch, model):
        o = self.settings.task_options
        mask = batch["completion_mask"]
        logps, entropy = self.completion_logps(model, batch)
        old = batch.get("old_logps") if o.num_iterations > 1 else None
        old_sums = None if old is None else (old * mask).sum(1)
        terms = rloo_terms(logps, old_sums, batch["advantages"], mask, o.epsilon, o.epsilon_high)
        self.record_policy_metrics(terms, entropy, mask)
        return terms.per_token_loss.sum(), self.count_items(batch)


def trainer_for(settings: Sections) -> type[RLOOFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return RLOOFinetuner
