"""Pipeline parallelism as a strategy: the model pruned to this rank's stages, run by a
``torch.distributed.pipelining`` schedule; tensor parallelism within a stage and ZeRO-2/3 per stage compose."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rapidlite.checkpoint import dcp
from rapidlite.checkpoint.export import export_hf
from rapidlite.optim import StepHooks
from rapidlite.parallel.data_parallel import apply_data_parallel
from rapidlite.strategies.base import inconsistent_losses
from rapidlite.strategies.torch_native import DataParallel


class Pipeline(DataParallel):
    """This rank's pipeline stages. The trainer's forward steps arrive as (record, replay) pairs
    (``CountingIterator.replayable``): the schedule runs the model, then replays each step on its output."""

    @property
    def name(self) -> str:
        return super().name + f" x pipeline parallel {self.topology.pp} ({self.config.parallel.pipeline_schedule})"

    def setup(self, model: torch.nn.Module, optimizer: Any, dynamic_shapes: bool | None) -> tuple[Any, Any]:
        if self.pipeline is not None:
            raise TypeError("under pipeline parallelism an engine composes one model")
        return super().setup(model, optimizer, dynamic_shapes)

    def _split(self, model: torch.nn.Module) -> None:
        """Prune ``model`` in place to this rank's stages (before tensor parallelism and checkpointing, which
        then see only the blocks this rank runs)."""
        from rapidlite.parallel.pipeline import PipelineRunner, embedding_groups

        cfg, dist = self.config.parallel, self.dist
        runner = PipelineRunner(
            model,
            dist.pp_group,
            dist.pp_rank,
            dist.topology.pp,
            self.device,
            cfg.pipeline_schedule,
            layers_per_virtual_stage=cfg.num_layers_per_virtual_pipeline_stage,
            split=cfg.pipeline_split,
            tp_mesh=dist.tp_mesh,
        )
        runner.embedding_group = embedding_groups(dist.mesh, dist.topology.pp) if runner.tied else None
        if self.router_loss is not None:  # carried to the last stage; the metrics are summed over the stages
            runner.router_loss, self.router_loss.pp_group = self.router_loss, dist.pp_group
        self.pipeline = runner

    def _wrap(self, model: torch.nn.Module) -> None:
        """Stage modules over the rank's blocks: autocast per stage, or FSDP per stage under ZeRO-2/3."""
        for stage in self.pipeline.build_stages():
            if self.topology.fully_sharded:
                experts = [m for m in self.expert_modules if any(m is s for s in stage.modules())]
                dtype, edp = self.precision.dtype, self.dist.edp_mesh
                apply_data_parallel(stage, self.dist.dp_mesh, self.topology, dtype, edp, experts)
            else:
                self.precision.apply(stage)

    def step_hooks(self) -> StepHooks:
        """The gradient norm over every stage (a tied embedding counted once), and the tied embedding's two
        copies summed over the first and the last stage before the step."""
        hooks = super().step_hooks()
        runner, pp_group = self.pipeline, self.dist.pp_group

        def reduce_norm_sq(norm_sq: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(norm_sq, group=pp_group)
            return norm_sq

        hooks = dataclasses.replace(hooks, reduce_norm_sq=reduce_norm_sq)
        tied = runner.tied_weight()
        if tied is None:
            return hooks
        average, group = hooks.sync_grads, runner.embedding_group

        def sync(params: list[torch.Tensor]) -> None:
            if average is not None:
                average(params)
            grad = tied.grad
            if grad is None:  # this stage's copy took no gradient: contribute zeros
                tied.grad = grad = torch.zeros_like(tied)
            if hasattr(grad, "placements") and tuple(grad.placements) != tuple(tied.placements):
                # The embedding's vocabulary-parallel backward may leave its gradient whole: lay it out as the
                # weight, so both stages reduce the same shard.
                tied.grad = grad = grad.redistribute(placements=tied.placements)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch.distributed.all_reduce(local, group=group)

        exclude = frozenset({id(tied)}) if runner.has_last and not runner.has_first else frozenset()
        return dataclasses.replace(hooks, sync_grads=sync, norm_exclude=exclude)

    def forward_backward(
        self, model: Any, optimizer: Any, micro_steps: Sequence[Any], items: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, float]:
        """The schedule runs every micro-batch; the last stage's losses and item counts are shared with the
        other stages so every rank divides its gradients alike."""
        if not all(isinstance(step, tuple) for step in micro_steps):
            raise TypeError("under pipeline parallelism train_step takes (record, replay) pairs per micro-batch")
        results = self.pipeline.run(micro_steps, train=True, loss_scale=optimizer.loss_scale or 1.0)
        optimizer.note_scaled_backward()  # the schedule multiplied its losses by the scale
        modes = {items is None for _, items in results}
        if len(modes) > 1:
            raise inconsistent_losses()
        summary = torch.zeros(3, dtype=torch.float64)
        if results:
            summary[0] = float(sum(loss for loss, _ in results))
            summary[1] = float(sum(items or 0 for _, items in results))
            summary[2] = 0.0 if modes == {True} else 1.0
        loss_total, num_items, summed = self.dist.all_reduce_pipeline(summary).tolist()
        return torch.tensor(loss_total), self.grad_divisor(bool(summed), num_items, len(micro_steps))

    def load_checkpoint(
        self, load_dir: str, model: Any, optimizer: Any, *, with_optimizer: bool, weights_only: bool
    ) -> tuple[int, dict[str, Any] | None]:
        inner = optimizer.optimizer if with_optimizer else None
        # A stage holds part of the model: the checkpoint's other weights belong to other stages.
        return dcp.load_checkpoint(load_dir, model, inner, weights_only=weights_only, partial=True)

    def export(self, model: Any, out_dir: str, tokenizer: Any) -> Path | None:
        if not hasattr(model, "save_pretrained"):
            return None
        # Each stage's weights, whole, gathered to rank 0 (a collective).
        return export_hf(model, out_dir, tokenizer, self.pipeline.full_state_dict())
