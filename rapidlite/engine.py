"""``RapidliteEngine``: process group, device, seeds, precision, and ``compose`` — every flag applied to a model.

``compose`` is the one place where a model, its optimizer and its schedule get the features the flags
ask for. The engine picks one strategy for the run (``rapidlite.strategies``: one process/DDP/ZeRO-1,
FSDP2, pipeline, DeepSpeed), which applies them in a fixed order: device placement → dropout overrides →
pipeline stages → tensor parallelism → activation checkpointing → compile → autocast (or FSDP's
mixed-precision policy) → data parallel / ZeRO sharding → optimizer (decay groups, fused kernels, ZeRO-1
sharding, loss scaling, clipping); the engine adds the LR schedule. The trainer templates call it too, so
a user-owned loop and the built-in loop train the same way.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rapidlite import strategies
from rapidlite.config.parser import ExtraArgsProvider
from rapidlite.data.loader import DeviceDataLoader, GatherTrim, build_data_loader
from rapidlite.errors import ConfigError, RapidliteError
from rapidlite.models import lora, moe
from rapidlite.models.flops import ModelFlops, device_peak_flops
from rapidlite.models.hf import disable_kv_cache
from rapidlite.observe.logging import Timers, discard_rank_log, setup_logger
from rapidlite.observe.progress import close_bars
from rapidlite.optim import build_lr_scheduler
from rapidlite.precision import resolve_precision, set_tf32
from rapidlite.resolve import parse_args
from rapidlite.runtime import distributed, preemption
from rapidlite.strategies import Strategy, StrategyContext

_CURRENT: RapidliteEngine | None = None


def current_engine() -> RapidliteEngine | None:
    """The engine created last in this process, or None before any: Rapidformer's ``get_args()``, ``mpu`` and
    ``get_timers()`` (``rapidlite.compat``) read it for user scripts; library code is handed what it needs."""
    return _CURRENT


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def _excepthook(previous: Callable) -> Callable:
    """``python my_script.py`` runs: a user error is one line and exit code 2; in a torchrun worker every
    failure is recorded for the launcher instead of printed, and the worker ends cleanly."""

    def hook(exc_type, exc, tb):
        if isinstance(exc, RapidliteError) and exc.exit_code == 2:
            discard_rank_log()  # a refused run leaves no rank log
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            distributed.shutdown(distributed.report_worker_error(exc))
        close_bars()  # the error starts on a line of its own
        if isinstance(exc, RapidliteError):
            sys.stdout.flush()
            print(f"rapidlite: error: {exc}", file=sys.stderr, flush=True)
            os._exit(exc.exit_code)
        previous(exc_type, exc, tb)

    hook.rapidlite = True
    return hook


def require_module(model: Any, source: str) -> None:
    """One line for a model that is not a ``torch.nn.Module`` (a function, a tuple), from ``source`` ("compose()
    was given", a provider "returned"): it would fail deep in the FLOPs count or the wrapping."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{source} a {type(model).__name__} as the model, not a torch.nn.Module; give the model itself (an "
            "nn.Module, such as a transformers model)"
        )


class RapidliteEngine:
    """Parses the flags (or takes them), picks the device, seeds every RNG, and applies the flags.

    ``RapidliteEngine(extra_args_provider=fn)`` lets a user script add its own flags:
    ``fn(parser)`` adds arguments (and may return the parser).
    """

    def __init__(
        self,
        extra_args_provider: ExtraArgsProvider | None = None,
        args: argparse.Namespace | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        if not getattr(sys.excepthook, "rapidlite", False):
            sys.excepthook = _excepthook(sys.excepthook)
        if args is None:
            args = parse_args(argv, extra_args_provider, require_task=False)  # parsed once, resolved, frozen
            if argv is None:
                from rapidlite.runtime.launcher import launch_script_or_join

                # ``python my_trainer.py --nproc-per-node N``: ends the launcher here
                launch_script_or_join(args.sections.parallel)
        self.args = args  # the flat view user scripts read (get_args()); the library reads self.settings
        self.settings = settings = args.sections
        self.extra_args_provider = extra_args_provider  # the script's own flags, for the config a checkpoint keeps
        self.timers = Timers()
        global _CURRENT
        _CURRENT = self  # what get_args()/mpu (rapidlite.compat) read for Rapidformer-style scripts
        self.topology = settings.topology
        self.lora = settings.lora
        owned = not distributed.dist.is_initialized()
        launched = distributed.launched_world_size() is not None  # a launcher's worker, not a private group
        self.dist = distributed.init_distributed(settings.topology, settings.parallel)
        if owned and self.dist.initialized:
            # A launched worker ends through the clean teardown (see distributed.shutdown; failures reach it
            # through the excepthook with their exit code). A private one-process group is destroyed before the
            # interpreter finalises, which then exits with the script's own code (1 after a crash, sys.exit's).
            atexit.register(distributed.shutdown if launched else distributed.dist.destroy_process_group)
        if not getattr(sys.excepthook, "rapidlite", False):
            # init_process_group put torch's rank-prefixing hook in front of ours: ours goes first again, so a
            # user error is still one line (torch's hook would buffer it past our os._exit).
            sys.excepthook = _excepthook(sys.excepthook)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.dp_rank, self.dp_size = self.dist.dp_rank, self.dist.dp_size
        self.is_main_process = self.dist.is_main_process
        self.device = self.dist.device
        save = settings.checkpoint.save
        log_file = os.path.join(save, "logs", f"rank{self.rank}.log") if settings.logging.per_rank_logs else None
        self.logger = setup_logger(self.rank, log_file)
        self.precision, precision_notice = resolve_precision(settings.precision.precision, self.device)
        if self.is_main_process:
            notices = [*args.notices, *args.deepspeed_notices]
            for notice in [*notices, precision_notice]:
                if notice:
                    self.logger.warning(notice)
        set_seed(settings.training.seed)
        self._optimizer: Any = None
        self._composed: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._gather_trim = GatherTrim()
        self.model_flops: ModelFlops | None = None  # set by compose, for the TFLOP/s and MFU in the logs
        self.tf32 = set_tf32(settings.precision.tf32, self.device)
        if self.tf32 is not None and self.is_main_process:
            self.logger.info(f"TF32 matrix multiplies: {'on' if self.tf32 else 'off'} (--tf32/--no-tf32)")
        self.peak_flops = settings.logging.peak_flops or device_peak_flops(self.device, self.precision.dtype, self.tf32)

    @property
    def _main_logger(self) -> Any:
        return self.logger if self.is_main_process else None

    @functools.cached_property
    def strategy(self) -> Strategy:
        """The backend that trains the model (``str()`` of it names it: "DDP", "ZeRO-3 (FSDP2) + CPU offload",
        "... x pipeline parallel 2 (1f1b)", ...), chosen from the flags and the topology."""
        context = StrategyContext(self.settings, self.dist, self.precision, self.logger)
        return strategies.select(context)

    # ------------------------------------------------------------------ compose
    def compose(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler_fn: Any = None,
        train_dataloader: Any = None,
        eval_dataloader: Any = None,
        *,
        total_iters: int | None = None,
        model_obj: torch.nn.Module | None = None,
        dynamic_shapes: bool | None = None,
    ) -> tuple:
        """Return ``(model, optimizer, lr_scheduler)`` with every flag applied, plus the data loaders
        (batches moved to the device) when given.

        ``optimizer`` None: AdamW/SGD from the flags. ``lr_scheduler_fn``: None for Megatron's schedule
        from the flags over ``total_iters`` (default ``--train-iters``), a factory called with the
        optimizer (e.g. ``partial(get_linear_schedule_with_warmup, ...)``), or a built scheduler.
        ``dynamic_shapes`` (``--torch-compile``): True compiles for any batch and sequence length at once
        (variable-length fine-tuning data; the Finetuner passes it), None lets torch specialise on the first
        shapes and generalise when they change (fixed-length pretraining).
        """
        model = model if model is not None else model_obj
        if model is None:
            raise TypeError("compose() needs a model")
        require_module(model, "compose() was given")
        if model in self._composed:
            raise TypeError("compose() was given a model it has composed already: compose each model once")
        given = model
        model = lora.prepare(model, self.lora, self.precision.dtype, self.device, self._main_logger)
        self._count_flops(model)  # the whole model, before any split
        disable_kv_cache(lora.unwrap(model))
        self.strategy.router_loss = moe.router_loss(model, self.settings.moe, self.settings.given, self._main_logger)
        if self.strategy.router_loss is not None:
            self.strategy.router_loss.load_group = self.dist.reduce_group  # the ranks that hold the same routers
        composed, wrapped = self.strategy.setup(model, optimizer, dynamic_shapes)
        self._composed.update((given, model))
        self._optimizer = wrapped
        scheduler = self._scheduler(wrapped.optimizer, lr_scheduler_fn, total_iters)
        self._log_composition(wrapped, optimizer is not None, lr_scheduler_fn is not None)
        return self._compose_result(composed, wrapped, scheduler, train_dataloader, eval_dataloader)

    def _log_composition(self, optimizer: Any, users_optimizer: bool, users_scheduler: bool) -> None:
        """One line saying what compose applied, so nothing it does to a user's own objects goes unseen."""
        if not self.is_main_process:
            return
        s, precision = self.settings, self.precision.name
        if precision == "fp16":
            scaler = optimizer.loss_scaler
            kind = "dynamic" if scaler is None or scaler.dynamic else "static"
            scale = f", {kind} loss scale {optimizer.loss_scale:g} (backward through engine.backward(loss))"
        else:
            scale = ""
        base = optimizer.optimizer
        kernel = next((k for k in ("fused", "foreach") if base.defaults.get(k)), None)
        name = type(base).__name__ + (f" ({kernel})" if kernel else "")
        clip = optimizer.clip_grad
        parts = [
            self.strategy.name,
            f"precision {precision}{' autocast' if precision != 'fp32' else ''}{scale}",
            f"optimizer {'yours: ' if users_optimizer else ''}{name}{'' if users_optimizer else ' from the flags'}",
            f"gradient clipping at norm {clip:g} (--clip-grad; 0 turns it off)" if clip > 0 else "no gradient clipping",
            "LR schedule yours" if users_scheduler else f"LR schedule {s.optim.lr_decay_style} from the flags",
            f"global batch {s.batching.global_batch_size} = micro {s.batching.micro_batch_size} x accumulation "
            f"{s.batching.gradient_accumulation_steps} x data-parallel {s.topology.dp}",
        ]
        if s.model.checkpoint_activations:
            parts.append(f"activation checkpointing ({s.model.recompute_granularity})")
        if s.model.offload_activations:
            # A loop of its own (compose) offloads only inside `with engine.strategy.offload:` around its forward.
            parts.append("activation offloading (engine.strategy.forward_backward, or an own loop under .offload)")
        if s.model.torch_compile:
            parts.append("torch.compile")
        self.logger.info("compose: " + " | ".join(parts))

    def _count_flops(self, model: torch.nn.Module) -> None:
        self.model_flops = ModelFlops.of(model)
        if self.is_main_process:
            peak = f"{self.peak_flops / 1e12:.3g} TFLOP/s per device" if self.peak_flops else "unknown"
            hint = "" if self.peak_flops else " (pass --peak-flops for MFU; rapidlite-bench peak measures it)"
            self.logger.info(f"model FLOPs per token: {self.model_flops.describe()}; peak {peak}{hint}")

    @property
    def pipeline(self) -> Any:
        """The pipeline runner of the composed model (None without pipeline parallelism)."""
        return self.strategy.pipeline

    def _scheduler(self, optimizer: torch.optim.Optimizer, lr_scheduler_fn: Any, total_iters: int | None) -> Any:
        if lr_scheduler_fn is not None and hasattr(lr_scheduler_fn, "step"):
            return lr_scheduler_fn
        total = total_iters or self.settings.training.train_iters
        if lr_scheduler_fn is None and total is None:
            raise ConfigError("the learning-rate schedule needs the run length: pass --train-iters")
        return build_lr_scheduler(optimizer, self.settings.optim, total, lr_scheduler_fn)

    def _compose_result(self, model, optimizer, scheduler, train_dataloader, eval_dataloader) -> tuple:
        out = [model, optimizer, scheduler]
        for loader in (train_dataloader, eval_dataloader):
            if loader is not None:
                out.append(loader if isinstance(loader, DeviceDataLoader) else DeviceDataLoader(loader, self.device))
        return tuple(out)

    # ------------------------------------------------------------------ helpers for user loops
    @contextlib.contextmanager
    def preemption(self) -> Iterator[preemption.Watch]:
        """A loop of one's own stops on a scheduler's signal as the trainers do. Inside the block SIGTERM and
        SIGUSR1 only set a flag; ``watch.stop()`` at the end of each step (on every rank) says whether any rank got
        one, so every rank leaves after the same step, saves what it wants and breaks out. Leaving the block after a
        signal ends the process with exit code 143 (``rapidlite.runtime.preemption``: a scheduler's "run it again")::

            with engine.preemption() as watch:
                for batch in loader:
                    ...
                    if watch.stop():
                        save_my_checkpoint()
                        break
        """
        watch = preemption.Watch(self.device)
        watch.signals.install()
        try:
            yield watch
        finally:
            watch.signals.restore()
        signum = watch.signum or watch.signals.agreed(self.device)
        if signum:
            if self.is_main_process:
                name = preemption.signal_name(signum)
                self.logger.info(f"{name}: the loop stopped (exit code {preemption.EXIT_CODE})")
            preemption.exit_preempted()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaling of fp16 runs."""
        if self._optimizer is not None:
            self._optimizer.backward(loss)
        else:
            loss.backward()

    def autocast(self):
        """The precision context of this run (a no-op in fp32)."""
        return self.precision.autocast()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` from every data-parallel rank along dim 0 (one process: itself).

        During evaluation over a loader from ``build_data_loader(..., shuffle=False)``, ranks run the same
        number of batches, the last ones padded with repeats; a tensor with one row per sample of the
        current batch (predictions, labels, per-sample losses) loses those padding rows here, so metrics
        over the gathered tensors equal the single-process ones. Gather whole-batch tensors, then filter."""
        tensor = self._gather_trim(tensor)
        return self.dist.all_gather(tensor)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (one process: itself)."""
        return self.dist.all_reduce(value, "sum")

    def barrier(self) -> None:
        self.dist.barrier()

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
        """Training loaders (``shuffle``) give each rank its share of a seeded shuffle per epoch, padded so
        ranks stay in step; evaluation loaders keep the order and pad only the last batches (see gather).
        ``lengths`` (tokens per sample): the training shuffle is grouped by length, megabatches of global
        batches (``--group-by-length``)."""
        run = self.settings.training
        return build_data_loader(
            dataset,
            micro_batch_size or self.settings.batching.micro_batch_size,
            self.device,
            shuffle=shuffle,
            collate_fn=collate_fn,
            seed=run.seed,
            rank=self.dp_rank,
            world_size=self.dp_size,
            num_workers=self.settings.data.num_workers,
            pad=pad,
            gather_trim=self._gather_trim,
            lengths=lengths,
            group_size=self.settings.batching.global_batch_size,
        )


# Rapidformer's name for the engine: ``from rapidformer import RapidformerEngine`` runs with the package renamed.
RapidformerEngine = RapidliteEngine
