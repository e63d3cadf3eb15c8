"""``Finetuner``: epoch-based training over map-style datasets, evaluated after each epoch."""

from __future__ import annotations

import functools
import math
from itertools import islice
from typing import Any

import torch

from rapidlite.data.collate import FlatteningCollator
from rapidlite.data.loader import DeviceDataLoader, batch_stats, unpadded_batches
from rapidlite.data.samplers import padded_share, sample_lengths
from rapidlite.data.streaming import TokenStream
from rapidlite.errors import ConfigError, DataError
from rapidlite.models.losses import unpack_loss
from rapidlite.models.padding_free import fit_padding_free
from rapidlite.models.vision import image_patches
from rapidlite.trainer.base import BaseTrainer
from rapidlite.trainer.providers import split_datasets


class Finetuner(BaseTrainer):
    """Subclass and implement:

    - ``train_valid_test_datasets_provider()`` → ``(train, valid, test[, collate_fn])`` map-style datasets;
    - ``model_optimizer_lr_scheduler_provider()`` → ``(model, optimizer or None, scheduler or None)``;
    - ``run_forward_step(batch, model)`` → loss, or ``(loss_sum, num_items)``;
    - ``run_compute_metrics(model, eval_dataloader)`` → dict of metrics; ``model`` is a one-element list
      (``model[0]``), as in Rapidformer. The default returns the mean loss of ``run_forward_step``.

    Then call ``train()``. Iterations per epoch = ceil(micro-batches per epoch / accumulation steps);
    ``--train-iters`` bounds the run if it comes first.
    """

    variable_length_batches = True
    # How many times a forward runs each image of a batch (a preference pair's chosen and rejected rows: twice).
    image_passes = 1
    # False: the training data is read in its order (a task whose global batches are made up front, as KTO's are).
    shuffle_training_data = True
    train_dataloader = None
    valid_dataloader = None
    test_dataloader = None
    steps_per_epoch = 1
    padding_free = None  # the hooks --padding-free put on the model (rapidlite.models.padding_free)
    _harness = None  # --eval-harness's files, read at the first evaluation (rapidlite.evaluation.harness)
    _flattener = None
    validated_at = -1  # the iteration of the last validation (saved: a stopped run's epoch end is validated on resume)

    def run_compute_metrics(self, model: list[torch.nn.Module], eval_dataloader: Any) -> dict[str, Any]:
        total = torch.zeros((), dtype=torch.float64)
        count = torch.zeros((), dtype=torch.float64)
        for batch in unpadded_batches(eval_dataloader):
            loss, items = unpack_loss(self.run_forward_step(batch, model[0]))
            weight = items if items is not None else batch_stats(batch)[0]
            # A mean loss is weighted by its samples; a sum already is.
            total += loss.detach().double().cpu() * (1 if items is not None else weight)
            count += weight
        total = self.engine.all_reduce_sum(total)
        count = self.engine.all_reduce_sum(count)
        return {"loss": float(total / count.clamp(min=1))}

    def count_items(self, batch: Any) -> int | None:
        """The ``num_items`` that ``run_forward_step`` returns for ``batch``, where the task knows it before the
        forward pass (None: it does not). DeepSpeed divides each micro-batch's loss by the accumulation steps itself,
        so it scales each summed loss by the global batch's count up front (``strategies.deepspeed``)."""
        return None

    def before_step(self, micro_batches: list[Any]) -> None:
        """Called with one step's micro-batches (this rank's) before their forward passes: a loss normalised over
        the whole global batch counts its items here (a collective: every rank calls it)."""

    def estimated_eval_seconds(self, step_s: float) -> float:
        batches = len(self.valid_dataloader) if self.valid_dataloader is not None else 0
        return batches * step_s / max(self.settings.batching.gradient_accumulation_steps, 1) / 3  # forward only

    def evaluations_left(self) -> int | None:
        """One evaluation at each epoch's end, the last at the run's."""
        return max(1, math.ceil(self.total_iters / self.steps_per_epoch) - self.iteration // self.steps_per_epoch)

    def evaluate(self, split: str = "validation") -> dict[str, Any]:
        loader = self.valid_dataloader if split == "validation" else self.test_dataloader
        if loader is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        bar = self.progress_bar(len(loader), split, unit="batch", leave=False)
        if bar is not None and isinstance(loader, DeviceDataLoader):
            loader.on_batch = bar.update
        try:
            with torch.no_grad():
                metrics = self.run_compute_metrics([self.model], loader)
                if self.settings.task.eval_harness and split == "validation":
                    from rapidlite.evaluation.harness import harness_metrics

                    metrics = {**(metrics or {}), **harness_metrics(self)}
        finally:
            if isinstance(loader, DeviceDataLoader):
                loader.on_batch = None
            if bar is not None:
                bar.close()
        self.model.train(was_training)
        if self.settings.training.eval_only:
            return self.log_evaluation(split, {} if metrics is None else metrics, eval_only=True)
        if split == "validation":
            self.validated_at = self.iteration
        epoch = self.iteration / max(self.steps_per_epoch, 1)
        return self.log_evaluation(split, {} if metrics is None else metrics, epoch=round(epoch, 4))

    def _forward_batch(self, batch: Any) -> Any:
        flops = self.engine.model_flops
        patches = image_patches(batch, flops.patch_size) * self.image_passes if flops and flops.vision_params else 0
        self.monitor.count_batch(*batch_stats(batch), patches=patches)
        return self.run_forward_step(batch, self.model)

    def train(self) -> dict[str, Any]:
        """Run the fine-tuning; returns the last validation metrics."""
        with self.closing_outputs():
            return self._train()

    def _train(self) -> dict[str, Any]:
        settings = self.settings
        if settings.topology.pp > 1:
            raise ConfigError(
                "--pipeline-model-parallel-size runs PreTrainer jobs (fixed-length samples, --task pretraining or a "
                "PreTrainer script); a Finetuner trains with data, tensor or ZeRO parallelism: drop the flag"
            )
        train_ds, valid_ds, test_ds, collate_fn = split_datasets(self.train_valid_test_datasets_provider())
        if isinstance(train_ds, TokenStream):
            return self._train_stream(train_ds, valid_ds, test_ds, collate_fn)
        if settings.training.eval_only:
            return self.evaluate_only(train_ds, valid_ds, test_ds, collate_fn)
        if not _has_rows(train_ds):
            raise DataError("the training dataset is empty")
        lengths = self._train_lengths(train_ds) if settings.data.group_by_length else None
        packs_itself = getattr(collate_fn, "padding_free", None)
        if settings.data.padding_free and callable(packs_itself):
            # A collation that packs its own sequences (a preference pair's two, kept apart by their positions).
            collate_fn_train = packs_itself()
        elif settings.data.padding_free:  # flattens what the task's collation makes; the model's head sets shift_labels
            self._flattener = FlatteningCollator(collate_fn if collate_fn is not None else self.default_collate())
            collate_fn_train = self._flattener
        else:
            collate_fn_train = collate_fn
        # pad=True: a training order, shuffled or not, strided over the ranks and resumable mid-epoch.
        self.train_dataloader = self.build_data_loader(
            train_ds, shuffle=self.shuffle_training_data, collate_fn=collate_fn_train, lengths=lengths, pad=True
        )
        self._build_eval_loaders(valid_ds, test_ds, collate_fn)
        if self.valid_dataloader is None:
            # --split is named where it divided the data: given, or applied by a task's own provider (a user's
            # train_valid_test_datasets_provider makes its own splits).
            own = type(self).train_valid_test_datasets_provider.__module__.startswith("rapidlite.")
            named = settings.data.split and (own or settings.given("split"))
            split = f" (--split {settings.data.split} gives it none)" if named else ""
            self.logger.warning(f"no validation data{split}: the run trains without evaluating")

        accumulation = settings.batching.gradient_accumulation_steps
        micro_per_epoch = len(self.train_dataloader)
        self.steps_per_epoch = math.ceil(micro_per_epoch / accumulation)
        total = settings.training.epochs * self.steps_per_epoch
        if settings.training.train_iters is not None:
            total = min(total, settings.training.train_iters)
        self.setup_model(total)

        self.begin_training()
        self._validate_missed_epoch_end()
        start_epoch, start_step = divmod(self.iteration, self.steps_per_epoch)
        for epoch in range(start_epoch, settings.training.epochs):
            total = self.total_iters  # --time-budget may shorten the run after its first steps
            if self.iteration >= total:
                break
            skip = start_step * accumulation if epoch == start_epoch else 0
            self.train_dataloader.set_epoch(epoch, start_batch=skip)
            batches = iter(self.train_dataloader)
            while self.iteration < self.total_iters:
                micro = list(islice(batches, accumulation))
                if not micro:
                    break
                if self._step(micro):
                    return self.last_evaluation
            at_end = self.iteration % self.steps_per_epoch == 0 or self.iteration >= self.total_iters
            if at_end and self.validated_at != self.iteration:  # not again where --eval-interval just validated
                self.evaluate("validation")
        if self.test_dataloader is not None:
            self.evaluate("test")
        self.finish()
        return self.last_evaluation

    def _step(self, micro: list[Any]) -> bool:
        """One optimizer step on this rank's micro-batches; True when the run stops here (``--exit-*``)."""
        self.before_step(micro)
        items = [self.count_items(b) for b in micro] if self.engine.strategy.needs_item_counts else [None]
        steps = (functools.partial(self._forward_batch, b) for b in micro)
        self.train_step(steps, items=None if None in items else items)
        self.after_step(sum(batch_stats(b)[0] for b in micro))
        self.stop_if_signalled()
        return self.exit_if_due()

    def _train_stream(self, stream: TokenStream, valid_ds: Any, test_ds: Any, collate_fn: Any) -> dict[str, Any]:
        """``--streaming``: ``--train-iters`` steps on the stream's micro-batches (its length is unknown, so the
        run is one pass: validation every ``--eval-interval`` and at its end); a checkpoint keeps the stream's
        position (``state_dict``)."""
        self.train_stream = stream
        self._build_eval_loaders(valid_ds, test_ds, collate_fn)
        if self.valid_dataloader is None:
            self.logger.warning("--streaming: no validation file: the run trains without evaluating")
        self.steps_per_epoch = self.settings.training.train_iters
        self.setup_model(self.steps_per_epoch)
        self.begin_training()
        self._validate_missed_epoch_end()
        # No look-ahead: the stream's position must be that of the batches handed out, as a checkpoint records it.
        batches = iter(DeviceDataLoader(stream, self.engine.device, prefetch=False))
        accumulation = self.settings.batching.gradient_accumulation_steps
        while self.iteration < self.total_iters:
            if self._step(list(islice(batches, accumulation))):
                return self.last_evaluation
        if not self.eval_every or self.iteration % self.eval_every:
            self.evaluate("validation")
        if self.test_dataloader is not None:
            self.evaluate("test")
        self.finish()
        return self.last_evaluation

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validated_at": self.validated_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # A checkpoint from before this key was kept: its epoch ends count as validated.
        self.validated_at = int(state.get("validated_at", self.iteration))

    def _validate_missed_epoch_end(self) -> None:
        """Resumed at an epoch's end (or the run's) that the stopped run did not validate (a SIGTERM/SIGUSR1 or
        --exit-interval after the epoch's last step stops before its evaluation): validate it now, so no epoch's
        validation is lost."""
        at_end = self.iteration % self.steps_per_epoch == 0 or self.iteration >= self.total_iters
        if self.iteration == 0 or not at_end or self.validated_at == self.iteration or self.valid_dataloader is None:
            return
        epoch = math.ceil(self.iteration / self.steps_per_epoch)
        self.logger.info(
            f"resumed at iteration {self.iteration}, the end of epoch {epoch} that the stopped run did not validate: "
            "validating it now"
        )
        self.evaluate("validation")

    def _train_lengths(self, train_ds: Any) -> list[int]:
        """``--group-by-length``: the tokens of every training sample (its ``input_ids``), logged with the padding
        the grouping saves in this run's micro-batches."""
        lengths = sample_lengths(train_ds)
        if lengths is None:
            raise DataError(
                "--group-by-length: the training samples have no input_ids to measure their length by; drop "
                "--group-by-length (or give the samples input_ids)"
            )
        if self.engine.is_main_process:
            m, g = self.settings.batching.micro_batch_size, self.settings.batching.global_batch_size
            plain, grouped = padded_share(lengths, m, g, grouped=False), padded_share(lengths, m, g, grouped=True)
            self.logger.info(
                f"--group-by-length: {len(lengths)} samples of {min(lengths)}-{max(lengths)} tokens; padding in "
                f"micro-batches of {m}: {grouped:.1%} of the tokens computed, against {plain:.1%} in a plain shuffle"
            )
        return lengths

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``--padding-free``: the hooks that run a packed row on the model exactly, or one line refusing it."""
        if not self.settings.data.padding_free or self.settings.training.eval_only:
            return model
        self.padding_free = fit_padding_free(model)
        if self._flattener is not None:
            self._flattener.shift_labels = self.padding_free.plan.shift_labels
        self.logger.info(f"--padding-free: {self.padding_free.describe()}")
        return model

    def evaluate_only(self, train_ds: Any, valid_ds: Any, test_ds: Any, collate_fn: Any) -> dict[str, Any]:
        """``--eval-only``: the model's scores on the validation split (and the test split if the data has
        one), gathered over the ranks and logged and written to the metrics as a training run's evaluations
        are; nothing is trained, saved or exported. Data with no validation split is evaluated whole (it is
        all in the train split: ``resolve`` does not split it)."""
        if not _has_rows(valid_ds):
            if not _has_rows(train_ds):
                raise DataError("--eval-only: the data has no rows to evaluate")
            self.logger.info(
                f"--eval-only: the data has no validation split: evaluating all {len(train_ds)} samples of its train "
                "split (--split as in training evaluates the share a training run carves out)"
            )
            valid_ds = train_ds
        self._build_eval_loaders(valid_ds, test_ds, collate_fn)
        self.setup_model(0)
        self.evaluate("validation")
        if self.test_dataloader is not None:
            self.evaluate("test")
        self.monitor.close()
        return self.last_evaluation

    def _build_eval_loaders(self, valid_ds: Any, test_ds: Any, collate_fn: Any) -> None:
        if _has_rows(valid_ds):
            self.valid_dataloader = self.build_data_loader(valid_ds, shuffle=False, collate_fn=collate_fn)
        if _has_rows(test_ds):
            self.test_dataloader = self.build_data_loader(test_ds, shuffle=False, collate_fn=collate_fn)


def _has_rows(dataset: Any) -> bool:
    return dataset is not None and len(dataset) > 0
