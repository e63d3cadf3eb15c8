"""``PreTrainer``: iteration-based training; the forward step pulls its micro-batch from a data iterator."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rapidlite.data.loader import DeviceDataLoader, batch_stats
from rapidlite.data.samplers import PretrainingBatchSampler
from rapidlite.data.streaming import TokenStream
from rapidlite.errors import ConfigError, DataError
from rapidlite.models.losses import unpack_loss
from rapidlite.runtime import time_budget
from rapidlite.trainer.base import BaseTrainer, perplexity
from rapidlite.trainer.providers import split_datasets


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


class PreTrainer(BaseTrainer):
    """Subclass and implement:

    - ``train_valid_test_datasets_provider(train_val_test_num_samples)`` → ``(train, valid, test[, collate_fn])``;
      the argument gives how many samples each split will be asked for (Megatron's sizes:
      ``train_iters × global``, ``(train_iters // eval_interval + 1) × eval_iters × global``,
      ``eval_iters × global``);
    - ``model_optimizer_lr_scheduler_provider()`` → ``(model, optimizer or None, scheduler or None)``;
    - ``run_forward_step(data_iterator, model)`` → loss or ``(loss_sum, num_items)``; call
      ``next(data_iterator)`` for the micro-batch (already on the device).

    Then call ``train()``: ``--train-iters`` steps, evaluation every ``--eval-interval`` for
    ``--eval-iters`` global batches (loss and perplexity), checkpoints every ``--save-interval``.
    """

    train_data_iterator: CountingIterator | None = None
    valid_data_iterator: CountingIterator | None = None
    test_data_iterator: CountingIterator | None = None
    valid_stream: TokenStream | None = None  # --streaming's validation data, read from its start at each evaluation
    valid_stream_start: dict[str, Any] | None = None

    def _loader(self, dataset: Any, collate_fn: Any, consumed_samples: int) -> CountingIterator:
        sampler = PretrainingBatchSampler(
            len(dataset),
            consumed_samples,
            self.settings.batching.micro_batch_size,
            rank=self.engine.dp_rank,
            world_size=self.engine.dp_size,
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=self.settings.data.num_workers,
            pin_memory=self.engine.device.type == "cuda",
            generator=torch.Generator().manual_seed(self.settings.training.seed),
        )
        return CountingIterator(iter(DeviceDataLoader(loader, self.engine.device)))

    def _micro_step(self, iterator: CountingIterator) -> Any:
        """One micro-batch's forward step: a call, or under pipeline parallelism a (record, replay) pair."""
        step = functools.partial(self.run_forward_step, iterator, self.model)
        return iterator.replayable(step) if self.engine.pipeline is not None else step

    def estimated_eval_seconds(self, step_s: float) -> float:
        return self.settings.training.eval_iters * step_s / 3  # --eval-iters global batches, forward only

    def evaluate(self, split: str = "validation") -> dict[str, Any]:
        if split == "validation" and self.valid_stream is not None:  # from its first rows, each time
            self.valid_stream.load_state_dict(self.valid_stream_start)
            self.valid_data_iterator = self._stream_iterator(self.valid_stream)
        iterator = self.valid_data_iterator if split == "validation" else self.test_data_iterator
        if iterator is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        accumulation, pipeline = self.settings.batching.gradient_accumulation_steps, self.engine.pipeline
        bar = self.progress_bar(self.settings.training.eval_iters, split, unit="batch", leave=False)
        with torch.no_grad():
            for _ in range(self.settings.training.eval_iters):
                if pipeline is not None:  # a global batch at a time through the pipeline (forward only)
                    results = pipeline.run([self._micro_step(iterator) for _ in range(accumulation)], train=False)
                else:
                    results = [unpack_loss(self.run_forward_step(iterator, self.model)) for _ in range(accumulation)]
                for loss, items in results:
                    total += loss.detach().double().cpu()  # a mean counts once, a sum counts its items
                    count += items if items is not None else 1
                if bar is not None:
                    bar.update()
        if bar is not None:
            bar.close()
        iterator.take_counts()
        self.model.train(was_training)
        if pipeline is not None:  # the losses are the last stage's
            total, count = self.engine.dist.all_reduce_pipeline(torch.stack([total, count]))
        total, count = self.engine.all_reduce_sum(total), self.engine.all_reduce_sum(count)
        loss = float(total / count.clamp(min=1))
        return self.log_evaluation(split, {"loss": loss, "ppl": perplexity(loss)})

    def train(self) -> dict[str, Any]:
        """Run the pretraining; returns the last validation metrics."""
        with self.closing_outputs():
            return self._train()

    def _train(self) -> dict[str, Any]:
        settings = self.settings
        if settings.training.eval_only:
            raise ConfigError(
                "--eval-only runs Finetuner jobs; a PreTrainer evaluates every --eval-interval while it trains: drop "
                "--eval-only"
            )
        for name, on in (
            ("--group-by-length", settings.data.group_by_length),
            ("--padding-free", settings.data.padding_free),
        ):
            if on:
                raise ConfigError(
                    f"{name} batches a Finetuner's map-style data; a PreTrainer draws consecutive samples: drop {name}"
                )
        if settings.training.train_iters is None:
            raise ConfigError("a PreTrainer run needs --train-iters (the number of optimizer steps)")
        eval_interval = settings.training.eval_interval or settings.training.train_iters
        global_batch = settings.batching.global_batch_size
        evaluations = settings.training.train_iters // eval_interval + 1
        if settings.training.time_budget is not None:  # a sized run may space its evaluations anew
            evaluations = max(evaluations, time_budget.EVALUATIONS + 1)
        num_samples = [
            settings.training.train_iters * global_batch,
            evaluations * settings.training.eval_iters * global_batch,
            settings.training.eval_iters * global_batch,
        ]
        train_ds, valid_ds, test_ds, collate_fn = split_datasets(self.train_valid_test_datasets_provider(num_samples))
        if isinstance(train_ds, TokenStream):
            self._stream_data(train_ds, valid_ds)
        else:
            self._map_style_data(train_ds, valid_ds, test_ds, collate_fn, eval_interval)

        self.begin_training()
        iterator = self.train_data_iterator
        while self.iteration < self.total_iters:  # --time-budget may shorten it after the first steps
            self.train_step(self._micro_step(iterator) for _ in range(settings.batching.gradient_accumulation_steps))
            samples, tokens = iterator.take_counts()
            self.monitor.count_batch(samples, tokens)
            self.after_step(samples)
            self.stop_if_signalled()
            if self.exit_if_due():
                return self.last_evaluation
        if not self.eval_every or self.iteration % self.eval_every:
            self.evaluate("validation")
        if self.test_data_iterator is not None:
            self.evaluate("test")
        self.finish()
        return self.last_evaluation

    def _map_style_data(self, train_ds: Any, valid_ds: Any, test_ds: Any, collate_fn: Any, eval_interval: int) -> None:
        settings = self.settings
        if train_ds is None or len(train_ds) == 0:
            raise DataError("the training dataset is empty")
        self.setup_model(settings.training.train_iters)
        global_batch = settings.batching.global_batch_size
        self.train_data_iterator = self._loader(train_ds, collate_fn, self.consumed_samples)
        # The validation stream continues across evaluations, as in Megatron; on resume it restarts where
        # the uninterrupted run would be.
        run = settings.training
        valid_consumed = (self.iteration // eval_interval) * run.eval_iters * global_batch if run.eval_interval else 0
        self.valid_data_iterator = (
            self._loader(valid_ds, collate_fn, valid_consumed) if valid_ds is not None and len(valid_ds) > 0 else None
        )
        self.test_data_iterator = (
            self._loader(test_ds, collate_fn, 0) if test_ds is not None and len(test_ds) > 0 else None
        )
        if self.valid_data_iterator is None:
            split = f" (--split {settings.data.split} gives it none)" if settings.data.split else ""
            self.logger.warning(f"no validation data{split}: the run trains without evaluating")

    def _stream_data(self, train: TokenStream, valid: TokenStream | None) -> None:
        """``--streaming``: the training stream continues from the checkpoint's position; every evaluation reads
        the validation stream from its first rows (the same held-out samples each time)."""
        self.train_stream = train
        self.setup_model(self.settings.training.train_iters)
        self.train_data_iterator = self._stream_iterator(train)
        self.valid_stream = valid
        if valid is not None:
            self.valid_stream_start = valid.state_dict()
        if valid is None:
            self.logger.warning("--streaming: no validation file: the run trains without evaluating")

    def _stream_iterator(self, stream: TokenStream) -> CountingIterator:
        # No look-ahead: the stream's position must be that of the batches handed out, as a checkpoint records it.
        return CountingIterator(iter(DeviceDataLoader(stream, self.engine.device, prefetch=False)))
