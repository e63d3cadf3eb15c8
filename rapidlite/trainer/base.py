"""What ``Finetuner`` and ``PreTrainer`` share: the hooks, one training step, logging, checkpoints.

One optimizer step (``train_step``) runs the micro-batches of one global batch: each forward step
returns either a mean loss (the engine averages over micro-batches) or ``(loss_sum, num_items)``
(the engine divides the summed gradients by the items of the whole global batch, so accumulation
over padded, variable-length micro-batches equals one big batch exactly).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from rapidlite import config_file, distributed, preemption, time_budget
from rapidlite.arguments import build_parser
from rapidlite.checkpoint import layout, rng, selection
from rapidlite.data.collate import PadCollator
from rapidlite.data.loader import DeviceDataLoader, batch_stats, require_map_style
from rapidlite.engine import RapidliteEngine
from rapidlite.errors import DataError, RapidliteError, TrainingDiverged, first_line
from rapidlite.graph import compiled_graphs
from rapidlite.logging import MetricsWriter, format_record, peak_memory_bytes
from rapidlite.models import lora
from rapidlite.plot import PlotUnavailable, write_curves
from rapidlite.progress import Bar, hf_transformers_progress, progress_bar
from rapidlite.tracking import WandbRun


class CountingIterator:
    """Wraps a data iterator handed to ``run_forward_step`` and counts the samples/tokens drawn."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator
        self.samples = 0
        self.tokens = 0
        self.tokens_known = True
        self._replay: collections.deque[Any] = collections.deque()
        self._recording: list[Any] | None = None

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        if self._replay:  # a pipeline replays a forward step on the batches it drew before (not counted again)
            return self._replay.popleft()
        batch = next(self.iterator)
        if self._recording is not None:
            self._recording.append(batch)
        samples, tokens = batch_stats(batch)
        self.samples += samples
        if tokens is None:
            self.tokens_known = False
        else:
            self.tokens += tokens
        return batch

    def take_counts(self) -> tuple[int, int | None]:
        counts = (self.samples, self.tokens if self.tokens_known else None)
        self.samples, self.tokens, self.tokens_known = 0, 0, True
        return counts

    def replayable(self, step: Callable[[], Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """``(record, replay)`` for pipeline parallelism: ``record()`` runs ``step`` and keeps the batches it
        drew; ``replay()`` runs it again on those same batches."""
        drawn: list[Any] = []

        def record() -> Any:
            self._recording = drawn
            try:
                return step()
            finally:
                self._recording = None

        def replay() -> Any:
            self._replay.extend(drawn)
            try:
                return step()
            finally:
                self._replay.clear()

        return record, replay


class BaseTrainer:
    """The hooks a subclass implements, and the machinery both templates share."""

    # Fine-tuning batches vary in length (--torch-compile then compiles shape-generic code); pretraining
    # samples have one length.
    variable_length_batches: bool | None = None

    def __init__(self, engine: RapidliteEngine | None = None) -> None:
        self.engine = engine if engine is not None else RapidliteEngine()
        self.args = self.engine.args
        self.logger = self.engine.logger
        self.timers = self.engine.timers
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer: Any = None  # set it to have the tokenizer exported with a Hugging Face model
        self.iteration = 0
        self.consumed_samples = 0
        self.total_iters = 0
        # The run's log and evaluation intervals: the flags', unless --time-budget spaces them over its length.
        self.log_every: int = self.args.log_interval
        self.eval_every: int | None = self.args.eval_interval
        self._metrics: MetricsWriter | None = None
        self._interval = self._new_interval()
        self._last_saved = -1
        self._progress: Bar | None = None
        self.last_evaluation: dict[str, Any] = {}
        self._resume_rng: dict[str, Any] | None = None
        self._state_bytes_logged = False
        self._first_step_start: float | None = None  # set when training begins; reports the compile step
        self._graphs = 0  # graphs torch.compile had built after the first step (recompiles are logged)
        self._skip_streak = 0  # consecutive steps skipped for NaN/inf (see _watch_divergence)
        # On every line of metrics.jsonl, so records of two runs in one file stay apart.
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(2).hex()
        self._stop_signals = preemption.StopSignals()
        self._wandb_resume_id: str | None = None  # the W&B run of the checkpoint this run resumes
        self._saved_config: str | None = None  # iter_N/config.yaml: the settings, loadable with --config
        self._step_clock: float | None = None  # --time-budget: when the last step's bookkeeping ended
        self._timed_steps: list[float] = []  # --time-budget: the timed steps' seconds (None once sized)
        self._eval_seconds: float | None = None  # the last evaluation's seconds

    # ------------------------------------------------------------------ hooks
    def train_valid_test_datasets_provider(self, *args: Any) -> tuple:
        """Return ``(train, valid, test)`` datasets, optionally followed by a ``collate_fn``.
        ``valid`` and ``test`` may be None."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_valid_test_datasets_provider")

    def model_optimizer_lr_scheduler_provider(self) -> tuple:
        """Return ``(model, optimizer, lr_scheduler)``; None for the optimizer or scheduler means
        "build it from the flags". The scheduler may also be a factory called with the optimizer."""
        raise NotImplementedError(f"{type(self).__name__} must implement model_optimizer_lr_scheduler_provider")

    def run_forward_step(self, batch_or_iterator: Any, model: torch.nn.Module) -> Any:
        """Return a scalar loss (mean over the micro-batch) or ``(loss_sum, num_items)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement run_forward_step")

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The provider's model as the loop will train it, before ``engine.compose`` wraps it (the default: as it
        is). A ``Finetuner`` fits it for ``--padding-free`` batches here."""
        return model

    # ------------------------------------------------------------------ helpers for subclasses
    def pretrained_load_kwargs(self) -> dict[str, Any]:
        """``from_pretrained`` arguments for the model to fine-tune: fp32 weights for full fine-tuning; with
        ``--lora-rank`` the frozen base in the compute dtype, quantised while it loads under
        ``--load-in-4bit``/``--load-in-8bit`` (``rapidlite.models.lora.load_kwargs``)."""
        return lora.load_kwargs(self.engine.lora, self.engine.precision.dtype, self.engine.device)

    def build_data_loader(
        self,
        dataset: Any,
        micro_batch_size: int | None = None,
        *,
        shuffle: bool = True,
        collate_fn: Callable | None = None,
        pad: bool | None = None,
        lengths: Sequence[int] | None = None,
    ) -> DeviceDataLoader:
        """A loader that shards ``dataset`` over data-parallel ranks and moves batches to the device. Without a
        ``collate_fn``, tokenized rows are padded to the batch's longest (with ``self.tokenizer``'s pad id when
        it is set, else 0) and given an attention mask if they have none. ``lengths`` (tokens per sample): a
        training loader's shuffle is grouped by length (``--group-by-length``)."""
        if collate_fn is None:
            collate_fn = self.default_collate()
        return self.engine.build_data_loader(
            dataset, micro_batch_size, shuffle=shuffle, collate_fn=collate_fn, pad=pad, lengths=lengths
        )

    def default_collate(self) -> PadCollator:
        """The collation of a loader given no ``collate_fn``: rows padded with the tokenizer's pad id (else 0)."""
        return PadCollator.for_tokenizer(self.tokenizer) if self.tokenizer is not None else PadCollator()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` over data-parallel ranks (for metrics)."""
        return self.engine.gather(tensor)

    @property
    def show_progress(self) -> bool:
        """Whether this process draws progress bars (for data preparation too): the main process, unless
        ``--no-progress``; a bar still needs a terminal (``rapidlite.progress``)."""
        return self.engine.is_main_process and not getattr(self.args, "no_progress", False)

    def progress_bar(
        self, total: int | None, desc: str, unit: str = "it", leave: bool = True, initial: int = 0
    ) -> Bar | None:
        """A progress bar with rate and ETA on the main process's terminal, else None."""
        return progress_bar(total, desc=desc, unit=unit, leave=leave, initial=initial, enabled=self.show_progress)

    # ------------------------------------------------------------------ setup
    def setup_model(self, total_iters: int) -> None:
        self.total_iters = total_iters
        resume = self.args.load is not None and not self.args.load_is_pretrained_model
        if self.args.load_is_pretrained_model:
            self.logger.info(
                f"--load {self.args.load} holds a Hugging Face model, not a rapidlite checkpoint: the model provider "
                "loads it (from_pretrained(args.load)); nothing is resumed"
            )
        if resume:
            self.engine.strategy.prepare_resume(self.args.load)
        with hf_transformers_progress(self.show_progress):  # from_pretrained's bars: on a terminal only
            model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        model = self.prepare_model(model)
        # --eval-only (0 iterations) builds a schedule it never steps; one needs a length.
        self.model, self.optimizer, self.lr_scheduler = self.engine.compose(
            model, optimizer, scheduler, total_iters=max(total_iters, 1), dynamic_shapes=self.variable_length_batches
        )
        if resume:
            self.load_checkpoint()
        if self.engine.is_main_process:
            if getattr(self.args, "overwrite_save", False):
                removed = layout.clear_run(self.args.save)
                self.logger.info(f"--overwrite: removed the earlier run in {self.args.save} ({removed})")
            self._metrics = MetricsWriter(
                self.args.save, self.args.tensorboard_dir, run_id=self.run_id, wandb=self._start_wandb()
            )
            if self.args.save is not None:
                parser = build_parser(self.engine.extra_args_provider)
                header = "this run's settings: 'rapidlite --config config.yaml' repeats them (flags given with it win)"
                self._saved_config = config_file.dump(self.args, parser, header)
        self.engine.barrier()
        strategy = self.engine.strategy
        n_params = strategy.parameter_count(self.model)
        a = self.args
        self.logger.info(
            f"model: {model_class_name(strategy.module(self.model))}, {n_params / 1e6:.2f}M parameters | "
            f"device: {self.engine.device} | "
            f"precision: {self.engine.precision.name} | micro batch {a.micro_batch_size} x accumulation "
            f"{a.gradient_accumulation_steps} x data-parallel {a.data_parallel_size} = global batch "
            f"{a.global_batch_size} | iterations: {total_iters if not a.eval_only else 'none (--eval-only)'}"
            + (f" (resuming at {self.iteration})" if self.iteration else "")
            + f" | run id {self.run_id}"
        )

    def _start_wandb(self) -> WandbRun | None:
        """``--wandb-project``: the W&B run of this training (the resumed checkpoint's, if it kept one)."""
        if self.args.wandb_project is None:
            return None
        run = WandbRun.start(self.args, config_file.plain_settings(self.args), self._wandb_resume_id)
        continued = " (continued: the checkpoint's run)" if self._wandb_resume_id == run.id else ""
        self.logger.info(f"Weights & Biases: run {run.id} in project {self.args.wandb_project}{continued}")
        return run

    @contextlib.contextmanager
    def closing_outputs(self) -> Iterator[None]:
        """Around ``train()``: when training fails, the metrics outputs are closed all the same, and a W&B run is
        finished with the exit code the process will have."""
        try:
            yield
        except BaseException as e:
            if self._metrics is not None:
                code = getattr(e, "exit_code", 130 if isinstance(e, KeyboardInterrupt) else 1)
                with contextlib.suppress(Exception):  # the training's error is the one to report
                    self._metrics.close(code if isinstance(code, int) else 1)
            raise
        finally:
            # A run that ended by an exception leaves no flag-only SIGTERM handler behind in a longer-lived
            # process (a notebook, a test session), whose children (a Pool's workers) would then ignore SIGTERM.
            self._stop_signals.restore()

    # ------------------------------------------------------------------ one step
    def train_step(self, micro_steps: Iterable[Callable[[], Any]]) -> bool:
        """Run the forward/backward of each micro-batch, then one optimizer step. Returns whether the
        step was applied (False: skipped for an fp16 overflow).

        Gradients are reduced over data-parallel ranks only with the last micro-batch. A mean loss is
        averaged over micro-batches (and ranks); ``(loss_sum, num_items)`` gradients are divided by the
        items of the whole global batch, counted over all ranks."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, divisor = self.engine.strategy.forward_backward(self.model, self.optimizer, list(micro_steps))
        return self._apply_step(loss_total, divisor)

    def _apply_step(self, loss_total: torch.Tensor, divisor: float) -> bool:
        nonfinite_before = self.optimizer.nonfinite_steps
        applied = self.optimizer.step(grad_divisor=divisor, loss=loss_total)
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.iteration += 1
        self._watch_divergence(applied, self.optimizer.nonfinite_steps > nonfinite_before)
        interval = self._interval
        # Out of place: the zero-dim start tensor takes the loss's device, so no per-step host sync.
        interval["loss"] = interval["loss"] + loss_total / divisor
        interval["steps"] += 1
        interval["skipped"] += 0 if applied else 1
        return applied

    def _watch_divergence(self, applied: bool, nonfinite: bool) -> None:
        """Count consecutive steps that could not be applied: NaN/inf losses or gradients, and fp16 overflows once
        the loss scale is at its minimum (before that, skipping is how the scaler finds its scale). After
        ``--max-skipped-steps`` of them the run stops (``TrainingDiverged``, exit code 3), with nothing saved."""
        scaler = self.optimizer.loss_scaler
        stuck = not applied and scaler is not None and scaler.scale <= scaler.min_scale
        if applied or not (nonfinite or stuck):
            self._skip_streak = 0
            return
        self._skip_streak += 1
        limit = self.args.max_skipped_steps
        if self._skip_streak == 1 and self.engine.is_main_process:
            what = "non-finite loss or gradients" if nonfinite else "fp16 overflow at the minimum loss scale"
            self.logger.warning(
                f"iteration {self.iteration}: {what}; step skipped, weights unchanged (the run stops after "
                f"{limit} such steps in a row: --max-skipped-steps)"
            )
        if limit and self._skip_streak >= limit:
            first = self.iteration - self._skip_streak + 1
            raise TrainingDiverged(
                f"the loss or the gradients were NaN/inf for {self._skip_streak} steps in a row (iterations "
                f"{first}-{self.iteration}): stopped without saving them; {self._last_good_checkpoint()} (lower "
                "--lr, clip gradients with --clip-grad, or use bf16 instead of fp16)"
            )

    def _last_good_checkpoint(self) -> str:
        if self.args.save is None:
            return "no --save directory"
        if self._last_saved >= 0:
            return f"the last checkpoint is iteration {self._last_saved} in {self.args.save}"
        return f"no checkpoint was written to {self.args.save}"

    def _weights_finite(self) -> bool:
        """Whether every rank's weights are finite (checked before each save: a cheap pass next to the write)."""
        module = self.engine.strategy.module(self.model)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
        checks = [torch.isfinite(t).all() for t in local if t.is_floating_point() and t.numel()]
        if not checks:
            return True
        ok = torch.stack([c.to(checks[0].device) for c in checks]).all().float().reshape(1)
        return bool(distributed.all_reduce_world(1 - ok, op="max").item() == 0)

    # ------------------------------------------------------------------ logging
    @staticmethod
    def _new_interval() -> dict[str, Any]:
        return {
            "loss": torch.zeros(()),
            "steps": 0,
            "skipped": 0,
            "samples": 0,
            "tokens": 0,
            "tokens_known": True,
            "start": time.perf_counter(),
        }

    def count_batch(self, samples: int, tokens: int | None) -> None:
        """Record the data a step consumed (this rank's), for throughput and ``consumed_samples``."""
        interval = self._interval
        interval["samples"] += samples
        if tokens is None:
            interval["tokens_known"] = False
        else:
            interval["tokens"] += tokens

    def after_step(self, samples_this_step: int) -> None:
        """Bookkeeping after each optimizer step: consumed samples, logging, evaluation, checkpoints."""
        self.consumed_samples += samples_this_step * self.engine.dp_size
        if self._step_clock is not None:
            self._time_step(time.perf_counter() - self._step_clock)
        if self._progress is not None:
            self._progress.update(1)
        if self._first_step_start is not None:
            # The first step compiles (--torch-compile): its time is reported on its own line.
            if self.args.torch_compile and self.engine.is_main_process:
                seconds = time.perf_counter() - self._first_step_start
                self.logger.info(f"torch.compile: the first step took {seconds:.1f} s including compilation")
                self._graphs = compiled_graphs()
            self._first_step_start = None
        elif self.args.torch_compile and self.engine.is_main_process:
            self._log_recompiles()
        if not self._state_bytes_logged:
            self.log_model_state_bytes()
        if self.iteration % self.log_every == 0 or self.iteration == self.total_iters:
            self.log_interval()
        if self.eval_every and self.iteration % self.eval_every == 0:
            start = time.perf_counter()
            self.evaluate("validation")
            self._eval_seconds = time.perf_counter() - start
        # Not while steps are being skipped for NaN/inf: latest stays at the last step that trained.
        if self.args.save_interval and self.iteration % self.args.save_interval == 0 and not self._skip_streak:
            self.save_checkpoint()
        if self._step_clock is not None:
            self._step_clock = time.perf_counter()  # the next step's time excludes this bookkeeping

    def _log_recompiles(self) -> None:
        """A graph built after the first step is a recompilation (new shapes or modes): said in one line, so
        a run that keeps recompiling is seen, not just slow."""
        graphs = compiled_graphs()
        if graphs > self._graphs:
            self.logger.info(
                f"torch.compile: {graphs - self._graphs} more graph{'s' if graphs - self._graphs > 1 else ''} "
                f"compiled by iteration {self.iteration} ({graphs} in all: new input shapes or modes)"
            )
            self._graphs = graphs

    def log_model_state_bytes(self) -> None:
        """Once, after the first step (optimizer state exists then): this rank's bytes of parameters,
        gradients and optimizer state, so what ZeRO/FSDP shards is visible."""
        self._state_bytes_logged = True
        strategy = self.engine.strategy
        sizes = strategy.model_state_bytes(self.model, self.optimizer)
        record = {"split": "model_state", "iteration": self.iteration, "strategy": strategy.name, **sizes}
        self.logger.info(
            f"model state on rank {self.engine.rank} ({strategy.name}): "
            + ", ".join(f"{k.replace('_bytes', '')} {v / 2**20:.2f} MiB" for k, v in sizes.items())
        )
        if self._metrics is not None:
            self._metrics.write(record, "model_state")

    def log_interval(self) -> None:
        interval = self._interval
        if interval["steps"] == 0:
            return
        elapsed = time.perf_counter() - interval["start"]
        # One reduction per log interval: loss, samples and tokens over the data-parallel ranks.
        # A rank that cannot count tokens makes the sum negative: tokens/s is then left out.
        tokens = interval["tokens"] if interval["tokens_known"] else -1e30
        totals = self.engine.all_reduce_sum(
            torch.stack(
                [
                    interval["loss"].double().cpu(),
                    torch.tensor(float(interval["samples"]), dtype=torch.float64),
                    torch.tensor(float(tokens), dtype=torch.float64),
                ]
            )
        )
        loss, samples, tokens = totals.tolist()
        grad_norm = self.optimizer.last_grad_norm
        record: dict[str, Any] = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "loss": loss / self.engine.dp_size / interval["steps"],
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "loss_scale": self.optimizer.loss_scale,
            "skipped_steps": self.optimizer.skipped_steps,
            "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed if tokens >= 0 else None,
            "step_time_s": elapsed / interval["steps"],
            **self._flops_rates(samples, tokens, elapsed),
            "peak_memory_mb": peak_memory_bytes(self.engine.device) / 2**20,
        }
        record = {k: v for k, v in record.items() if v is not None}
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.3g}", refresh=False)
        self.logger.info(format_record(record))
        if self._metrics is not None:
            self._metrics.write(record, "train")
        self._interval = self._new_interval()

    def _flops_rates(self, samples: float, tokens: float, elapsed: float) -> dict[str, float]:
        """Model TFLOP/s per device and MFU, from the interval's tokens (summed over data-parallel ranks) and
        their mean length per sequence (the attention term); every device shares the work."""
        flops = self.engine.model_flops
        if flops is None or tokens <= 0 or samples <= 0:
            return {}
        per_device = flops.per_token(tokens / samples) * tokens / elapsed / self.engine.world_size
        rates = {"tflops_per_device": per_device / 1e12}
        if self.engine.peak_flops:
            rates["mfu"] = per_device / self.engine.peak_flops
        return rates

    def log_evaluation(self, split: str, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
        record = {"split": split, "iteration": self.iteration, **extra, **metric_values(metrics)}
        self.logger.info(f"evaluation ({split}) | " + format_record({k: v for k, v in record.items() if k != "split"}))
        if self._metrics is not None:
            self._metrics.write(record, split)
        if split == "validation":
            self.last_evaluation = record
        return record

    def evaluate(self, split: str) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def save_checkpoint(self) -> None:
        """Every rank writes its shards (a collective); rank 0 the trainer, schedule and scaler state."""
        if self.args.save is None or self._last_saved == self.iteration:
            return
        if not self._weights_finite():
            raise TrainingDiverged(
                f"iteration {self.iteration}: the weights hold NaN/inf, so no checkpoint is written; "
                f"{self._last_good_checkpoint()} (lower --lr, clip gradients with --clip-grad)"
            )
        state: dict[str, Any] = {"trainer": self.trainer_state(), "skipped_steps": self.optimizer.skipped_steps}
        if self._metrics is not None and self._metrics.wandb is not None:
            state["wandb_run_id"] = self._metrics.wandb.id  # a run resumed from here continues it
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.optimizer.loss_scaler is not None:
            state["loss_scaler"] = self.optimizer.loss_scaler.state_dict()
        files = {config_file.FILE_NAME: self._saved_config} if self._saved_config is not None else None
        path = self.engine.strategy.save_checkpoint(
            self.args.save, self.iteration, self.model, self.optimizer, state, not self.args.no_save_optim, files
        )
        self.logger.info(f"saved checkpoint {path}")
        self._last_saved = self.iteration
        if self.args.keep_last:
            for old in selection.prune_checkpoints(self.args.save, self.args.keep_last, self.iteration):
                self.logger.info(f"--keep-last {self.args.keep_last}: deleted {old}")

    def load_checkpoint(self) -> None:
        args = self.args
        iteration, state = self.engine.strategy.load_checkpoint(
            args.load,
            self.model,
            self.optimizer,
            with_optimizer=not (args.finetune or args.no_load_optim),
            weights_only=args.finetune,
        )
        if args.finetune:
            self.logger.info(f"loaded weights of iteration {iteration} from {args.load}; starting at iteration 0")
            return
        trainer = state["trainer"]
        self._wandb_resume_id = state.get("wandb_run_id")
        self.iteration = int(trainer["iteration"])
        self.consumed_samples = int(trainer["consumed_samples"])
        self._last_saved = self.iteration
        if state["optimizer_loaded"]:
            self.optimizer.skipped_steps = int(state.get("skipped_steps", 0))
            if "loss_scaler" in state and self.optimizer.loss_scaler is not None:
                self.optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
        if "lr_scheduler" in state and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        elif self.lr_scheduler is not None and hasattr(self.lr_scheduler, "num_steps"):
            self.lr_scheduler.num_steps = self.iteration  # keep the schedule where the run was
            self.lr_scheduler.step(0)
        if not args.no_load_rng:
            self._resume_rng = state["rng"]
        self.logger.info(f"resumed from {args.load} at iteration {self.iteration}")

    def finish(self) -> None:
        """Final checkpoint, Hugging Face export (gathered on rank 0), close outputs."""
        if self._progress is not None:
            self._progress.close()
        if self.args.save is not None:
            self.save_checkpoint()
            with hf_transformers_progress(self.show_progress):  # save_pretrained's bars: on a terminal only
                out = self.engine.strategy.export(self.model, f"{self.args.save}/hf", self.tokenizer)
            if out is not None:
                self.logger.info(f"exported Hugging Face model to {out}")
        if self._metrics is not None:
            self._metrics.close()
            self.plot_curves()
        self._stop_signals.restore()  # a signal during the final save was ignored: the run is complete

    def plot_curves(self) -> None:
        """``--save DIR/curves.png`` from ``DIR/metrics.jsonl`` (rank 0, at the end of a run). A finished run
        never fails here: without matplotlib, or when drawing fails, one line says so."""
        if self.args.save is None or not self.engine.is_main_process:
            return
        try:
            path = write_curves(self.args.save)
        except PlotUnavailable as e:
            self.logger.info(f"no {self.args.save}/curves.png: {e}")
        except Exception as e:  # a plotting problem is not the run's
            self.logger.warning(f"could not draw {self.args.save}/curves.png: {first_line(e)}")
        else:
            self.logger.info(f"loss, learning rate and throughput curves: {path}")

    # ------------------------------------------------------------------ --time-budget
    def estimated_eval_seconds(self, step_s: float) -> float:
        """One evaluation's seconds before any was timed (a forward is about a third of a training step)."""
        return step_s / 3

    def evaluations_left(self) -> int | None:
        """Evaluations still to come whatever the run's length (an epoch-based run's); None: they follow its
        length (every --eval-interval)."""
        return None

    def _time_step(self, seconds: float) -> None:
        if self.iteration - 1 <= self._first_iteration:  # the first step warms up (and compiles): not timed
            return
        self._timed_steps.append(seconds)
        if len(self._timed_steps) >= time_budget.TIMED_STEPS:
            self._size_to_budget()

    def _size_to_budget(self) -> None:
        """Set the run's length to the iterations that fit the rest of --time-budget (``rapidlite.time_budget``).
        Every rank decides from the slowest rank's numbers, so all agree."""
        args = self.args
        step_s = sorted(self._timed_steps)[len(self._timed_steps) // 2]
        elapsed = time.time() - time_budget.command_start()
        measured = torch.tensor([step_s, elapsed], dtype=torch.float64, device=self.engine.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
        step_s, elapsed = (float(x) for x in measured.cpu())
        given = getattr(args, "explicit_flags", None)  # None: settings built by hand, every value counts as given
        demo = getattr(args, "demo_defaults", frozenset())
        user_given = set(vars(args)) if given is None else given - demo
        sized_evaluations = self.evaluations_left() is None and "eval_interval" not in user_given
        eval_s = self._eval_seconds if self._eval_seconds is not None else self.estimated_eval_seconds(step_s)
        plan = time_budget.fit(
            budget_s=args.time_budget * 60,
            elapsed_s=elapsed,
            done_iters=self.iteration,
            step_s=step_s,
            max_iters=self.total_iters,
            eval_s=eval_s,
            eval_interval=self.eval_every,
            fixed_evaluations=self.evaluations_left(),
            size_eval_interval=sized_evaluations,
            size_log_interval="log_interval" not in user_given,
        )
        timed = len(self._timed_steps)
        self._step_clock, self._timed_steps = None, []
        self.total_iters = plan.total_iters
        if plan.eval_interval is not None:
            self.eval_every = plan.eval_interval
        if plan.log_interval is not None:
            self.log_every = plan.log_interval
        resize = getattr(self.lr_scheduler, "resize", None)
        if resize is not None and args.lr_decay_iters is None:
            warmup = None
            if "lr_warmup_iters" not in user_given and args.lr_warmup_iters:
                warmup = min(args.lr_warmup_iters, max(plan.total_iters // 4, 1))  # a demo's warmup fits its length
            resize(plan.total_iters, warmup_steps=warmup, warmup_fraction=args.lr_warmup_fraction)
        if self._progress is not None:
            self._progress.total = plan.total_iters
            self._progress.refresh()
        ends = time.strftime("%H:%M:%S", time.localtime(time.time() + plan.seconds_left))
        bound = " (the upper bound: it fits with time to spare)" if plan.capped else ""
        if elapsed + plan.seconds_left > args.time_budget * 60 * 1.05:
            bound = " (the budget is spent: this machine is slower than it allows; raise --time-budget)"
        self.logger.info(
            f"--time-budget {args.time_budget:g} min: {timed} steps timed at "
            f"{step_s:.2f} s, {time_budget.describe(elapsed / 60)} used: training {plan.total_iters} iterations"
            f"{bound}, about {time_budget.describe(plan.seconds_left / 60)} more (until {ends})"
        )

    def begin_training(self) -> None:
        """Called once everything is built, right before the first step."""
        if self._resume_rng is not None:
            # Restored last, so nothing built after loading (data iterators, workers) shifts the RNG streams.
            rng.set_rng_state(self._resume_rng)
            self._resume_rng = None
        self._progress = self.progress_bar(self.total_iters, "train", initial=self.iteration)
        self._first_iteration = self.iteration
        # The first interval's rates count from here, not from the set-up (data, model, checkpoint loading).
        self._interval["start"] = time.perf_counter()
        self._first_step_start = time.perf_counter()
        self._stop_signals.install()
        budget = getattr(self.args, "time_budget", None)
        if budget is not None and self.iteration < self.total_iters:
            self._step_clock = time.perf_counter()
            elapsed = time.time() - time_budget.command_start()
            self.logger.info(
                f"--time-budget {budget:g} min: {time_budget.describe(elapsed / 60)} used so far; the run is sized "
                f"after {time_budget.TIMED_STEPS} timed steps to end within the budget (at most {self.total_iters} "
                "iterations)"
            )

    def exit_if_due(self) -> bool:
        """Megatron's ``--exit-interval N`` (after an iteration divisible by N) and ``--exit-duration-in-mins M``
        (after the first step ending M minutes after the command's start; every rank stops after the same one):
        called by the loops after each optimizer step. When due, the checkpoint is saved (with --save), one line
        says how to resume, and it returns True: the loop returns without the final evaluation and export, and
        the process ends with exit code 0. The run's own last iteration is never cut short here."""
        args = self.args
        interval = getattr(args, "exit_interval", None)
        minutes = getattr(args, "exit_duration_in_mins", None)
        if (interval is None and minutes is None) or self.iteration >= self.total_iters:
            return False
        reason = None
        if interval is not None and self.iteration % interval == 0:
            reason = f"--exit-interval {interval}"
        late = minutes is not None and (time.time() - time_budget.command_start()) / 60 >= minutes
        if minutes is not None and preemption.max_over_ranks(int(late), self.engine.device):
            reason = reason or f"--exit-duration-in-mins {minutes:g}"
        if reason is None:
            return False
        self.log_interval()
        if self._progress is not None:
            self._progress.close()
        if args.save is not None:
            self.save_checkpoint()
            self.engine.barrier()
            how = f"saved a checkpoint in {args.save}; the same command with --load {args.save} continues it"
        else:
            how = "nothing saved (no --save): a rerun starts over"
        self.logger.info(f"{reason}: stopped after iteration {self.iteration} of {self.total_iters} and {how}")
        if self._metrics is not None:
            self._metrics.close()
            self.plot_curves()
        self._stop_signals.restore()
        return True

    def stop_if_signalled(self) -> None:
        """Called by the loops after each optimizer step. When SIGTERM or SIGUSR1 reached any rank, every rank
        stops here, after the same iteration: the checkpoint is saved (with --save), one line says how to resume,
        and the process ends with exit code 143 (``rapidlite.preemption``). Returns when no signal came."""
        signum = self._stop_signals.agreed(self.engine.device)
        if not signum:
            return
        self.log_interval()  # the steps since the last logged interval (none when they were just logged)
        if self._progress is not None:
            self._progress.close()
        save = self.args.save
        if save is not None:
            self.save_checkpoint()
            self.engine.barrier()  # no rank ends (and gets its peers stopped) before every shard is written
            how = f"saved a checkpoint in {save}; the same command with --save {save} --load {save} resumes it"
        else:
            how = "nothing saved (no --save): a rerun starts over"
        self.logger.info(
            f"{preemption.signal_name(signum)}: stopped after iteration {self.iteration} of {self.total_iters} and "
            f"{how} (exit code {preemption.EXIT_CODE})"
        )
        if self._metrics is not None:
            self._metrics.close(preemption.EXIT_CODE, preempted=True)
        preemption.exit_preempted()


def model_class_name(module: torch.nn.Module) -> str:
    """The class the user built: PyTorch's composable DDP and FSDP2 swap a module's class for a subclass
    (``DDPGPTModel``, ``FSDPLlamaForCausalLM``) defined in ``torch.distributed``."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return type(module).__name__


def split_datasets(provided: Any) -> tuple[Any, Any, Any, Callable | None]:
    """``(train, valid, test[, collate_fn])`` from a datasets provider, with a clear error otherwise."""
    if not isinstance(provided, (tuple, list)) or len(provided) not in (3, 4):
        got = f"{len(provided)} values" if isinstance(provided, (tuple, list)) else f"a {type(provided).__name__}"
        raise DataError(
            "train_valid_test_datasets_provider must return (train, valid, test) or (train, valid, test, collate_fn) "
            f"(None for a split it has not), got {got}"
        )
    train, valid, test = provided[:3]
    for name, dataset in (("train", train), ("validation", valid), ("test", test)):
        if dataset is not None:
            require_map_style(dataset, f"train_valid_test_datasets_provider's {name} dataset")
    return train, valid, test, provided[3] if len(provided) == 4 else None


def metric_values(metrics: Any) -> dict[str, Any]:
    """A metrics hook's dict as plain values: one-element tensors and numpy numbers as Python numbers, and a
    vector (per-class scores, as torchmetrics gives with ``average=None``) as one number per element,
    ``name_0``, ``name_1``, ... Anything but a dict is one line."""
    if not isinstance(metrics, dict):
        raise MetricsError(
            f"run_compute_metrics must return a dict of metrics (name -> number), got {type(metrics).__name__}: "
            "return e.g. {'accuracy': value}"
        )
    values: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
            flat = torch.as_tensor(value).detach().cpu().reshape(-1).tolist()
            if isinstance(value, torch.Tensor):  # tensors give floats, as they always did (an int count too)
                flat = [float(v) for v in flat]
            if len(flat) == 1:
                values[key] = flat[0]
            else:
                values.update({f"{key}_{i}": v for i, v in enumerate(flat)})
        else:
            values[key] = value
    return values


class MetricsError(RapidliteError):
    """A metrics hook returned something other than a dict of metrics."""


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
