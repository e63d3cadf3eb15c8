"""``--task reward_model``: train ``AutoModelForSequenceClassification`` with one output to score a pair's chosen
response above its rejected one, as TRL's ``RewardTrainer`` (1.16) does.

Each row is tokenized whole, prompt + response (``rapidlite.data.preference.encode_reward_pairs``: a row longer
than ``--max-length`` is dropped and counted, since the score is read at its last token). A micro-batch's chosen and
rejected sequences go through one forward pass as ``[2 x pairs, length]``, chosen rows first (TRL's order), right
padded with the pad id the model's config is given (a sequence classifier reads each row's score at its last
non-pad token). The loss of a pair is the Bradley-Terry ``-logsigmoid(r_chosen - r_rejected - margin)``, the margin
from the data's ``margin`` column (0 without one); ``--center-rewards-coefficient C`` adds TRL's
``C * (r_chosen + r_rejected)^2`` to each pair's loss.

The forward step returns ``(loss_sum over pairs, pairs)``: any split into micro-batches and ranks trains as one
batch. Metrics are TRL's names, means over the interval's (or the validation split's) pairs on every rank:
``accuracy`` (the share of pairs with r_chosen > r_rejected), ``margin`` (mean r_chosen - r_rejected) and
``mean_reward`` (over chosen and rejected sequences); each validation pass also logs ``min_reward`` and
``max_reward`` over the whole split. Training logs no min/max: TRL's are means of per-step extremes, which change
with the micro-batch size and the number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.preference import (
    Counts,
    PairCollator,
    encode_reward_pairs,
    encode_splits,
    pair_layout,
    pair_rewards,
)
from rapidlite.evaluation.metrics import MeanMetrics
from rapidlite.models import lora
from rapidlite.tasks.causal_lm import CausalLMFinetuner
from rapidlite.tasks.sequence_classification import load_classifier


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's loss, ``-logsigmoid(r_chosen - r_rejected [- margin])``."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff)
    return -F.logsigmoid(diff)


class RewardModelFinetuner(CausalLMFinetuner):
    """A reward model: one score per sequence, trained so that chosen responses score above rejected ones."""

    task_name = "reward_model"

    # ------------------------------------------------------------------ data
    def train_valid_test_datasets_provider(self):
        raw, seq_length, pad_id = self.tokenizer_and_data_source()
        layout = pair_layout(raw["train"].column_names)

        def encode(name: str, rows: Any, counts: Counts) -> list[dict[str, Any]]:
            pair_layout(rows.column_names)
            return encode_reward_pairs(rows, self.tokenizer, seq_length, counts)

        splits, counts = encode_splits(raw, "reward_model", seq_length, encode)
        margin = ", margin column" if "margin" in raw["train"].column_names else ""
        template = self.settings.task.chat_template
        self.logger.info(
            f"data: {layout}{margin}{', chat template ' + template if template else ''} | "
            + " | ".join(f"{name}: {c.describe(seq_length, None)}" for name, c in counts.items())
        )
        self.pad_id = pad_id
        self.max_token_id = max(
            (max(s["chosen_ids"] + s["rejected_ids"]) for part in splits.values() for s in part or ()), default=-1
        )
        return splits["train"], splits["validation"], splits["test"], PairCollator(pad_id)

    # ------------------------------------------------------------------ model
    def model_optimizer_lr_scheduler_provider(self):
        adapter = getattr(self, "adapter", None)
        base_name = getattr(self, "base_name", self.settings.model.pretrained_model_name_or_path)
        model = load_classifier(base_name, 1, {0: "reward"}, **self.pretrained_load_kwargs())
        if adapter is not None:
            model = lora.load_adapter(model, adapter)
            self.logger.info(f"LoRA adapter {adapter} on its base {base_name}")
        # The classifier reads each row's score at its last token that is not this id: the one rows are padded
        # with, whatever the config said (TRL sets it so too).
        model.config.pad_token_id = self.pad_id
        self.fit_embeddings(model)
        return model, None, None

    # ------------------------------------------------------------------ forward and metrics
    def count_items(self, batch: Any) -> int | None:
        return None  # the reward loss counts pairs, not the causal LM's tokens: counted in the step

    def run_forward_step(self, batch, model):
        chosen, rejected = pair_rewards(model, batch)
        losses = bradley_terry(chosen, rejected, batch.get("margin"))
        centre = self.settings.task_options.center_rewards_coefficient
        if centre:  # TRL's: its mean over the pairs, here each pair's share of the summed loss
            losses = losses + centre * (chosen + rejected) ** 2
        self.record_metrics(self.engine.strategy.module(model).training, chosen.detach(), rejected.detach())
        return losses.sum(), chosen.shape[0]

    def record_metrics(self, training: bool, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """TRL's metrics of the pairs into the interval's sums (training) or the validation pass's."""
        sink = self.monitor.step_metrics if training else self.eval_metrics
        sink.add_mean("accuracy", (chosen > rejected).float())
        sink.add_mean("margin", chosen - rejected)
        sink.add_mean("mean_reward", torch.cat([chosen, rejected]))
        if not training:
            extremes = torch.stack([torch.maximum(chosen, rejected).max(), -torch.minimum(chosen, rejected).min()])
            self._extremes = torch.maximum(self._extremes, extremes.double().cpu())

    @property
    def eval_metrics(self) -> MeanMetrics:
        if not hasattr(self, "_eval_metrics"):
            self._eval_metrics = MeanMetrics()
        return self._eval_metrics

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        self.eval_metrics.clear()
        self._extremes = torch.full((2,), -torch.inf, dtype=torch.float64)
        metrics = super(CausalLMFinetuner, self).run_compute_metrics(model, eval_dataloader)  # the mean loss
        metrics.update(self.eval_metrics.reduce(self.engine.all_reduce_sum))
        # A max over the ranks (every rank calls it): the highest score, and the lowest as the highest negated.
        highest, lowest = self.engine.dist.all_reduce(self._extremes, "max").tolist()
        metrics["min_reward"], metrics["max_reward"] = -lowest, highest
        return metrics


def trainer_for(settings: Sections) -> type[RewardModelFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return RewardModelFinetuner
