"""The training loop ``Finetuner`` and ``PreTrainer`` share: the hooks, one training step, the bookkeeping after it.

One optimizer step (``train_step``) runs the micro-batches of one global batch: each forward step
returns either a mean loss (the engine averages over micro-batches) or ``(loss_sum, num_items)``
(the engine divides the summed gradients by the items of the whole global batch, so accumulation
over padded, variable-length micro-batches equals one big batch exactly).

The loop calls three components, as torchtitan's trainer calls its CheckpointManager and MetricsProcessor:
``monitor`` (logs, MFU, trackers, curves), ``clock`` (time budget, --exit-*, stop signals, divergence)
and ``checkpointing`` (save, resume).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from rapidlite.data.collate import PadCollator
from rapidlite.data.loader import DeviceDataLoader
from rapidlite.data.streaming import TokenStream, gathered_states, restore_state
from rapidlite.engine import RapidliteEngine
from rapidlite.errors import DataError
from rapidlite.models import lora
from rapidlite.models.head import loss_line
from rapidlite.observe.progress import Bar, hf_transformers_progress, progress_bar
from rapidlite.runtime import preemption
from rapidlite.runtime.allocator import release_freed
from rapidlite.trainer.checkpointing import Checkpointing
from rapidlite.trainer.clock import RunClock
from rapidlite.trainer.monitor import Monitor
from rapidlite.trainer.providers import check_vocabulary, model_class_name, split_model_provided


class BaseTrainer:
    """The hooks a subclass implements, and the loop both templates share."""

    # Fine-tuning batches vary in length (--torch-compile then compiles shape-generic code); pretraining
    # samples have one length.
    variable_length_batches: bool | None = None

    def __init__(self, engine: RapidliteEngine | None = None) -> None:
        self.engine = engine if engine is not None else RapidliteEngine()
        self.args = self.engine.args  # the flat view, for user hooks (get_args() is the same object)
        self.settings = self.engine.settings
        self.logger = self.engine.logger
        self.timers = self.engine.timers
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer: Any = None  # set it to have the tokenizer exported with a Hugging Face model
        self.processor: Any = None  # a multimodal model's processor: exported in the tokenizer's place
        self.iteration = 0
        self.consumed_samples = 0
        self.train_stream: TokenStream | None = None  # --streaming's training data: its position is saved
        self.total_iters = 0
        # The run's log and evaluation intervals: the flags', unless --time-budget spaces them over its length.
        self.log_every: int = self.settings.logging.log_interval
        self.eval_every: int | None = self.settings.training.eval_interval
        self.last_evaluation: dict[str, Any] = {}
        self.monitor = Monitor(self.engine)
        self.clock = RunClock(self)
        self.checkpointing = Checkpointing(self)

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

    def after_compose(self) -> None:
        """Called once the model is composed (wrapped, sharded, on its device) and before a checkpoint is loaded
        into it: what must see the starting weights (a reference model's scores) is made here."""

    def token_ids_needed(self) -> tuple[int, str] | None:
        """The embedding rows the run's token ids need, and what says so: the data's largest id + 1 where the task
        looked (``max_token_id``), else the size of ``self.tokenizer``; None when neither is known (a script's own
        model and data). ``setup_model`` refuses a model with fewer rows before any step."""
        largest = getattr(self, "max_token_id", None)
        if isinstance(largest, int) and largest >= 0:
            return largest + 1, f"the data has token id {largest}"
        if self.tokenizer is not None and hasattr(self.tokenizer, "__len__"):
            return len(self.tokenizer), f"the tokenizer has {len(self.tokenizer)} tokens"
        return None

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
        ``--no-progress``; a bar still needs a terminal (``rapidlite.observe.progress``)."""
        return self.engine.is_main_process and not self.settings.logging.no_progress

    def progress_bar(
        self, total: int | None, desc: str, unit: str = "it", leave: bool = True, initial: int = 0
    ) -> Bar | None:
        """A progress bar with rate and ETA on the main process's terminal, else None."""
        return progress_bar(total, desc=desc, unit=unit, leave=leave, initial=initial, enabled=self.show_progress)

    # ------------------------------------------------------------------ setup
    def setup_model(self, total_iters: int) -> None:
        """Build the model, optimizer and schedule through the provider and ``engine.compose``, resume --load's
        checkpoint, and open the run's outputs."""
        self.total_iters = total_iters
        self.checkpointing.prepare()
        with hf_transformers_progress(self.show_progress):  # from_pretrained's bars: on a terminal only
            model, optimizer, scheduler = split_model_provided(self.model_optimizer_lr_scheduler_provider())
        check_vocabulary(model, self.token_ids_needed(), self.settings.model.pretrained_model_name_or_path)
        model = self.prepare_model(model)
        line = loss_line(model, self.settings)  # the whole model's head (a pipeline's first stage holds none)
        # --eval-only (0 iterations) builds a schedule it never steps; one needs a length.
        self.model, self.optimizer, self.lr_scheduler = self.engine.compose(
            model, optimizer, scheduler, total_iters=max(total_iters, 1), dynamic_shapes=self.variable_length_batches
        )
        self.after_compose()
        if line and self.engine.is_main_process:
            self.logger.info(line)
        if self.checkpointing.resuming:
            self.checkpointing.load()
        if self.engine.is_main_process:  # --overwrite's removal waits for the first record or checkpoint
            self.monitor.open(before_first=self.checkpointing.clear_earlier_run)
            self.checkpointing.keep_settings()
        self.engine.barrier()
        strategy = self.engine.strategy
        n_params = strategy.parameter_count(self.model)
        a, batch = self.settings.training, self.settings.batching
        self.logger.info(
            f"model: {model_class_name(strategy.module(self.model))}, {n_params / 1e6:.2f}M parameters | "
            f"device: {self.engine.device} | "
            f"precision: {self.engine.precision.name} | micro batch {batch.micro_batch_size} x accumulation "
            f"{batch.gradient_accumulation_steps} x data-parallel {self.settings.topology.dp} = global "
            f"batch {batch.global_batch_size} | iterations: {total_iters if not a.eval_only else 'none (--eval-only)'}"
            + (f" (resuming at {self.iteration})" if self.iteration else "")
            + f" | run id {self.monitor.run_id}"
        )

    @contextlib.contextmanager
    def closing_outputs(self) -> Iterator[None]:
        """Around ``train()``: when training fails, the metrics outputs are closed all the same, and the trackers'
        runs are finished with the exit code the process will have."""
        try:
            yield
        except BaseException as e:
            self.monitor.close_failed(e)
            raise
        finally:
            # A run that ended by an exception leaves no flag-only SIGTERM handler behind in a longer-lived
            # process (a notebook, a test session), whose children (a Pool's workers) would then ignore SIGTERM.
            self.clock.restore_signals()

    def begin_training(self) -> None:
        """Called once everything is built, right before the first step."""
        release_freed()  # what building the data and the model freed (rapidlite.runtime.allocator)
        self.checkpointing.restore_rng()
        self.monitor.begin(self.progress_bar(self.total_iters, "train", initial=self.iteration))
        self.clock.begin()

    # ------------------------------------------------------------------ one step
    def train_step(self, micro_steps: Iterable[Callable[[], Any]], items: list[int] | None = None) -> bool:
        """Run the forward/backward of each micro-batch, then one optimizer step. Returns whether the
        step was applied (False: skipped for an fp16 overflow).

        Gradients are reduced over data-parallel ranks only with the last micro-batch. A mean loss is
        averaged over micro-batches (and ranks); ``(loss_sum, num_items)`` gradients are divided by the
        items of the whole global batch, counted over all ranks (``items``: each micro-batch's, where the task
        counts them before the forward passes, which DeepSpeed needs to stay exact)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        strategy = self.engine.strategy
        loss_total, divisor = strategy.forward_backward(self.model, self.optimizer, list(micro_steps), items=items)
        if strategy.router_loss is not None:
            strategy.router_loss.report(self.monitor.step_metrics.add)
        nonfinite_before = self.optimizer.nonfinite_steps
        applied = self.optimizer.step(grad_divisor=divisor, loss=loss_total)
        if applied and strategy.router_loss is not None:
            strategy.router_loss.update_expert_bias()
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.iteration += 1
        self.clock.watch_divergence(applied, self.optimizer.nonfinite_steps > nonfinite_before)
        self.monitor.record_step(loss_total / divisor, applied)
        return applied

    def after_step(self, samples_this_step: int) -> None:
        """Bookkeeping after each optimizer step: consumed samples, logging, evaluation, checkpoints."""
        self.consumed_samples += samples_this_step * self.engine.dp_size
        self.clock.step_ended()
        self.monitor.after_step(self.iteration, self.model, self.optimizer)
        if self.iteration % self.log_every == 0 or self.iteration == self.total_iters:
            self.monitor.log_interval(self.iteration, self.consumed_samples, self.optimizer)
        if self.eval_every and self.iteration % self.eval_every == 0:
            with self.clock.timing_evaluation():
                self.evaluate("validation")
        # Not while steps are being skipped for NaN/inf: latest stays at the last step that trained.
        if (
            self.settings.checkpoint.save_interval
            and self.iteration % self.settings.checkpoint.save_interval == 0
            and not self.clock.skip_streak
        ):
            self.checkpointing.save()
        self.clock.bookkeeping_ended()

    def log_evaluation(self, split: str, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Log and write an evaluation's metrics; the validation split's record becomes ``last_evaluation``."""
        record = self.monitor.log_evaluation(split, self.iteration, metrics, **extra)
        if split == "validation":
            self.last_evaluation = record
        return record

    def evaluate(self, split: str) -> dict[str, Any]:
        raise NotImplementedError

    def estimated_eval_seconds(self, step_s: float) -> float:
        """One evaluation's seconds before any was timed (a forward is about a third of a training step)."""
        return step_s / 3

    def evaluations_left(self) -> int | None:
        """Evaluations still to come whatever the run's length (an epoch-based run's); None: they follow its
        length (every --eval-interval)."""
        return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loop's position, saved in every checkpoint; with ``--streaming`` every rank's stream position (a
        collective: every rank calls it)."""
        state = {"iteration": self.iteration, "consumed_samples": self.consumed_samples}
        if self.train_stream is not None:
            state["stream"] = gathered_states(self.train_stream)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        if self.train_stream is not None:
            if "stream" not in state:
                raise DataError(
                    "--streaming: the checkpoint holds no stream position (it was saved without --streaming); "
                    "resume it without --streaming"
                )
            restore_state(self.train_stream, state["stream"])

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Final checkpoint, Hugging Face export (gathered on rank 0), close outputs."""
        self.monitor.close_progress()
        if self.settings.checkpoint.save is not None:
            self.checkpointing.save()
            with hf_transformers_progress(self.show_progress):  # save_pretrained's bars: on a terminal only
                preprocessor = self.processor if self.processor is not None else self.tokenizer
                out = self.engine.strategy.export(self.model, f"{self.settings.checkpoint.save}/hf", preprocessor)
            if out is not None:
                self.logger.info(f"exported Hugging Face model to {out}")
        self.monitor.close(plot=True)
        self.clock.restore_signals()  # a signal during the final save was ignored: the run is complete

    def exit_if_due(self) -> bool:
        """Called by the loops after each optimizer step: when ``--exit-interval`` or ``--exit-duration-in-mins``
        is due (``RunClock.exit_reason``), the checkpoint is saved (with --save), one line says how to resume, and
        it returns True: the loop returns without the final evaluation and export, and the process ends with exit
        code 0."""
        reason = self.clock.exit_reason()
        if reason is None:
            return False
        how = self._stop_saving("--load {save} continues it")
        self.logger.info(f"{reason}: stopped after iteration {self.iteration} of {self.total_iters} and {how}")
        self.monitor.close(plot=True)
        self.clock.restore_signals()
        return True

    def stop_if_signalled(self) -> None:
        """Called by the loops after each optimizer step. When SIGTERM or SIGUSR1 reached any rank, every rank
        stops here, after the same iteration: the checkpoint is saved (with --save), one line says how to resume,
        and the process ends with exit code 143 (``rapidlite.runtime.preemption``). Returns when no signal came."""
        signum = self.clock.signalled()
        if not signum:
            return
        how = self._stop_saving("--save {save} --load {save} resumes it")
        self.logger.info(
            f"{preemption.signal_name(signum)}: stopped after iteration {self.iteration} of {self.total_iters} and "
            f"{how} (exit code {preemption.EXIT_CODE})"
        )
        self.monitor.close(preemption.EXIT_CODE, preempted=True)
        preemption.exit_preempted()

    def _stop_saving(self, resume: str) -> str:
        """Stopping early: the steps since the last logged interval (none when they were just logged), then the
        checkpoint. Returns how to go on (``resume``: the flags that continue the run, given ``{save}``)."""
        self.monitor.log_interval(self.iteration, self.consumed_samples, self.optimizer)
        self.monitor.close_progress()
        save = self.settings.checkpoint.save
        if save is None:
            return "nothing saved (no --save): a rerun starts over"
        self.checkpointing.save()
        self.engine.barrier()  # no rank ends (and gets its peers stopped) before every shard is written
        return f"saved a checkpoint in {save}; the same command with {resume.format(save=save)}"


def perplexity(loss: float) -> float:
    """The perplexity of a mean loss, capped so that a diverging loss still logs a finite number."""
    return math.exp(min(loss, 50.0))
