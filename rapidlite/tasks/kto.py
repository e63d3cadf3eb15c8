"""``--task kto``: Kahneman-Tversky optimisation of a causal LM on unpaired completions labelled desirable or not,
equal to TRL 1.16's ``KTOTrainer`` on the same batch (``rapidlite.tasks.preference_losses.kto_loss``).

The loss compares each completion's log-ratio against the reference with a KL estimate: the policy's and the
reference's log-probabilities of mismatched completions (each prompt with another row's completion). As TRL
builds them (``add_kl_completion_ids``), the completions of each run of consecutive samples are rotated by one;
the run here is the global batch, and the training data is read in that order (shuffled once with ``--seed``
when it is prepared, not again each epoch), so each step's KL sequences are its own completions re-paired. The
KL estimate is their mean over the whole global batch, every micro-batch and rank (``before_step``), clamped at
0: what one process with the whole batch computes (TRL gathers it over ranks but not over accumulated
micro-batches). An evaluation's KL is the mean over the whole split.

The reference model (a frozen copy, the policy with its adapters disabled, or ``--precompute-ref-logprobs``) is
``DPOFinetuner``'s. The forward step returns ``(loss_sum over rows, rows)``.
"""

from __future__ import annotations

from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.data.loader import unpadded_batches
from rapidlite.data.preference import (
    Counts,
    UnpairedCollator,
    add_kl_completions,
    encode_splits,
    encode_unpaired,
    unpaired_rows,
)
from rapidlite.errors import ConfigError
from rapidlite.models.head import output_logps
from rapidlite.parallel.context_parallel import split_output_logps
from rapidlite.tasks.dpo import DPOFinetuner
from rapidlite.tasks.preference_losses import kto_loss, sequence_sums


class KTOFinetuner(DPOFinetuner):
    """KTO (``loss_type="kto"`` of TRL) with ``--desirable-weight`` and ``--undesirable-weight``."""

    task_name = "kto"
    shuffle_training_data = False  # each global batch's KL completions are its own (add_kl_completions)
    score_keys = ("prompt_ids", "completion_ids", "kl_completion_ids")
    _kl: torch.Tensor | None = None  # this step's KL estimate over the global batch (set by before_step)
    _eval_kl: torch.Tensor | None = None  # the evaluated split's (set by run_compute_metrics)

    # ------------------------------------------------------------------ data
    def train_valid_test_datasets_provider(self):
        pref = self.settings.preference
        group = self.settings.batching.global_batch_size
        if group < 2:
            raise ConfigError(
                "--task kto estimates its KL term from the global batch's completions paired with other prompts: "
                "a global batch of 1 has none; raise --global-batch-size (or --micro-batch-size) to at least 2"
            )
        raw, seq_length, pad_id = self.tokenizer_and_data_source()
        self.max_length = seq_length
        columns = raw["train"].column_names
        layout = "prompt/completion/label" if "label" in columns else "chosen/rejected pairs, unpaired"

        def encode(name: str, rows: Any, counts: Counts) -> list[dict[str, Any]]:
            unpaired = unpaired_rows(rows, rows.column_names)
            samples = encode_unpaired(unpaired, self.tokenizer, seq_length, pref.max_prompt_length, counts)
            if name == "train":
                order = torch.randperm(
                    len(samples), generator=torch.Generator().manual_seed(self.settings.training.seed)
                )
                samples = [samples[i] for i in order.tolist()]
            add_kl_completions(samples, group)
            return samples

        splits, counts = encode_splits(raw, "kto", seq_length, encode)
        desirable = sum(s["label"] for s in splits["train"])
        self.logger.info(
            f"data: {layout}"
            f"{', chat template ' + self.settings.task.chat_template if self.settings.task.chat_template else ''} | "
            + " | ".join(f"{name}: {c.describe(seq_length, pref.max_prompt_length)}" for name, c in counts.items())
            + f" | train: {desirable} desirable, {len(splits['train']) - desirable} undesirable"
        )
        self._warn_about_weights(desirable, len(splits["train"]) - desirable)
        self.splits = splits
        self.max_token_id = max(
            (max(s["prompt_ids"] + s["completion_ids"]) for part in splits.values() for s in part or ()),
            default=-1,
        )
        self.data = None  # no greedy completions of the instruction data (--eval-generate reads it)
        self.eval_prompts = self.desirable_prompts(raw)
        return splits["train"], splits["validation"], splits["test"], UnpairedCollator(pad_id, seq_length)

    def desirable_prompts(self, raw: Any) -> list[tuple[str, str]]:
        """``--eval-generate N``: the prompts of the first N desirable validation completions (a conversation
        rendered with its generation prompt), each with that completion, which a greedy one is scored against."""
        n = self.settings.task.eval_generate
        if not n or "validation" not in raw:
            return []
        out = []
        for prompt, completion, desirable in unpaired_rows(raw["validation"], raw["validation"].column_names):
            if not desirable:
                continue
            if isinstance(completion, list):  # a conversation
                prompt = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                completion = completion[-1]["content"]
            out.append((prompt, completion))
            if len(out) == n:
                break
        return out

    def _warn_about_weights(self, desirable: int, undesirable: int) -> None:
        """TRL's advice when the labels are unbalanced and neither weight offsets it (eq. 8 of the KTO paper:
        desirable weight x desirable rows over undesirable weight x undesirable rows in [1, 4/3])."""
        w = self.settings.task_options
        d, u = max(desirable, 1), max(undesirable, 1)
        if d == u:
            return
        low_d, high_d = round(u * w.undesirable_weight / d, 2), round(u * w.undesirable_weight / d * 1.33, 2)
        low_u, high_u = round(d * w.desirable_weight / u / 1.33, 2), round(d * w.desirable_weight / u, 2)
        if not (low_d <= w.desirable_weight <= high_d or low_u <= w.undesirable_weight <= high_u):
            self.logger.warning(
                f"--task kto: {desirable} desirable and {undesirable} undesirable rows, and the weights do not "
                f"offset it; set --desirable-weight in [{low_d}, {high_d}] or --undesirable-weight in "
                f"[{low_u}, {high_u}] (not both)"
            )

    # ------------------------------------------------------------------ scores
    def sequence_logps(self, model: Any, batch: dict[str, torch.Tensor], prefix: str = "", stats: bool = False):
        """The summed log-probabilities ``[rows]`` of the completions (``prefix`` "kl_": of the KL sequences), their
        token counts, and with ``stats`` TRL's per-row entropy and mean-logit sums, from one forward through the
        chunked output layer where it serves the model (``output_logps``)."""
        ids, labels = batch[f"{prefix}input_ids"], batch[f"{prefix}labels"]
        chunked, group = self.settings.model.chunked_loss, self.engine.dist.cp_group
        positions = batch.get(f"{prefix}position_ids")
        rows = len(batch["label"])
        if positions is not None:  # --padding-free: one row, each sequence kept apart by its restarting positions
            inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
            out = output_logps(model, inputs, labels, shift=True, chunked=chunked, stats=stats)
            segments = (positions == 0).long().cumsum(-1) - 1
        elif group is not None:  # each rank's shard of every (right-padded) row, gathered whole
            out = split_output_logps(model, {"input_ids": ids}, labels, group, chunked, stats=stats)
            segments = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)
        else:
            inputs = {"input_ids": ids, "attention_mask": batch[f"{prefix}attention_mask"], "use_cache": False}
            out = output_logps(model, inputs, labels, shift=True, chunked=chunked, stats=stats)
            segments = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)
        logps, tokens = sequence_sums(out[0] if stats else out, labels, segments, rows)
        if not stats:
            return logps, tokens
        entropy, mean_logit = (sequence_sums(values, labels, segments, rows)[0] for values in out[1])
        return logps, tokens, (entropy, mean_logit)

    def reference_logps(self, batch: dict[str, torch.Tensor], model: Any, prefix: str = "") -> torch.Tensor:
        """The reference's summed log-probabilities ``[rows]`` of the completions or (``prefix`` "kl_") the KL
        sequences: precomputed, from the frozen copy, or from the policy with its adapters disabled."""
        if "ref_logps" in batch:
            return batch["ref_logps"][:, 1 if prefix else 0]
        if self.ref_model is not None:
            with torch.no_grad():
                return self.sequence_logps(self.ref_model, batch, prefix)[0]
        with self.reference_mode(model):
            return self.sequence_logps(model, batch, prefix)[0]

    def score_rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``--precompute-ref-logprobs``: each sample's completion and KL sequence scored, ``[rows, 2]``."""
        return torch.stack([self.sequence_logps(self.model, batch, p)[0] for p in ("", "kl_")], 1)

    def scoring_collator(self) -> UnpairedCollator:
        return UnpairedCollator(self.tokenizer.pad_token_id, self.max_length)

    def kl_terms(self, batch: dict[str, torch.Tensor], model: Any) -> torch.Tensor:
        """``[sum over rows of the KL sequences' policy minus reference log-probabilities, rows]`` (no gradient)."""
        with torch.no_grad():
            policy = self.sequence_logps(model, batch, "kl_")[0]
        reference = self.reference_logps(batch, model, "kl_")
        return torch.stack([(policy - reference).double().sum(), torch.tensor(len(policy), dtype=torch.float64)])

    def _global_kl(self, terms: torch.Tensor) -> torch.Tensor:
        total, rows = self.engine.all_reduce_sum(terms.cpu()).tolist()
        return torch.tensor(total / max(rows, 1.0), dtype=torch.float32).clamp(min=0)

    def before_step(self, micro_batches: list[Any]) -> None:
        """The KL estimate of the global batch: the mean over all its KL sequences, on every rank (a collective)."""
        terms = sum(self.kl_terms(b, self.model).cpu() for b in micro_batches)
        self._kl = self._global_kl(terms)
        self.monitor.step_metrics.add("kl", self._kl, 1)

    def nll_weight(self) -> float:
        return 0.0

    # ------------------------------------------------------------------ forward
    def run_forward_step(self, batch, model):
        w = self.settings.task_options
        training = self.training_mode(model)
        kl = self._kl if training else self._eval_kl
        if kl is None:  # a forward outside the loop (no before_step): the batch's own estimate
            kl = self._global_kl(self.kl_terms(batch, model))
        logps, tokens, (entropy, mean_logit) = self.sequence_logps(model, batch, stats=True)
        reference = self.reference_logps(batch, model)
        desirable = batch["label"].bool()
        losses, rewards = kto_loss(
            logps, reference, desirable, kl.to(logps.device), w.beta, w.desirable_weight, w.undesirable_weight
        )
        sink = self.monitor.step_metrics if training else self.eval_metrics
        for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
            sink.add_mean(f"rewards/{name}", rewards[rows])
            sink.add_mean(f"logps/{name}", logps.detach()[rows])
            sink.add(f"logits/{name}", mean_logit[rows].sum(), tokens[rows].sum())
        sink.difference("rewards/margins", "rewards/chosen", "rewards/rejected")
        sink.add("entropy", entropy.sum(), tokens.sum())
        return losses.sum(), len(losses)

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        """TRL's metrics over the split, the KL estimate being the whole split's (one pass over its KL sequences
        first), so the numbers do not depend on how the split is batched and shared over ranks."""
        terms = torch.zeros(2, dtype=torch.float64)
        for batch in unpadded_batches(eval_dataloader):
            terms += self.kl_terms(batch, model[0]).cpu()
        self._eval_kl = self._global_kl(terms)
        try:
            metrics = super().run_compute_metrics(model, eval_dataloader)
        finally:
            kl, self._eval_kl = self._eval_kl, None
        metrics["kl"] = float(kl)
        return metrics


def trainer_for(settings: Sections) -> type[KTOFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return KTOFinetuner
