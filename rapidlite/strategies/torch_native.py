"""PyTorch's own backends: one process, DDP and ZeRO-1 (``DataParallel``), and FSDP2 for ZeRO-2/3 with CPU
offload (``FullySharded``); tensor parallelism composes with both."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch

from rapidlite.optim import RapidliteOptimizer, StepHooks, build_optimizer
from rapidlite.parallel.data_parallel import apply_data_parallel, gradient_averager, model_state_bytes
from rapidlite.precision import LossScaler
from rapidlite.runtime import distributed
from rapidlite.strategies.base import Strategy, refuse_foreign_optimizer


class DataParallel(Strategy):
    """One process, DDP (composable ``replicate``) or ZeRO-1 (``ZeroRedundancyOptimizer``), under ``autocast``.

    DDP's ``replicate`` takes no DTensor parameters: with tensor parallelism (and no ZeRO) the replicas'
    gradients are averaged in the optimizer step instead."""

    _split = None  # pipeline parallelism prunes the model to this rank's stages (strategies.pipeline)

    @property
    def name(self) -> str:
        if not self.dist.initialized:
            return "single process"
        tp, ep, cp = self.topology.tp, self.topology.ep, self.topology.cp
        return (
            self.topology.name
            + (f" x context parallel {cp} ({self.config.parallel.cp_comm_type})" if cp > 1 else "")
            + (f" x tensor parallel {tp}" if tp > 1 else "")
            + (f" x expert parallel {ep}" if ep > 1 else "")
        )

    @property
    def model_parallel(self) -> bool:
        """The model's weights are split over ranks (tensor or pipeline parallelism)."""
        return self.dist.tp_mesh is not None or self.topology.pp > 1

    def setup(self, model: torch.nn.Module, optimizer: Any, dynamic_shapes: bool | None) -> tuple[Any, Any]:
        refuse_foreign_optimizer(self, optimizer, self.dist.initialized and self.topology.zero_stage > 0)
        if not self.topology.cpu_offload:  # offloaded shards are placed by FSDP
            model.to(self.device)
        self._prepare_module(model, dynamic_shapes, self._split)
        self._wrap(model)
        optimizer = self._optimizer(model, optimizer)
        if self.config.model.use_ort:
            from rapidlite.graph import wrap_ort

            model = wrap_ort(model)
        return model, optimizer

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A replica under DDP/ZeRO-1 (nothing to reduce), sharded per block with FSDP2 under ZeRO-2/3 (resharded
        after each forward: it keeps no gathered weights), its shards in host memory with --cpu-offload."""
        model.requires_grad_(False)
        model.eval()
        if not self.topology.cpu_offload:
            model.to(self.device)
        if self.dist.tp_mesh is not None:
            from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, self.dist.tp_mesh, self.config.parallel.sequence_parallel)
        if self.dist.cp_group is not None:  # it scores the same shards as the trained model
            from rapidlite.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(model, self.dist.cp_group, self.config.parallel.cp_comm_type)
        if self.dist.initialized and self.topology.fully_sharded:
            from rapidlite.parallel.data_parallel import apply_fsdp

            apply_fsdp(model, self.dist.dp_mesh, True, self.precision.dtype, self.topology.cpu_offload)
        else:
            self.precision.apply(model)
        return model

    def _wrap(self, model: torch.nn.Module) -> None:
        """Precision and data parallelism over the prepared model."""
        self.precision.apply(model)
        if self.dist.initialized and (self.topology.zero_stage > 0 or self.dist.tp_mesh is None):
            apply_data_parallel(model, self.dist.dp_mesh, self.topology, self.precision.dtype, self.dist.edp_mesh)

    def _optimizer(self, model: torch.nn.Module, optimizer: Any) -> RapidliteOptimizer:
        zero1_group = self.dist.reduce_group if self.dist.initialized and self.topology.zero_stage == 1 else None
        experts = frozenset(id(p) for module in self.expert_modules for p in module.parameters())
        optimizer = optimizer or build_optimizer(model, self.config.optim, zero1_group, apart=experts)
        scaler = LossScaler.of(self.config.precision) if self.precision.name == "fp16" else None
        hooks, warn = self.step_hooks(), self.ctx.is_main_process
        return RapidliteOptimizer(
            optimizer, clip_grad=self.config.optim.clip_grad, loss_scaler=scaler, hooks=hooks, warn=warn
        )

    def step_hooks(self) -> StepHooks:
        tp = self.dist.tp_mesh is not None
        backward_context = None
        if tp:  # the parallel cross-entropy's backward runs under loss_parallel too
            from rapidlite.parallel.tensor_parallel import backward_context
        return StepHooks(
            backward_context=backward_context,
            sync_grads=self._replica_averager(),
            # Split weights overflow on some ranks only: every rank must agree to skip the step.
            reduce_found_inf=functools.partial(distributed.all_reduce_world, op="max") if self.model_parallel else None,
            any_rank=functools.partial(distributed.all_reduce_world, op="max") if self.dist.initialized else None,
        )

    def _replica_averager(self) -> Any:
        """The gradient average over data-parallel replicas where no wrapper does it (model parallelism, and the
        experts under DDP with expert parallelism)."""
        average = None
        if self.model_parallel and not self.topology.fully_sharded and self.topology.reduce_size > 1:
            average = gradient_averager(self.dist.reduce_group, self.topology.reduce_size)
        if not self.expert_modules:
            return average
        from rapidlite.parallel.expert_parallel import expert_gradient_averager

        group = None if self.topology.fully_sharded else self.dist.edp_mesh.get_group()
        experts = expert_gradient_averager(self.expert_modules, group, self.topology.ep, self.dist.dp_size)
        if average is None:
            return experts
        # Pipeline parallelism under DDP: the experts apart from the other weights (their ranks hold other experts).
        expert_ids = {id(p) for module in self.expert_modules for p in module.parameters()}

        def both(params: list[torch.Tensor]) -> None:
            average([p for p in params if id(p) not in expert_ids])
            experts(params)

        return both

    def model_state_bytes(self, model: Any, optimizer: Any) -> dict[str, int]:
        return model_state_bytes(model, optimizer.optimizer)


class FullySharded(DataParallel):
    """ZeRO-2/3 on FSDP2 (``fully_shard`` per block, then the root), optionally with CPU offload. The compute
    dtype is FSDP's mixed-precision policy, as in torchtitan, not autocast."""

    def _wrap(self, model: torch.nn.Module) -> None:
        apply_data_parallel(model, self.dist.dp_mesh, self.topology, self.precision.dtype, self.dist.edp_mesh)

    def step_hooks(self) -> StepHooks:
        hooks = super().step_hooks()
        if hooks.reduce_found_inf is None:  # sharded gradients overflow on some ranks only
            hooks = dataclasses.replace(hooks, reduce_found_inf=functools.partial(self.dist.all_reduce, op="max"))
        return hooks

    shards_parameters = True

    @contextlib.contextmanager
    def gathered_for_generation(self, model: Any) -> Iterator[None]:
        """Every FSDP module's parameters gathered once and kept whole (no reshard after each forward) while the
        model samples, then resharded and the modules' reshard settings put back."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        saved = []
        for m in modules:
            state = m._get_fsdp_state()
            saved.append(
                (state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
            )
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        try:
            yield
        finally:
            for m, (auto, infos) in zip(modules, saved, strict=True):
                m.reshard()
                state = m._get_fsdp_state()
                state._auto_reshard_after_forward = auto
                for group, info in zip(state._fsdp_param_groups, infos, strict=True):
                    group.post_forward_mesh_info = info

    @contextlib.contextmanager
    def whole_parameters(self, model: Any) -> Iterator[None]:
        # The blocks gather their own parameters in their forward hooks; the root's (embeddings, heads, whatever
        # no block holds) are gathered by the root's forward, which a direct call to a submodule skips.
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
