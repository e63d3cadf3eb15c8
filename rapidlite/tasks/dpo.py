"""``--task dpo``: preference training of a causal LM on chosen/rejected pairs (DPO, IPO, hinge, robust, SimPO,
ORPO), equal to TRL's trainers on the same batch (``rapidlite.tasks.preference_losses``).

The chosen and rejected sequences of a micro-batch go through one forward pass as one batch (``[2 x pairs,
length]``, chosen rows first, as TRL orders them), or packed into one row with ``--padding-free``, each kept to
itself by its restarting positions. Only the response tokens are scored (ORPO's: every token), through the
chunked output layer where it serves the model (``rapidlite.models.head.output_logps``: the whole logits never
exist), else only their logits becoming fp32; the reference's scores take the same path.

The reference model, for the losses that have one:

- with ``--lora-rank`` (or an adapter to continue), the policy itself with its adapters disabled: no second
  copy;
- otherwise a frozen copy of the starting weights, laid out as the policy is (``Strategy.prepare_frozen``: the
  same precision, tensor-parallel split and ZeRO-3 sharding, DeepSpeed's too);
- or, with ``--precompute-ref-logprobs``, none: the policy scores the data once before its first step (the
  scores are cached under ``$RAPIDLITE_CACHE``), and no reference is kept in memory.

The forward step returns ``(loss_sum over pairs, pairs)``: any split into micro-batches and ranks trains as one
batch. The NLL term of ``--rpo-alpha`` and ORPO is a mean over the global batch's tokens, counted before each
step (``before_step``). Metrics are TRL's names, averaged over the interval's pairs on every rank.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.data.preference import Counts, PairCollator, encode_pairs, encode_splits, pair_layout, read_pair
from rapidlite.data.vision_pairs import repeated_images
from rapidlite.errors import ConfigError
from rapidlite.evaluation.metrics import MeanMetrics
from rapidlite.models import lora
from rapidlite.models.head import output_logps
from rapidlite.parallel.context_parallel import split_output_logps
from rapidlite.runtime.cache import cache_root, make_cache_dir
from rapidlite.tasks.causal_lm import CausalLMFinetuner
from rapidlite.tasks.dpo_spec import preference_reference
from rapidlite.tasks.preference_losses import PairScores, pair_loss, sequence_sums


def _segments(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The sequence each position of the forward's rows belongs to, and how many sequences there are: a packed
    row's restarting positions, else one sequence a row."""
    positions = batch.get("position_ids")
    if positions is not None and "sequences_per_sample" in batch:
        segments = (positions == 0).long().cumsum(-1) - 1
        return segments, int(segments.max()) + 1
    rows, length = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
    n = rows * batch["input_ids"].shape[1] if batch["input_ids"].ndim == 3 else rows
    return torch.arange(n, device=batch["input_ids"].device)[:, None].expand(n, length), n


def local_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s weights this rank holds: FSDP's and tensor parallelism's local shards, DeepSpeed
    ZeRO-3's partitions."""
    total = 0
    for p in model.parameters():
        t = getattr(p, "ds_tensor", None)
        if t is None:
            t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def forward_inputs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's inputs and the labels, as ``[sequences or 1, length]``: a padded ``[pairs, k, length]`` batch
    with its k sequences of each pair as consecutive blocks (all chosen, then all rejected, TRL's order)."""
    if "sequences_per_sample" in batch:  # packed: one row already
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, batch["labels"]

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).reshape(-1, x.shape[-1])

    inputs = {"input_ids": flat(batch["input_ids"]), "attention_mask": flat(batch["attention_mask"])}
    for key in ("token_type_ids", "mm_token_type_ids"):  # a vision-language model's token types
        if key in batch:
            inputs[key] = flat(batch[key])
    inputs.update(repeated_images(batch))  # the prompts' images, for the chosen rows and again the rejected
    return inputs, flat(batch["labels"])


def _sequence_labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every real token of each sequence as a target (ORPO's NLL covers prompt and response): the ids, -100 on
    padding and on a packed sequence's first token."""
    ids = inputs["input_ids"]
    if "attention_mask" in inputs:
        return ids.masked_fill(inputs["attention_mask"] == 0, -100)
    return ids.masked_fill(inputs["position_ids"] == 0, -100)


class DPOFinetuner(CausalLMFinetuner):
    """Direct preference optimisation and its variants (``--loss-type``) on a causal LM."""

    task_name = "dpo"
    image_passes = 2  # the chosen and the rejected rows each see the prompt's images
    ref_model: Any = None  # the frozen copy, when the reference is one
    eval_prompts: list[tuple[str, str]] = []  # --eval-generate's prompts and their chosen responses
    _nll_scale: float | None = None  # this step's pairs / NLL tokens over the global batch (set by before_step)

    # ------------------------------------------------------------------ data
    def train_valid_test_datasets_provider(self):
        pref = self.settings.preference
        raw, seq_length, pad_id = self.tokenizer_and_data_source()
        self.max_length = seq_length
        layout = pair_layout(raw["train"].column_names)
        self.images = self.vision_run(raw)
        if self.images:
            return self.vision_pair_data(raw, seq_length)

        def encode(name: str, rows: Any, counts: Counts) -> list[dict[str, Any]]:
            pair_layout(rows.column_names)
            return encode_pairs(rows, self.tokenizer, seq_length, pref.max_prompt_length, counts)

        splits, counts = encode_splits(raw, "dpo", seq_length, encode)
        self.logger.info(
            f"data: {layout}"
            f"{', chat template ' + self.settings.task.chat_template if self.settings.task.chat_template else ''} | "
            + " | ".join(f"{name}: {c.describe(seq_length, pref.max_prompt_length)}" for name, c in counts.items())
        )
        self.splits = splits
        self.max_token_id = max(
            (
                max(s["prompt_ids"] + s["chosen_ids"] + s["rejected_ids"])
                for part in splits.values()
                for s in part or ()
            ),
            default=-1,
        )
        self.eval_prompts = self.prompts_to_complete(raw)
        return splits["train"], splits["validation"], splits["test"], PairCollator(pad_id)

    def prompts_to_complete(self, raw: Any) -> list[tuple[str, str]]:
        """``--eval-generate N``: the first N validation prompts (a conversation rendered with its generation
        prompt) with their chosen response, the reference a greedy completion is scored against."""
        n = self.settings.task.eval_generate
        if not n or "validation" not in raw:
            return []
        out = []
        for row in raw["validation"].select(range(min(n, len(raw["validation"])))):
            pair = read_pair(row)
            if pair.conversational:
                prompt = self.tokenizer.apply_chat_template(pair.prompt, tokenize=False, add_generation_prompt=True)
                out.append((prompt, pair.chosen[-1]["content"]))
            else:
                out.append((pair.prompt, pair.chosen))
        return out

    # ------------------------------------------------------------------ model and reference
    def model_optimizer_lr_scheduler_provider(self):
        model, optimizer, scheduler = super().model_optimizer_lr_scheduler_provider()
        if self.uses_frozen_copy(model):
            # The starting weights, before anything trains them (or a checkpoint is loaded into the policy).
            self._reference_weights = copy.deepcopy(model)
        return model, optimizer, scheduler

    @property
    def reference(self) -> str:
        """What the reference is (``dpo_spec.preference_reference``): none, precomputed, adapters (the policy
        with its adapters disabled; also when continuing an adapter directory) or copy."""
        kind = preference_reference(self.settings)
        return "adapters" if kind == "copy" and getattr(self, "adapter", None) is not None else kind

    def uses_frozen_copy(self, model: torch.nn.Module) -> bool:
        return self.reference == "copy" and not lora.is_peft_model(model)

    def after_compose(self) -> None:
        weights = getattr(self, "_reference_weights", None)
        if weights is not None:
            self.ref_model = self.engine.strategy.prepare_frozen(weights)
            self._reference_weights = None
            self.logger.info(
                f"reference model: a frozen copy laid out as the policy ({self.engine.strategy.name}), "
                f"{local_bytes(self.ref_model) / 2**20:.2f} MiB of weights on this rank"
            )
        elif self.reference == "adapters":
            self.logger.info("reference model: the policy with its LoRA adapters disabled (no second copy)")
        elif self.reference == "precomputed":
            self.precompute_reference()

    @contextmanager
    def reference_mode(self, model: Any):
        """Around a forward of ``model`` that must give the reference's scores: its adapters disabled, in eval
        mode (no dropout), no gradients."""
        peft_model = self.engine.strategy.module(model)
        if not lora.is_peft_model(peft_model):
            raise ConfigError(
                "the reference is the policy with its adapters disabled, but the model has no LoRA adapters"
            )
        was_training = self.training_mode(model)
        model.eval()
        try:
            with torch.no_grad(), peft_model.disable_adapter():
                yield
        finally:
            model.train(was_training)

    def reference_scores(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed log-probabilities of each pair's chosen and rejected responses, ``[pairs]`` each."""
        if "ref_logps" in batch:
            return batch["ref_logps"][:, 0], batch["ref_logps"][:, 1]
        if self.ref_model is not None:
            with torch.no_grad():
                logps, _ = self.forward_logps(self.ref_model, batch)
        else:
            with self.reference_mode(model):
                logps, _ = self.forward_logps(model, batch)
        return logps.detach().chunk(2)

    # ------------------------------------------------------------------ forward
    def forward_logps(self, model: Any, batch: dict[str, torch.Tensor], full_nll: bool = False):
        """``(logps, tokens)`` of every sequence (chosen ones, then rejected ones), and with ``full_nll`` also
        the chosen sequences' summed log-probabilities and tokens over all their tokens (ORPO's NLL). One
        forward and one set of per-token log-probabilities (``output_logps``: chunked where it serves the
        model), of the response tokens or, with ``full_nll``, of every token; each sum picks its own."""
        inputs, labels = forward_inputs(batch)
        segments, n = _segments(batch)
        every = _sequence_labels(inputs) if full_nll else None
        targets = labels if every is None else torch.where(labels != -100, labels, every)
        chunked = self.settings.model.chunked_loss
        if self.engine.dist.cp_group is not None:  # each rank's shard of every sequence, gathered whole
            per_token = split_output_logps(model, inputs, targets, self.engine.dist.cp_group, chunked)
        else:
            per_token = output_logps(model, {**inputs, "use_cache": False}, targets, shift=True, chunked=chunked)
        logps, tokens = sequence_sums(per_token, labels, segments, n)
        if every is None:
            return logps, tokens
        full, full_tokens = sequence_sums(per_token, every, segments, n)
        pairs = n // 2
        return (logps, tokens), (full[:pairs].sum(), full_tokens[:pairs].sum())

    def nll_weight(self) -> float:
        loss = self.settings.task_options
        if loss.loss_type == "orpo":
            return 1.0
        return loss.rpo_alpha or 0.0

    def nll_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """The tokens the NLL term averages over in ``batch``: the chosen responses' (``--rpo-alpha``) or every
        token of the chosen sequences (ORPO, as TRL's ``ORPOTrainer``), counted as targets (a sequence's first
        token is none)."""
        inputs, labels = forward_inputs(batch)
        if self.settings.task_options.loss_type == "orpo":
            labels = _sequence_labels(inputs)
        segments, n = _segments(batch)
        targets = (labels[:, 1:] != -100) & (segments[:, 1:] < n // 2)
        return int(targets.sum())

    def before_step(self, micro_batches: list[Any]) -> None:
        """The global batch's pairs and NLL tokens, so the NLL term is their token mean however it is split."""
        if not self.nll_weight():
            return
        counts = torch.tensor(
            [
                [float(self._pairs(b)) for b in micro_batches],
                [float(self.nll_tokens(b)) for b in micro_batches],
            ],
            dtype=torch.float64,
        ).sum(1)
        pairs, tokens = self.engine.all_reduce_sum(counts).tolist()
        self._nll_scale = pairs / max(tokens, 1.0)

    @staticmethod
    def _pairs(batch: dict[str, torch.Tensor]) -> int:
        if "sequences_per_sample" in batch:
            return _segments(batch)[1] // int(batch["sequences_per_sample"])
        return batch["input_ids"].shape[0]

    def count_items(self, batch: Any) -> int | None:
        return None  # DPO's and KTO's losses count pairs or examples, not the causal LM's tokens: counted in the step

    def run_forward_step(self, batch, model):
        loss = self.settings.task_options
        nll_weight = self.nll_weight()
        orpo = loss.loss_type == "orpo"
        result = self.forward_logps(model, batch, full_nll=orpo)
        if orpo:
            (logps, tokens), (nll_sum, nll_tokens) = result
            nll_sum = -nll_sum
        else:
            logps, tokens = result
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        if not orpo:
            nll_sum, nll_tokens = -chosen.sum(), chosen_tokens.sum()
        scores = PairScores(chosen, rejected, chosen_tokens, rejected_tokens)
        if not loss.reference_free:
            scores.ref_chosen, scores.ref_rejected = self.reference_scores(batch, model)
        beta = loss.orpo_alpha if orpo else loss.beta
        out = pair_loss(loss.loss_type, scores, beta, loss.label_smoothing, loss.simpo_gamma)
        pairs = chosen.shape[0]
        loss_sum = out.losses.sum()
        training = self.training_mode(model)
        if nll_weight and training:
            # Scaled by the global batch's pairs per NLL token (before_step): the term is the global token mean.
            # Evaluation adds it once over the whole split (run_compute_metrics).
            scale = self._nll_scale if self._nll_scale is not None else pairs / max(int(nll_tokens), 1)
            loss_sum = loss_sum + nll_weight * nll_sum * scale
        # The reference-free losses read (and log, as CPO's and ORPO's trainers do) per-token log-probabilities.
        self.record_metrics(training, scores, out, nll_sum, nll_tokens, averaged=loss.reference_free)
        return loss_sum, pairs

    def training_mode(self, model: Any) -> bool:
        """Whether ``model`` is in training mode: its module's flag (DeepSpeed's engine does not keep its own)."""
        return self.engine.strategy.module(model).training

    def record_metrics(self, training: bool, scores: PairScores, out, nll_sum, nll_tokens, averaged: bool) -> None:
        """TRL's metrics of the pairs: the rewards, their accuracy and margin, the log-probabilities (per token
        for SimPO and ORPO, as CPO's and ORPO's trainers log them) and the NLL."""
        sink = self.monitor.step_metrics if training else self.eval_metrics
        sink.add_mean("rewards/chosen", out.chosen_rewards)
        sink.add_mean("rewards/rejected", out.rejected_rewards)
        sink.add_mean("rewards/accuracies", (out.chosen_rewards > out.rejected_rewards).float())
        sink.add_mean("rewards/margins", out.chosen_rewards - out.rejected_rewards)
        sink.add_mean("logps/chosen", (scores.chosen_avg if averaged else scores.chosen).detach())
        sink.add_mean("logps/rejected", (scores.rejected_avg if averaged else scores.rejected).detach())
        sink.add("nll_loss", nll_sum.detach(), nll_tokens)
        for name, values in out.extra.items():
            sink.add_mean(name, values)

    @property
    def eval_metrics(self) -> MeanMetrics:
        if not hasattr(self, "_eval_metrics"):
            self._eval_metrics = MeanMetrics()
        return self._eval_metrics

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        self.eval_metrics.clear()
        metrics = super(CausalLMFinetuner, self).run_compute_metrics(model, eval_dataloader)
        metrics.update(self.eval_metrics.reduce(self.engine.all_reduce_sum))
        # The NLL term as a token mean over the whole split: the same however the split is batched and shared.
        metrics["loss"] += self.nll_weight() * metrics.get("nll_loss", 0.0)
        if self.eval_prompts:
            metrics["exact_match"] = self.generate_and_score(model[0], self.eval_prompts)
        return metrics

    # ------------------------------------------------------------------ --precompute-ref-logprobs
    def precompute_reference(self) -> None:
        """The starting policy's scores of every sample of each split (``score_rows``), computed once (each
        data-parallel rank scores its share; the shares are gathered) and cached; the samples then carry them as
        ``ref_logps``."""
        for name in ("train", "validation", "test"):
            samples = self.splits.get(name)
            if not samples:
                continue
            path = Path(cache_root()) / "ref-logps" / f"{self._fingerprint(samples)}.pt"
            cached = float(path.is_file())
            everywhere = float(self.engine.all_reduce_sum(torch.tensor(cached, dtype=torch.float64)))
            if everywhere == self.engine.dp_size:
                values = torch.load(path)
                source = f"read from {path}"
            else:
                values = self._score(samples)
                if self.engine.is_main_process:
                    make_cache_dir(path.parent)
                    scratch = path.with_suffix(f".tmp{os.getpid()}")
                    torch.save(values, scratch)
                    os.replace(scratch, path)
                source = f"computed, cached in {path}"
            for sample, scores in zip(samples, values.tolist(), strict=True):
                sample["ref_logps"] = scores
            self.logger.info(f"--precompute-ref-logprobs: reference scores of {len(samples)} {name} samples {source}")

    # What a sample's reference scores are made of (``_fingerprint``), and how its batches are collated to score.
    score_keys: tuple[str, ...] = ("prompt_ids", "chosen_ids", "rejected_ids")

    def scoring_collator(self) -> Any:
        return PairCollator(self.tokenizer.pad_token_id)

    def score_rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The starting policy's two scores of each sample of ``batch``, ``[rows, 2]``: a pair's chosen and
        rejected response (what ``ref_logps`` holds)."""
        logps, _ = self.forward_logps(self.model, batch)
        return torch.stack(logps.chunk(2), 1)

    def _score(self, samples: list[dict[str, Any]]) -> torch.Tensor:
        rows = [dict(s, row=i) for i, s in enumerate(samples)]
        loader = self.build_data_loader(rows, shuffle=False, collate_fn=_Indexed(self.scoring_collator()))
        out = torch.zeros(len(samples), 2, dtype=torch.float32)
        was_training = self.training_mode(self.model)
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    index = self.engine.gather(batch["row"]).cpu()
                    out[index] = self.engine.gather(self.score_rows(batch).float()).cpu()
        finally:
            self.model.train(was_training)
        return out

    def _fingerprint(self, samples: list[dict[str, Any]]) -> str:
        """What the reference's scores depend on: the model (its name, and its files' sizes and times), the
        precision, and every sample's tokens (``score_keys``)."""
        digest = hashlib.sha256()
        name = self.settings.model.pretrained_model_name_or_path
        files = sorted(Path(name).glob("*")) if os.path.isdir(name) else []
        digest.update(json.dumps([name, [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]]).encode())
        digest.update(str(self.engine.precision.name).encode())
        for s in samples:
            digest.update(json.dumps([s[k] for k in self.score_keys]).encode())
        return digest.hexdigest()[:24]


class _Indexed:
    """Batches of ``collate`` with their samples' row numbers (``row``), for scores gathered from every rank back
    into their rows."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples):
        batch = self.collate(samples)
        batch["row"] = torch.tensor([s["row"] for s in samples], dtype=torch.int64)
        return batch


def trainer_for(settings: Sections) -> type[DPOFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return DPOFinetuner
