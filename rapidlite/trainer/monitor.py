"""What a run reports: the interval's loss and rates (samples, tokens, model TFLOP/s and MFU), the progress bar,
``metrics.jsonl`` and the trackers it feeds (TensorBoard, W&B, MLflow), evaluation records, the torch.compile
lines, and ``curves.png`` at the end.

The loop hands the monitor what each step did (``count_batch``, ``record_step``) and says when to log; the
monitor owns the outputs and closes them however the run ends. Every rank takes part in an interval's one
reduction; rank 0 writes the files.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from rapidlite.checkpoint import layout
from rapidlite.config import files as config_file
from rapidlite.engine import RapidliteEngine
from rapidlite.errors import CheckpointError, RapidliteError, first_line
from rapidlite.evaluation.metrics import MeanMetrics
from rapidlite.graph import compiled_graphs
from rapidlite.observe.curves import NO_CURVES_ENV, PlotUnavailable, write_curves
from rapidlite.observe.logging import MetricsWriter, format_record, peak_memory_bytes
from rapidlite.observe.progress import Bar
from rapidlite.observe.trackers import TRACKERS, Trackers, build_trackers
from rapidlite.runtime.environ import env_switch


class Monitor:
    """The run's logs and metrics outputs; its state in a checkpoint is the trackers' runs a resumed run
    continues."""

    def __init__(self, engine: RapidliteEngine) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.logger = engine.logger
        # On every line of metrics.jsonl, so records of two runs in one file stay apart.
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(2).hex()
        self.writer: MetricsWriter | None = None  # rank 0's metrics.jsonl, which feeds the trackers
        self.trackers = Trackers()  # rank 0's, once open
        self.progress: Bar | None = None
        self._interval = _new_interval()
        # A task's own training metrics (DPO's rewards/..., logps/...): means over the interval's micro-batches
        # and ranks, reduced with the loss and logged on its line under their own names.
        self.step_metrics = MeanMetrics()
        self._state_bytes_logged = False
        self._first_step_start: float | None = None  # set when training begins; reports the compile step
        self._graphs = 0  # graphs torch.compile had built after the first step (recompiles are logged)
        self._resume_ids: dict[str, str] = {}  # tracker name -> its run in the checkpoint this run resumes

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Each tracker's run id (``wandb_run_id``, ``mlflow_run_id``), so a run resumed from the checkpoint
        continues it."""
        return self.trackers.ids()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_ids = {name: state[f"{name}_run_id"] for name in TRACKERS if state.get(f"{name}_run_id")}

    # ------------------------------------------------------------------ outputs
    def open(self, before_first: Callable[[], None] | None = None) -> None:
        """On rank 0: the trackers (started with every resolved setting, continuing the resumed checkpoint's
        runs), then ``metrics.jsonl`` under --save, which feeds them (``before_first``: called before its first
        record is written)."""
        self.trackers = build_trackers(self.settings.logging)
        try:
            self.trackers.start(config_file.plain_settings(self.engine.args), self._resume_ids)
        except BaseException as e:
            self.close_failed(e)  # the trackers started before the one that could not
            raise
        self.writer = MetricsWriter(
            self.settings.checkpoint.save, self.trackers, run_id=self.run_id, before_first=before_first
        )

    def close(self, exit_code: int = 0, preempted: bool = False, plot: bool = False) -> None:
        """Close the outputs (rank 0); ``plot``: then draw ``curves.png`` from the finished ``metrics.jsonl``. The
        trackers store the curves and the run's files, then end with ``exit_code`` (``preempted``: stopped by a
        signal)."""
        if self.writer is not None:
            self.writer.close()
            if plot:
                self.plot_curves()
            for path in self._run_files() if self.trackers else ():
                self.trackers.log_file(path)
        self.trackers.finish(exit_code, preempted)

    def _run_files(self) -> list[str]:
        """What the trackers store at the end of a launch: ``metrics.jsonl`` and the latest checkpoint's
        ``config.yaml`` (``rapidlite --config config.yaml`` repeats the run)."""
        save = self.settings.checkpoint.save
        if save is None:
            return []
        files = [os.path.join(save, "metrics.jsonl")]
        with contextlib.suppress(CheckpointError):  # no checkpoint yet
            files.append(str(layout.checkpoint_path(save) / config_file.FILE_NAME))
        return [path for path in files if os.path.isfile(path)]

    def close_failed(self, error: BaseException) -> None:
        """Close the outputs of a run ending by ``error``; the trackers end with the exit code it will have."""
        code = getattr(error, "exit_code", 130 if isinstance(error, KeyboardInterrupt) else 1)
        with contextlib.suppress(Exception):  # the training's error is the one to report
            self.close(code if isinstance(code, int) else 1)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def plot_curves(self) -> None:
        """``--save DIR/curves.png`` from ``DIR/metrics.jsonl`` (rank 0, at the end of a run). A finished run
        never fails here: without matplotlib, or when drawing fails, one line says so. None with --no-curves."""
        if self.settings.checkpoint.save is None or not self.engine.is_main_process:
            return
        if self.settings.logging.no_curves or env_switch(NO_CURVES_ENV):
            return
        try:
            path = write_curves(self.settings.checkpoint.save)
        except PlotUnavailable as e:
            self.logger.info(f"no {self.settings.checkpoint.save}/curves.png: {e}")
        except Exception as e:  # a plotting problem is not the run's
            self.logger.warning(f"could not draw {self.settings.checkpoint.save}/curves.png: {first_line(e)}")
        else:
            self.logger.info(f"loss, learning rate and throughput curves: {path}")
            self.trackers.log_file(str(path))

    # ------------------------------------------------------------------ steps
    def begin(self, progress: Bar | None) -> None:
        """Training starts: the first interval's rates count from here, not from the set-up (data, model,
        checkpoint loading)."""
        self.progress = progress
        self._interval["start"] = time.perf_counter()
        self._first_step_start = time.perf_counter()

    def count_batch(self, samples: int, tokens: int | None, patches: int = 0) -> None:
        """Record the data a step consumed (this rank's), for throughput and ``consumed_samples``; ``patches``: the
        image patches its vision encoder ran on (a vision-language model's FLOPs)."""
        interval = self._interval
        interval["samples"] += samples
        interval["patches"] += patches
        if tokens is None:
            interval["tokens_known"] = False
        else:
            interval["tokens"] += tokens

    def record_step(self, loss: torch.Tensor, applied: bool) -> None:
        interval = self._interval
        # Out of place: the zero-dim start tensor takes the loss's device, so no per-step host sync.
        interval["loss"] = interval["loss"] + loss
        interval["steps"] += 1
        interval["skipped"] += 0 if applied else 1

    def after_step(self, iteration: int, model: Any, optimizer: Any) -> None:
        """The progress bar, the compile step's line (or a recompilation's), and the model state's bytes once."""
        if self.progress is not None:
            self.progress.update(1)
        main = self.engine.is_main_process
        if self._first_step_start is not None:
            # The first step compiles (--torch-compile): its time is reported on its own line.
            if self.settings.model.torch_compile and main:
                seconds = time.perf_counter() - self._first_step_start
                self.logger.info(f"torch.compile: the first step took {seconds:.1f} s including compilation")
                self._graphs = compiled_graphs()
            self._first_step_start = None
        elif self.settings.model.torch_compile and main:
            self._log_recompiles(iteration)
        if not self._state_bytes_logged:
            self.log_model_state_bytes(iteration, model, optimizer)

    def _log_recompiles(self, iteration: int) -> None:
        """A graph built after the first step is a recompilation (new shapes or modes): said in one line, so
        a run that keeps recompiling is seen, not just slow."""
        graphs = compiled_graphs()
        if graphs > self._graphs:
            self.logger.info(
                f"torch.compile: {graphs - self._graphs} more graph{'s' if graphs - self._graphs > 1 else ''} "
                f"compiled by iteration {iteration} ({graphs} in all: new input shapes or modes)"
            )
            self._graphs = graphs

    def log_model_state_bytes(self, iteration: int, model: Any, optimizer: Any) -> None:
        """Once, after the first step (optimizer state exists then): this rank's bytes of parameters,
        gradients and optimizer state, so what ZeRO/FSDP shards is visible."""
        self._state_bytes_logged = True
        strategy = self.engine.strategy
        sizes = strategy.model_state_bytes(model, optimizer)
        record = {"split": "model_state", "iteration": iteration, "strategy": strategy.name, **sizes}
        self.logger.info(
            f"model state on rank {self.engine.rank} ({strategy.name}): "
            + ", ".join(f"{k.replace('_bytes', '')} {v / 2**20:.2f} MiB" for k, v in sizes.items())
        )
        if self.writer is not None:
            self.writer.write(record, "model_state")

    # ------------------------------------------------------------------ records
    def log_interval(self, iteration: int, consumed_samples: int, optimizer: Any) -> None:
        """The steps since the last logged interval, in one line and one record (none when there were none)."""
        interval = self._interval
        if interval["steps"] == 0:
            return
        elapsed = time.perf_counter() - interval["start"]
        # One reduction per log interval: loss, samples and tokens over the data-parallel ranks.
        # A rank that cannot count tokens makes the sum negative: tokens/s is then left out.
        tokens = interval["tokens"] if interval["tokens_known"] else -1e30
        base = torch.stack(
            [
                interval["loss"].double().cpu(),
                torch.tensor(float(interval["samples"]), dtype=torch.float64),
                torch.tensor(float(tokens), dtype=torch.float64),
                torch.tensor(float(interval["patches"]), dtype=torch.float64),
            ]
        )
        extra = self.step_metrics.vector() if self.step_metrics else torch.zeros(0, dtype=torch.float64)
        totals = self.engine.all_reduce_sum(torch.cat([base, extra]))
        loss, samples, tokens, patches = totals[:4].tolist()
        # Context-parallel ranks count the same samples and tokens (each trains its shard of them).
        samples, tokens = samples / self.engine.dist.topology.cp, tokens / self.engine.dist.topology.cp
        task_metrics = self.step_metrics.means(totals[4:]) if self.step_metrics else {}
        self.step_metrics.clear()
        grad_norm = optimizer.last_grad_norm
        record: dict[str, Any] = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "loss": loss / self.engine.dist.topology.reduce_size / interval["steps"],
            "lr": float(optimizer.param_groups[0]["lr"]),
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "loss_scale": optimizer.loss_scale,
            "skipped_steps": optimizer.skipped_steps,
            "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed if tokens >= 0 else None,
            "step_time_s": elapsed / interval["steps"],
            **self._flops_rates(samples, tokens, elapsed, patches),
            "peak_memory_mb": peak_memory_bytes(self.engine.device) / 2**20,
            **task_metrics,
        }
        record = {k: v for k, v in record.items() if v is not None}
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.3g}", refresh=False)
        self.logger.info(format_record(record))
        if self.writer is not None:
            self.writer.write(record, "train")
        self._interval = _new_interval()

    def _flops_rates(self, samples: float, tokens: float, elapsed: float, patches: float = 0.0) -> dict[str, float]:
        """Model TFLOP/s per device and MFU, from the interval's tokens (summed over data-parallel ranks) and
        their mean length per sequence (the attention term), and its image patches; every device shares the
        work."""
        flops = self.engine.model_flops
        if flops is None or tokens <= 0 or samples <= 0:
            return {}
        work = flops.per_token(tokens / samples) * tokens + flops.per_patch() * patches
        per_device = work / elapsed / self.engine.world_size
        rates = {"tflops_per_device": per_device / 1e12}
        if self.engine.peak_flops:
            rates["mfu"] = per_device / self.engine.peak_flops
        return rates

    def log_evaluation(self, split: str, iteration: int, metrics: Any, **extra: Any) -> dict[str, Any]:
        """An evaluation's record (``metrics`` as plain values), logged in one line and written."""
        record = {"split": split, "iteration": iteration, **extra, **metric_values(metrics)}
        self.logger.info(f"evaluation ({split}) | " + format_record({k: v for k, v in record.items() if k != "split"}))
        if self.writer is not None:
            self.writer.write(record, split)
        return record


def _new_interval() -> dict[str, Any]:
    return {
        "loss": torch.zeros(()),
        "steps": 0,
        "skipped": 0,
        "samples": 0,
        "tokens": 0,
        "tokens_known": True,
        "patches": 0,
        "start": time.perf_counter(),
    }


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
