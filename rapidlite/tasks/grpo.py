"""``--task grpo`` (and ``rloo.py``'s ``--task rloo``): online RL of a causal LM on prompts, with reward functions.

Each optimizer step trains on one global batch of completions. Every ``--num-iterations`` (mu) steps a rollout makes
the next one: the global batch's prompts (shuffled per epoch) are each sampled ``--num-generations`` times by the
policy (``generation.sampling``, or ``generation.vllm``). Each data-parallel rank samples its contiguous share, the
``i``-th completion of rollout ``k`` from its own random stream (``completion_key(seed, k, i)``), so completions
never depend on the layout. Rewards are gathered, advantages made from all of them, and every rank holds the whole
rollout (tokens, advantages, the rollout policy's and reference's log-probabilities where needed): a checkpoint
taken mid-rollout keeps it, so a resumed run trains on what was sampled. A rank trains on its share.

The loss is TRL's (``rl_losses``): ``(numerator, items)`` per micro-batch, the global batch's items being TRL's
denominator, so any split trains as one batch. Log-probabilities go through the chunked output layer at the
sampling temperature, positions counted from each row's first real token (a left-padded prompt scores as sampled).
ZeRO-3's parameters are gathered once per rollout (``Strategy.gathered_for_generation``), and ranks whose forwards
are collective stop a generation batch together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import get_task, task_options
from rapidlite.data.prompts import Prompt, check_layout, read_prompts
from rapidlite.errors import DataError
from rapidlite.evaluation.metrics import MeanMetrics
from rapidlite.generation.rollout import completion_metrics, rollout_batch
from rapidlite.generation.sampling import SamplingSettings, completion_key, sample
from rapidlite.generation.vllm import sync_weights
from rapidlite.models.hf import load_tokenizer
from rapidlite.parallel.context_parallel import whole_sequences
from rapidlite.tasks.causal_lm import choose_pad
from rapidlite.tasks.dpo import DPOFinetuner
from rapidlite.tasks.grpo_spec import RolloutOptions, online_reference
from rapidlite.tasks.rewards import TrainerState, load_reward_functions, reward_weights, score
from rapidlite.tasks.rl_losses import ClipSettings, group_advantages, loss_numerator, masked_sums, policy_terms
from rapidlite.tasks.rollout_state import (
    Rollout,
    as_reward_functions,
    completion_logps,
    completion_row,
    gather_ids,
    real_tokens,
    reduced_metrics,
    write_completions,
)
from rapidlite.trainer.providers import split_datasets

COMPLETIONS_LOGGED = 8  # completions written to completions.jsonl (and the W&B table) each log interval
EVAL_ROLLOUT = -1  # the rollout index of evaluation's random streams: the same completions' keys every time


class GRPOFinetuner(DPOFinetuner):
    """Online RL (see the module's docstring); ``RLOOFinetuner`` changes the advantages and the loss. A white-box
    script subclasses it and may override ``reward_functions_provider`` beside the dataset and model providers."""

    task_name = "grpo"
    _rollout: Rollout | None = None
    _restored: dict[str, Any] | None = None  # a mid-rollout checkpoint's rollout, until the loop reaches it
    pad_id: int | None = None
    vllm: Any = None  # --use-vllm's colocated engine (rapidlite.generation.vllm.VllmSampler)
    _synced_at = -1  # the iteration whose policy the vLLM engine holds

    def __init__(self, engine: Any = None) -> None:
        super().__init__(engine)
        if not isinstance(self.settings.task_options, RolloutOptions):
            # A --user-script run: the flags as --task <task_name> reads them, checked as its command line is.
            spec = get_task(self.task_name)
            self.settings = dataclasses.replace(self.settings, task_options=task_options(spec, vars(self.args)))
            spec.check(self.settings)

    # ------------------------------------------------------------------ data and rewards
    def train_valid_test_datasets_provider(self):
        raw, _, pad_id = self.tokenizer_and_data_source()
        self.pad_id = pad_id
        check_layout(raw["train"].column_names)
        cut = self.settings.preference.max_prompt_length
        splits, described = {}, []
        for name in ("train", "validation", "test"):
            if name in raw:
                splits[name], counts = read_prompts(raw[name], self.tokenizer, cut)
                described.append(f"{name}: {counts.describe(cut)}")
        self.logger.info("data: " + " | ".join(described))
        self.max_token_id = max((max(p.ids, default=-1) for part in splits.values() for p in part), default=-1)
        return splits.get("train"), splits.get("validation"), splits.get("test")

    def reward_functions_provider(self) -> Sequence[Any]:
        """The reward functions: ``--reward-funcs``'s by default. A script may return its own callables (TRL's
        signature), ``RewardFunction``s or SPEC strings."""
        return load_reward_functions(self.settings.task_options.reward_funcs or [])

    # ------------------------------------------------------------------ reference
    @property
    def reference(self) -> str:
        kind = online_reference(self.settings)
        return "adapters" if kind == "copy" and getattr(self, "adapter", None) is not None else kind

    # ------------------------------------------------------------------ the loop
    def as_prompts(self, rows: Any) -> list[Prompt]:
        """A split as ``Prompt``s: the built-in provider's are; a script's rows (dicts with a ``prompt``, every
        other key for the reward functions) are read as ``--data-path``'s are, with the model's tokenizer."""
        rows = list(rows or [])
        if not rows or isinstance(rows[0], Prompt):
            return rows
        if self.tokenizer is None:  # the script gives its own data: only the tokenizer is loaded
            self.tokenizer = load_tokenizer(self.settings.model.pretrained_model_name_or_path)
        if self.pad_id is None:
            self.pad_id = choose_pad(self.tokenizer, None, self.logger)
        check_layout(list(rows[0]))
        prompts, _ = read_prompts(rows, self.tokenizer, self.settings.preference.max_prompt_length)
        self.max_token_id = max(
            getattr(self, "max_token_id", -1), max((max(p.ids, default=-1) for p in prompts), default=-1)
        )
        return prompts

    def _train(self) -> dict[str, Any]:
        settings, o = self.settings, self.settings.task_options
        train, valid, _test, _ = split_datasets(self.train_valid_test_datasets_provider())
        self.train_prompts, self.eval_prompts_rl = self.as_prompts(train), self.as_prompts(valid)
        self.reward_functions = as_reward_functions(self.reward_functions_provider())
        self.weights = torch.tensor(reward_weights(o.reward_weights, self.reward_functions), dtype=torch.float32)
        prompts_per_rollout = settings.batching.global_batch_size // o.num_generations
        if len(self.train_prompts) < prompts_per_rollout:
            raise DataError(
                f"the training data has {len(self.train_prompts)} prompts and one rollout takes {prompts_per_rollout} "
                f"(--global-batch-size {settings.batching.global_batch_size} / --num-generations {o.num_generations})"
                "; give more prompts or a smaller global batch"
            )
        self.rollouts_per_epoch = len(self.train_prompts) // prompts_per_rollout
        self.steps_per_epoch = self.rollouts_per_epoch * o.num_iterations
        total = settings.training.epochs * self.steps_per_epoch
        if settings.training.train_iters is not None:
            total = min(total, settings.training.train_iters)
        self.setup_model(total)
        if o.use_vllm:
            self.vllm = self.vllm_sampler()
        for function in self.reward_functions:
            if hasattr(function.call, "load") and getattr(function.call, "model", True) is None:
                function.call.load(self.engine.device)
        self.begin_training()
        while self.iteration < self.total_iters:
            rollout, position = divmod(self.iteration, o.num_iterations)
            if self._rollout is None or self._rollout.index != rollout:
                self._rollout = self._restored_rollout(rollout) or self.make_rollout(rollout)
            if self._step(self.micro_batches(self._rollout, first=position == 0)):
                return self.last_evaluation
        if self.eval_prompts_rl and self.validated_at != self.iteration:
            self.evaluate("validation")
        self.finish()
        return self.last_evaluation

    def evaluations_left(self) -> int | None:
        return None  # every --eval-interval, and at the end

    # ------------------------------------------------------------------ rollouts
    @property
    def sampling(self) -> SamplingSettings:
        o = self.settings.task_options
        share = self.settings.batching.global_batch_size // self.engine.dp_size
        return SamplingSettings(
            o.max_completion_length, o.temperature, o.top_p, o.top_k, o.min_p, o.repetition_penalty,
            o.generation_batch_size or share,
        )  # fmt: skip

    def prompt_order(self, epoch: int) -> list[int]:
        """The training prompts' order in ``epoch``: a permutation seeded by the run's seed and the epoch."""
        generator = torch.Generator().manual_seed(self.settings.training.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.train_prompts), generator=generator).tolist()

    def rollout_prompts(self, rollout: int) -> list[Prompt]:
        """The prompts of ``rollout``, each repeated ``--num-generations`` times: the global batch's completions."""
        o = self.settings.task_options
        per_rollout = self.settings.batching.global_batch_size // o.num_generations
        epoch, r = divmod(rollout, self.rollouts_per_epoch)
        order = self.prompt_order(epoch)[r * per_rollout : (r + 1) * per_rollout]
        return [self.train_prompts[i] for i in order for _ in range(o.num_generations)]

    def _share(self, n: int) -> range:
        """This data-parallel rank's contiguous share of ``n`` completions (``n`` divisible by the ranks)."""
        size = n // self.engine.dp_size
        return range(self.engine.dp_rank * size, (self.engine.dp_rank + 1) * size)

    def vllm_sampler(self) -> Any:
        """``--use-vllm``: the colocated engine, built from the starting model's directory (``generation.vllm``)."""
        from rapidlite.generation import vllm

        o = self.settings.task_options
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(str(self.engine.precision.name), "auto")
        name = getattr(self, "base_name", None) or self.settings.model.pretrained_model_name_or_path
        seed = self.settings.training.seed
        llm = vllm.make_llm(name, o.vllm_gpu_memory_utilization, self.settings.data.seq_length, dtype, seed)
        self.logger.info(f"--use-vllm: a colocated vLLM engine samples the rollouts ({name}, dtype {dtype})")
        return vllm.VllmSampler(llm)

    def generate(self, prompts: Sequence[Prompt], keys: Sequence[int]) -> tuple[list[list[int]], list[bool]]:
        """Sample one completion per (prompt, key) with the policy (adapters on, eval mode, no gradients), its
        sharded parameters gathered once; with ``--use-vllm``, with the vLLM engine holding its weights."""
        if self.vllm is not None:
            if self._synced_at != self.iteration:
                sync_weights(self.vllm, self.engine.strategy, self.model)
                self._synced_at = self.iteration
            out = self.vllm.sample([p.ids for p in prompts], keys, self.sampling)
            return out.ids, out.truncated
        strategy = self.engine.strategy
        module = strategy.module(self.model)
        was_training = module.training
        module.eval()
        eos = self.eos_token_ids()
        try:
            # Under context parallelism each rank of the group samples the same whole sequences (the same keys).
            gathered = strategy.gathered_for_generation(self.model)
            with gathered, whole_sequences(module), torch.no_grad(), self.engine.autocast():
                out = sample(
                    module, [p.ids for p in prompts], keys, self.sampling, eos, self.pad_id,
                    all_finished=self.all_finished,
                )  # fmt: skip
        finally:
            module.train(was_training)
        return out.ids, out.truncated

    def all_finished(self, finished_here: bool) -> bool:
        """Whether every rank's generation batch has ended: under sharded parameters the forwards are collective,
        so the ranks stop together (a rank whose rows have ended feeds pad tokens)."""
        if self.engine.dp_size == 1 or not self.engine.strategy.shards_parameters:
            return finished_here
        return bool(self.engine.all_reduce_sum(torch.tensor(float(not finished_here))).item() == 0)

    def eos_token_ids(self) -> list[int]:
        config = getattr(self.engine.strategy.module(self.model), "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not ids:
            raise DataError("the model and tokenizer name no EOS token: completions could never end; set one")
        return ids

    def completion_texts(self, prompts: Sequence[Prompt], ids: Sequence[Sequence[int]]) -> list[Any]:
        """The completions as the reward functions receive them: text, or for a conversation prompt the
        assistant's message (TRL's convention)."""
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [
            [{"role": "assistant", "content": t}] if not isinstance(p.prompt, str) else t
            for p, t in zip(prompts, texts, strict=True)
        ]

    def rewards(
        self, prompts: Sequence[Prompt], ids: Sequence[Sequence[int]], logged: MeanMetrics
    ) -> tuple[torch.Tensor, list[Any]]:
        """This rank's completions' rewards ``[n, functions]`` (NaN: no reward from that function), and the
        completions as the functions received them."""
        completions = self.completion_texts(prompts, ids)
        columns: dict[str, list[Any]] = {}
        for p in prompts:
            for name in p.columns:
                columns.setdefault(name, [])
        for name, values in columns.items():
            values.extend(p.columns.get(name) for p in prompts)
        state = TrainerState(self.iteration, self.total_iters, self.iteration / max(self.steps_per_epoch, 1))
        table = score(
            self.reward_functions, [p.prompt for p in prompts], completions, [list(i) for i in ids], columns, state,
            lambda name, value: logged.add(name, float(value), 1.0),
        )  # fmt: skip
        return torch.tensor(table, dtype=torch.float32).reshape(len(prompts), len(self.reward_functions)), completions

    def make_rollout(self, index: int) -> Rollout:
        """Sample, reward and score rollout ``index`` (see the module's docstring)."""
        o = self.settings.task_options
        everything = self.rollout_prompts(index)
        share = self._share(len(everything))
        prompts = [everything[i] for i in share]
        keys = [completion_key(self.settings.training.seed, index, i) for i in share]
        ids, truncated = self.generate(prompts, keys)
        logged = MeanMetrics()
        local, texts = self.rewards(prompts, ids, logged)
        rewards = self.engine.dist.all_gather(local.to(self.engine.device)).cpu()
        self.write_completions(index, share, prompts, texts, ids, rewards)
        width = max(o.max_completion_length, max((len(i) for i in ids), default=0))
        completion_ids = gather_ids(self.engine, ids, width)
        rollout = Rollout(index, [p.ids for p in everything], completion_ids, torch.zeros(0))
        lengths = torch.tensor([len(c) for c in completion_ids])
        cut = self.engine.dist.all_gather(torch.tensor(truncated, dtype=torch.bool).to(self.engine.device)).cpu()
        rollout.metrics = completion_metrics(lengths, cut)
        self.score_rollout(rollout)
        advantages = self.advantages(rollout, rewards)
        rollout.advantages = advantages.advantages
        rollout.metrics.update(advantages.metrics([f.name for f in self.reward_functions]))
        rollout.metrics.update(reduced_metrics(self.engine, logged))
        return rollout

    def needs_old_logps(self) -> bool:
        return self.settings.task_options.num_iterations > 1

    def nll_weight(self) -> float:
        return 0.0  # no NLL term (DPO's RPO and ORPO have one)

    def score_rollout(self, rollout: Rollout) -> None:
        """The rollout policy's log-probabilities (when the policy moves before the rollout's last step) and the
        reference's (at ``--beta`` > 0) of every completion token, each rank scoring its share; gathered."""
        wanted = {"old_logps": self.needs_old_logps(), "ref_logps": self.settings.task_options.beta != 0.0}
        if not any(wanted.values()):
            return
        share = self._share(len(rollout.completion_ids))
        batch = self.batch_of(rollout, list(share))
        width = self.settings.task_options.max_completion_length
        module = self.engine.strategy.module(self.model)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.engine.autocast():
                for name, needed in wanted.items():
                    if not needed:
                        continue
                    parts = []
                    for rows in self._chunks(len(share)):
                        sub = {k: v[rows] for k, v in batch.items()}
                        if name == "old_logps":
                            logps = self.completion_logps(self.model, sub)[0]
                        else:
                            logps = self.reference_completion_logps(sub)
                        parts.append(logps.float())
                    local = torch.cat(parts)
                    local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
                    setattr(rollout, name, self.engine.dist.all_gather(local).cpu())
        finally:
            module.train(was_training)

    def _chunks(self, n: int) -> list[slice]:
        size = self.settings.batching.micro_batch_size
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def advantages(self, rollout: Rollout, rewards: torch.Tensor):
        o = self.settings.task_options
        return group_advantages(rewards, self.weights, o.num_generations, o.scale_rewards)

    # ------------------------------------------------------------------ micro-batches
    def batch_of(self, rollout: Rollout, rows: list[int]) -> dict[str, torch.Tensor]:
        """The rollout's ``rows`` as one padded batch on the device: prompt (left-padded) and completion
        (right-padded) as ``input_ids``, their ``attention_mask``, positions counted from each row's first real
        token, the completion mask, the advantages and the stored log-probabilities."""
        o = self.settings.task_options
        padded = rollout_batch(
            [rollout.prompt_ids[r] for r in rows], [rollout.completion_ids[r] for r in rows], self.eos_token_ids(),
            self.pad_id, o.mask_truncated_completions,
        )  # fmt: skip
        # Attention covers every sampled token; the loss only the completion mask's (--mask-truncated-completions).
        mask = torch.cat([padded.prompt_mask, real_tokens(padded)], dim=1)
        batch = {
            "input_ids": torch.cat([padded.prompt_ids, padded.completion_ids], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "completion_mask": padded.completion_mask,
            "advantages": rollout.advantages[rows] if rollout.advantages.numel() else torch.zeros(len(rows)),
        }
        width = padded.completion_ids.shape[1]
        for name in ("old_logps", "ref_logps"):
            value = getattr(rollout, name)
            if value is not None:
                batch[name] = value[rows, :width]
        return {k: v.to(self.engine.device) for k, v in batch.items()}

    def micro_batches(self, rollout: Rollout, first: bool) -> list[dict[str, torch.Tensor]]:
        """This rank's share of the rollout in micro-batches; the rollout's metrics go with its first step."""
        if first:
            for name, value in rollout.metrics.items():
                self.monitor.step_metrics.add(name, value, 1.0)
        share = list(self._share(len(rollout.completion_ids)))
        return [self.batch_of(rollout, share[rows]) for rows in self._chunks(len(share))]

    # ------------------------------------------------------------------ forward
    def completion_logps(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each completion token's log-probability ``[B, C]`` at the sampling temperature, and its entropy."""
        chunked, temperature = self.settings.model.chunked_loss, self.settings.task_options.temperature
        return completion_logps(model, batch, chunked, temperature, self.engine.dist.cp_group)

    def reference_completion_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.ref_model is not None:
            return self.completion_logps(self.ref_model, batch)[0]
        with self.reference_mode(self.model):
            return self.completion_logps(self.model, batch)[0]

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        """What this micro-batch adds to the global batch's denominator (``rl_losses.loss_denominator``)."""
        o = self.settings.task_options
        rows = batch["completion_mask"].shape[0]
        return {
            "grpo": rows,
            "dapo": int(batch["completion_mask"].sum()),
            "dr_grpo": rows * o.max_completion_length,
            "bnpo": 1,
        }[o.loss_type]

    def clip_settings(self) -> ClipSettings:
        o = self.settings.task_options
        return ClipSettings(
            o.loss_type, o.importance_sampling_level, o.epsilon, o.epsilon_high, o.delta, o.beta,
            o.use_bias_correction_kl,
        )  # fmt: skip

    def run_forward_step(self, batch, model):
        mask = batch["completion_mask"]
        logps, entropy = self.completion_logps(model, batch)
        clip = self.clip_settings()
        terms = policy_terms(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask, clip)
        numerator = loss_numerator(terms.per_token_loss, mask, clip.loss_type)
        self.record_policy_metrics(terms, entropy, mask)
        return numerator, self.count_items(batch)

    def record_policy_metrics(self, terms, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's per-step metrics as global masked means: entropy, kl, and the clipped shares of the ratios."""
        sink = self.monitor.step_metrics
        sink.add("entropy", *masked_sums(entropy, mask))
        if terms.per_token_kl is not None:
            sink.add("kl", *masked_sums(terms.per_token_kl.detach(), mask))
        sink.add("clip_ratio/low_mean", *masked_sums(terms.low_clipped.float(), mask))
        sink.add("clip_ratio/high_mean", *masked_sums(terms.high_clipped.float(), mask))
        sink.add("clip_ratio/region_mean", *masked_sums(terms.region_clipped.float(), mask))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, split: str = "validation") -> dict[str, Any]:
        """The validation prompts, each sampled ``--num-generations`` times with fixed random streams, rewarded:
        the mean reward and its spread, each function's mean, the completions' lengths."""
        prompts = self.eval_prompts_rl if split == "validation" else []
        if not prompts:
            return {}
        o = self.settings.task_options
        everything = [p for p in prompts for _ in range(o.num_generations)]
        n, ranks = len(everything), self.engine.dp_size
        per_rank = -(-n // ranks)
        start = self.engine.dp_rank * per_rank
        rows = [min(i, n - 1) for i in range(start, start + per_rank)]  # the last rank's tail repeats the end
        keys = [completion_key(self.settings.training.seed, EVAL_ROLLOUT, i) for i in rows]
        mine = [everything[i] for i in rows]
        ids, truncated = self.generate(mine, keys)
        logged = MeanMetrics()
        rewards = self.engine.dist.all_gather(self.rewards(mine, ids, logged)[0].to(self.engine.device)).cpu()[:n]
        logged_means = reduced_metrics(self.engine, logged)
        lengths = self.engine.dist.all_gather(torch.tensor([len(i) for i in ids]).to(self.engine.device)).cpu()[:n]
        cut = self.engine.dist.all_gather(torch.tensor(truncated).to(self.engine.device)).cpu()[:n]
        advantages = group_advantages(rewards, self.weights, o.num_generations, "group")
        metrics = advantages.metrics([f.name for f in self.reward_functions])
        metrics.update(completion_metrics(lengths, cut))
        metrics.update(logged_means)
        self.validated_at = self.iteration
        return self.log_evaluation(split, metrics, epoch=round(self.iteration / max(self.steps_per_epoch, 1), 4))

    # ------------------------------------------------------------------ completions.jsonl
    def write_completions(self, rollout: int, share: range, prompts: Sequence[Prompt], texts, ids, rewards) -> None:
        """At each log interval, the global batch's first completions with their rewards (``rewards``: the whole
        batch's): ``completions.jsonl`` and the trackers' table (``rollout_state.write_completions``)."""
        step = self.iteration + 1
        if step % self.log_every and step != 1:
            return
        names = [f.name for f in self.reward_functions]
        mine = [i for i in share if i < COMPLETIONS_LOGGED]
        rows = [
            completion_row(step, rollout, prompts[i - share.start], texts[i - share.start],
                           len(ids[i - share.start]), rewards[i], self.weights, names)
            for i in mine
        ]  # fmt: skip
        write_completions(self.engine, self.settings.checkpoint.save, self.monitor.trackers, rows, step)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loop's position; mid-rollout (``--num-iterations`` > 1), the rollout too, so that a resumed run
        trains on the completions the stopped run sampled."""
        state = super().state_dict()
        o = self.settings.task_options
        if self._rollout is not None and self.iteration % o.num_iterations:
            state["rollout"] = self._rollout.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._restored = state.get("rollout")

    def _restored_rollout(self, index: int) -> Rollout | None:
        restored, self._restored = self._restored, None
        if restored is not None and restored["index"] == index:
            return Rollout.from_state(restored)
        return None


def trainer_for(settings: Sections) -> type[GRPOFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return GRPOFinetuner
