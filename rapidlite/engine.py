"""``RapidliteEngine``: process group, device, seeds, precision, and ``compose`` — every flag applied to a model.

``compose`` is the one place where a model, its optimizer and its schedule get the features the flags
ask for, in a fixed order: device placement → dropout overrides → activation checkpointing → autocast
(or, under ZeRO-2/3, FSDP's mixed-precision policy) → data parallel / ZeRO sharding → optimizer (decay
groups, fused kernels, ZeRO-1 sharding, loss scaling, clipping) → LR schedule. The trainer templates
call it too, so a user-owned loop and the built-in loop train the same way.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rapidlite import distributed
from rapidlite.arguments import ExtraArgsProvider, parse_args
from rapidlite.data.loader import DeviceDataLoader, GatherTrim, build_data_loader
from rapidlite.errors import ConfigError, RapidliteError
from rapidlite.flops import ModelFlops, device_peak_flops
from rapidlite.global_vars import set_distributed_context, set_global_args
from rapidlite.logging import Timers, setup_logger
from rapidlite.models.hf import disable_kv_cache
from rapidlite.models.spec import spec_of
from rapidlite.optim import OptimizerConfig, RapidliteOptimizer, build_lr_scheduler, build_optimizer
from rapidlite.parallel.data_parallel import DataParallelConfig, apply_data_parallel, gradient_averager
from rapidlite.parallel.recompute import apply_activation_checkpointing
from rapidlite.precision import LossScaler, Precision, resolve_precision, set_tf32


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def _excepthook(previous: Callable) -> Callable:
    """``python my_script.py`` runs: a user error is one line and exit code 2; in a torchrun worker every
    failure is recorded for the launcher instead of printed, and the worker ends cleanly."""

    def hook(exc_type, exc, tb):
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            distributed.shutdown(distributed.report_worker_error(exc))
        if isinstance(exc, RapidliteError):
            sys.stdout.flush()
            print(f"rapidlite: error: {exc}", file=sys.stderr, flush=True)
            os._exit(exc.exit_code)
        previous(exc_type, exc, tb)

    hook.rapidlite = True
    return hook


def _autocast_forward(forward: Callable, precision: Precision) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with precision.autocast():
            return forward(*args, **kwargs)

    run.rapidlite_autocast = True
    return run


def _set_dropout(model: torch.nn.Module, hidden: float | None, attention: float | None) -> None:
    """``--hidden-dropout``/``--attention-dropout`` on a built model: the config keys its family's spec names,
    and every ``nn.Dropout`` for hidden dropout."""
    config = getattr(model, "config", None)
    spec = spec_of(model)
    if hidden is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = hidden
        for key in spec.hidden_dropout_keys:
            if config is not None and hasattr(config, key):
                setattr(config, key, hidden)
    if attention is not None:
        for key in spec.attention_dropout_keys:
            if config is not None and hasattr(config, key):
                setattr(config, key, attention)
        for module in model.modules():  # attention modules (HF, built-in GPT) read their rate from an attribute
            for key in ("dropout_prob", "attention_dropout", "dropout"):
                if isinstance(getattr(module, key, None), float):
                    setattr(module, key, attention)
            if isinstance(getattr(module, "attn_dropout", None), torch.nn.Dropout):
                module.attn_dropout.p = attention


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
                from rapidlite.launcher import launch_script_or_join

                launch_script_or_join(args)  # ``python my_trainer.py --nproc-per-node N``: ends the launcher here
        self.args = args
        self.timers = Timers()
        set_global_args(args, self.timers)
        self.data_parallel = DataParallelConfig.from_args(args)
        owned = not distributed.dist.is_initialized()
        launched = distributed.launched_world_size() is not None  # a launcher's worker, not a private group
        self.dist = distributed.init_distributed(
            args, need_process_group=self.data_parallel.zero_stage > 0 or self.data_parallel.deepspeed
        )
        if owned and self.dist.initialized:
            # A launched worker ends through the clean teardown (see distributed.shutdown; failures reach it
            # through the excepthook with their exit code). A private one-process group is destroyed before the
            # interpreter finalises, which then exits with the script's own code (1 after a crash, sys.exit's).
            atexit.register(distributed.shutdown if launched else distributed.dist.destroy_process_group)
        if not getattr(sys.excepthook, "rapidlite", False):
            # init_process_group put torch's rank-prefixing hook in front of ours: ours goes first again, so a
            # user error is still one line (torch's hook would buffer it past our os._exit).
            sys.excepthook = _excepthook(sys.excepthook)
        set_distributed_context(self.dist)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.dp_rank, self.dp_size = self.dist.dp_rank, self.dist.dp_size
        self.is_main_process = self.dist.is_main_process
        self.device = self.dist.device
        log_file = os.path.join(args.save, "logs", f"rank{self.rank}.log") if args.per_rank_logs else None
        self.logger = setup_logger(self.rank, log_file)
        self.precision, precision_notice = resolve_precision(args.precision, self.device)
        if self.is_main_process:
            notices = [*getattr(args, "notices", ()), *(getattr(args, "deepspeed_notices", None) or ())]
            for notice in [*notices, precision_notice]:
                if notice:
                    self.logger.warning(notice)
        set_seed(args.seed)
        self._optimizer: Any = None
        self._pipeline: Any = None
        self._pending_weights: dict[str, torch.Tensor] | None = None
        self._gather_trim = GatherTrim()
        self.model_flops: ModelFlops | None = None  # set by compose, for the TFLOP/s and MFU in the logs
        self.tf32 = set_tf32(args.tf32, self.device)
        if self.tf32 is not None and self.is_main_process:
            self.logger.info(f"TF32 matrix multiplies: {'on' if self.tf32 else 'off'} (--tf32/--no-tf32)")
        self.peak_flops = args.peak_flops or device_peak_flops(self.device, self.precision.dtype, self.tf32)

    @property
    def strategy(self) -> str:
        """What trains the model: "single process", "DDP", "ZeRO-1", "ZeRO-3 (FSDP2) + CPU offload", ..."""
        if not self.dist.initialized:
            return "single process"
        tp, pp = self.dist.dims.tp, self.dist.dims.pp
        name = self.data_parallel.name + (f" x tensor parallel {tp}" if tp > 1 else "")
        if pp > 1:
            name += f" x pipeline parallel {pp} ({self.args.pipeline_schedule})"
        return name

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
        args = self.args
        model = model if model is not None else model_obj
        if model is None:
            raise TypeError("compose() needs a model")
        if getattr(model, "_rapidlite_pipeline", None) is None:  # the whole model, before any split
            self._count_flops(model)
        disable_kv_cache(model)
        dp = self.data_parallel
        sharded = self.dist.initialized
        if sharded and dp.zero_stage > 0 and optimizer is not None and not isinstance(optimizer, RapidliteOptimizer):
            raise ConfigError(
                f"{dp.name} shards the optimizer, so it must build it: return None for the optimizer from "
                "model_optimizer_lr_scheduler_provider (or pass none to compose) and set it with the flags"
            )
        if dp.deepspeed:
            loaders = (train_dataloader, eval_dataloader)
            return self._compose_deepspeed(model, optimizer, lr_scheduler_fn, *loaders, total_iters, dynamic_shapes)
        if not dp.cpu_offload:
            model.to(self.device)
        _set_dropout(model, args.hidden_dropout, args.attention_dropout)
        pipeline = None
        if self.dist.dims.pp > 1 and getattr(model, "_rapidlite_pipeline", None) is None:
            pipeline = self._split_pipeline(model)
        tp_mesh = self.dist.tp_mesh
        if tp_mesh is not None and not getattr(model, "_rapidlite_tensor_parallel", False):
            from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, tp_mesh, args.sequence_parallel)
            model._rapidlite_tensor_parallel = True
        if args.checkpoint_activations:
            apply_activation_checkpointing(model, args.recompute_granularity, args.recompute_num_layers)
        self._maybe_compile(model, dynamic_shapes)
        fully_sharded = sharded and dp.fully_sharded
        if pipeline is not None:
            self._compose_pipeline_stages(pipeline, fully_sharded)
        # Under FSDP the compute dtype is FSDP's mixed-precision policy (as in torchtitan); else autocast.
        elif (
            self.precision.dtype is not None
            and not fully_sharded
            and not getattr(model.forward, "rapidlite_autocast", False)
        ):
            model.forward = _autocast_forward(model.forward, self.precision)
        # Tensor or pipeline parallelism without ZeRO-2/3: gradients are averaged over the replicas in the
        # optimizer step.
        model_parallel = tp_mesh is not None or self.dist.dims.pp > 1
        wrap = self.dist.dims.pp == 1 and (dp.zero_stage > 0 or tp_mesh is None)
        if sharded and wrap and not getattr(model, "_rapidlite_parallel", False):
            apply_data_parallel(model, self.dist.dp_mesh, dp, self.precision.dtype)
            model._rapidlite_parallel = True

        users_optimizer = optimizer is not None and not isinstance(optimizer, RapidliteOptimizer)
        if isinstance(optimizer, RapidliteOptimizer):
            wrapped = optimizer
        else:
            zero1_group = self.dist.dp_group if sharded and dp.zero_stage == 1 else None
            optimizer = optimizer or build_optimizer(model, OptimizerConfig.from_args(args), zero1_group)
            scaler = LossScaler.from_args(args) if self.precision.name == "fp16" else None
            # Sharded gradients can overflow on some ranks only: every rank must agree to skip the step.
            reduce_max = None
            if model_parallel:
                reduce_max = functools.partial(distributed.all_reduce_world, op="max")
            elif fully_sharded:
                reduce_max = functools.partial(self.dist.all_reduce, op="max")
            wrapped = RapidliteOptimizer(
                optimizer,
                clip_grad=args.clip_grad,
                loss_scaler=scaler,
                all_reduce_max=reduce_max,
                warn=self.is_main_process,
            )
            if tp_mesh is not None:  # the parallel cross-entropy's backward runs under loss_parallel too
                from rapidlite.parallel.tensor_parallel import backward_context

                wrapped.backward_context = backward_context
            if model_parallel and not dp.fully_sharded and self.dp_size > 1:
                wrapped.grad_all_reduce = gradient_averager(self.dist.dp_group, self.dp_size)
            runner = getattr(model, "_rapidlite_pipeline", None)
            if runner is not None:
                self._pipeline_optimizer_hooks(runner, wrapped)
        self._optimizer = wrapped

        scheduler = self._scheduler(wrapped.optimizer, lr_scheduler_fn, total_iters)
        self._log_composition(wrapped, users_optimizer, lr_scheduler_fn is not None)
        if args.use_ort:
            from rapidlite.graph import wrap_ort

            model = wrap_ort(model)
        return self._compose_result(model, wrapped, scheduler, train_dataloader, eval_dataloader)

    def _log_composition(self, optimizer: Any, users_optimizer: bool, users_scheduler: bool) -> None:
        """One line saying what compose applied, so nothing it does to a user's own objects goes unseen."""
        if not self.is_main_process:
            return
        args, precision = self.args, self.precision.name
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
            self.strategy,
            f"precision {precision}{' autocast' if precision != 'fp32' else ''}{scale}",
            f"optimizer {'yours: ' if users_optimizer else ''}{name}{'' if users_optimizer else ' from the flags'}",
            f"gradient clipping at norm {clip:g} (--clip-grad; 0 turns it off)" if clip > 0 else "no gradient clipping",
            "LR schedule yours" if users_scheduler else f"LR schedule {args.lr_decay_style} from the flags",
            f"global batch {args.global_batch_size} = micro {args.micro_batch_size} x accumulation "
            f"{args.gradient_accumulation_steps} x data-parallel {args.data_parallel_size}",
        ]
        if args.checkpoint_activations:
            parts.append(f"activation checkpointing ({args.recompute_granularity})")
        if args.torch_compile:
            parts.append("torch.compile")
        self.logger.info("compose: " + " | ".join(parts))

    def _count_flops(self, model: torch.nn.Module) -> None:
        self.model_flops = ModelFlops.of(model)
        if self.is_main_process:
            peak = f"{self.peak_flops / 1e12:.3g} TFLOP/s per device" if self.peak_flops else "unknown"
            hint = "" if self.peak_flops else " (pass --peak-flops for MFU; rapidlite-bench peak measures it)"
            self.logger.info(f"model FLOPs per token: {self.model_flops.describe()}; peak {peak}{hint}")

    def _maybe_compile(self, model: torch.nn.Module, dynamic_shapes: bool | None) -> None:
        """``--torch-compile``: each block compiled in place, after checkpointing and tensor parallelism and
        before the data-parallel wrappers (as torchtitan orders them)."""
        if not self.args.torch_compile or getattr(model, "_rapidlite_compiled", False):
            return
        from rapidlite.graph import compile_model

        count = compile_model(model, self.args.compile_mode, dynamic_shapes)
        model._rapidlite_compiled = True
        if self.is_main_process:
            shapes = "; any batch and sequence length" if dynamic_shapes else ""
            self.logger.info(
                f"torch.compile: {count} module{'s' if count > 1 else ''} (mode {self.args.compile_mode}{shapes}); "
                "they compile during the first step"
            )

    # ------------------------------------------------------------------ pipeline parallelism
    @property
    def pipeline(self) -> Any:
        """The pipeline runner of the composed model (None without pipeline parallelism)."""
        return self._pipeline

    def _split_pipeline(self, model: torch.nn.Module) -> Any:
        """Prune ``model`` in place to this rank's stages (before tensor parallelism and checkpointing, which
        then see only the blocks this rank runs)."""
        from rapidlite.parallel.pipeline import PipelineRunner, embedding_groups

        args, dist_ctx = self.args, self.dist
        runner = PipelineRunner(
            model,
            dist_ctx.pp_group,
            dist_ctx.pp_rank,
            dist_ctx.dims.pp,
            self.device,
            args.pipeline_schedule,
            layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
            split=args.pipeline_split,
            tp_mesh=dist_ctx.tp_mesh,
        )
        runner.embedding_group = embedding_groups(dist_ctx.mesh, dist_ctx.dims.pp) if runner.tied else None
        self._pipeline = runner
        return runner

    def _compose_pipeline_stages(self, runner: Any, fully_sharded: bool) -> None:
        """Stage modules over the rank's blocks; autocast per stage (or FSDP's policy), ZeRO-2/3 per stage."""
        dp = self.data_parallel
        for stage in runner.build_stages():
            if self.precision.dtype is not None and not fully_sharded:
                stage.forward = _autocast_forward(stage.forward, self.precision)
            if fully_sharded:
                apply_data_parallel(stage, self.dist.dp_mesh, dp, self.precision.dtype)

    def _pipeline_optimizer_hooks(self, runner: Any, optimizer: RapidliteOptimizer) -> None:
        """The gradient norm over every stage (a tied embedding counted once), and the tied embedding's two
        copies summed over the first and the last stage before the step."""
        pp_group = self.dist.pp_group

        def norm_reduce(norm_sq: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(norm_sq, group=pp_group)
            return norm_sq

        optimizer.norm_reduce = norm_reduce
        tied = runner.tied_weight()
        if tied is None:
            return
        if runner.has_last and not runner.has_first:
            optimizer.norm_exclude = {id(tied)}
        averager = optimizer.grad_all_reduce
        group = runner.embedding_group

        def sync(params: list[torch.Tensor]) -> None:
            if averager is not None:
                averager(params)
            grad = tied.grad
            if grad is None:  # this stage's copy took no gradient: contribute zeros
                tied.grad = grad = torch.zeros_like(tied)
            if hasattr(grad, "placements") and tuple(grad.placements) != tuple(tied.placements):
                # The embedding's vocabulary-parallel backward may leave its gradient whole: lay it out as the
                # weight, so both stages reduce the same shard.
                tied.grad = grad = grad.redistribute(placements=tied.placements)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch.distributed.all_reduce(local, group=group)

        optimizer.grad_all_reduce = sync

    def _scheduler(self, optimizer: torch.optim.Optimizer, lr_scheduler_fn: Any, total_iters: int | None) -> Any:
        if lr_scheduler_fn is not None and hasattr(lr_scheduler_fn, "step"):
            return lr_scheduler_fn
        total = total_iters or self.args.train_iters
        if lr_scheduler_fn is None and total is None:
            raise ConfigError("the learning-rate schedule needs the run length: pass --train-iters")
        return build_lr_scheduler(optimizer, self.args, total, lr_scheduler_fn)

    def _compose_result(self, model, optimizer, scheduler, train_dataloader, eval_dataloader) -> tuple:
        out = [model, optimizer, scheduler]
        for loader in (train_dataloader, eval_dataloader):
            if loader is not None:
                out.append(loader if isinstance(loader, DeviceDataLoader) else DeviceDataLoader(loader, self.device))
        return tuple(out)

    def _compose_deepspeed(
        self, model, optimizer, lr_scheduler_fn, train_dataloader, eval_dataloader, total_iters, dynamic_shapes
    ):
        """``--deepspeed``: dropout and activation checkpointing as usual, then DeepSpeed's engine takes the
        model and the optimizer built from the flags (it casts the weights for bf16/fp16 itself, so no
        autocast). The model handed back is the engine: forward through it, as DeepSpeed requires."""
        from rapidlite.parallel import deepspeed_backend
        from rapidlite.parallel.deepspeed_config import build_config

        args, dp = self.args, self.data_parallel
        if deepspeed_backend.is_deepspeed_engine(model):
            raise TypeError("compose() was given a DeepSpeed engine: pass the plain model")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("under --deepspeed, compose() takes a torch.optim.Optimizer (or None: built from flags)")
        model.to(self.device)
        _set_dropout(model, args.hidden_dropout, args.attention_dropout)
        if args.checkpoint_activations:
            apply_activation_checkpointing(model, args.recompute_granularity, args.recompute_num_layers)
        self._maybe_compile(model, dynamic_shapes)
        if self._pending_weights is not None:  # a checkpoint from another backend: its weights, loaded whole
            model.load_state_dict(self._pending_weights)
            self._pending_weights = None
        # DeepSpeed steps the optimizer on its own fp32 partitions (in host memory with --cpu-offload), where
        # Apex's CUDA kernels may not run: torch's AdamW steps either.
        optimizer = optimizer or build_optimizer(model, OptimizerConfig.from_args(args), allow_apex=False)
        config = build_config(args, self.precision.name, dp.zero_stage, dp.cpu_offload)
        self.logger.info(f"starting DeepSpeed {dp.name} (its ops are compiled on first use: that can take minutes)")
        ds_engine = deepspeed_backend.initialize(model, optimizer, config)
        wrapped = deepspeed_backend.DeepSpeedOptimizer(ds_engine)
        self._optimizer = wrapped
        scheduler = self._scheduler(wrapped.optimizer, lr_scheduler_fn, total_iters)
        return self._compose_result(ds_engine, wrapped, scheduler, train_dataloader, eval_dataloader)

    # ------------------------------------------------------------------ helpers for user loops
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
    ) -> DeviceDataLoader:
        """Training loaders (``shuffle``) give each rank its share of a seeded shuffle per epoch, padded so
        ranks stay in step; evaluation loaders keep the order and pad only the last batches (see gather)."""
        return build_data_loader(
            dataset,
            micro_batch_size or self.args.micro_batch_size,
            self.device,
            shuffle=shuffle,
            collate_fn=collate_fn,
            seed=self.args.seed,
            rank=self.dp_rank,
            world_size=self.dp_size,
            num_workers=self.args.num_workers,
            pad=pad,
            gather_trim=self._gather_trim,
        )


# Rapidformer's name for the engine: ``from rapidformer import RapidformerEngine`` runs with the package renamed.
RapidformerEngine = RapidliteEngine
