"""The strategy interface: how one backend sets a model up, runs a step's backward passes, steps, saves,
loads and exports. The engine picks one strategy per run; the trainer loop and the checkpoint code call it
and hold no backend branches (the shape of Lightning Fabric's strategies).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rapidlite.checkpoint import dcp
from rapidlite.checkpoint.export import export_hf
from rapidlite.config.settings import Sections
from rapidlite.config.topology import Topology
from rapidlite.errors import ConfigError
from rapidlite.models.losses import unpack_loss
from rapidlite.models.spec import spec_of
from rapidlite.parallel.activation_offload import OffloadActivations
from rapidlite.parallel.data_parallel import gradient_sync
from rapidlite.parallel.recompute import apply_activation_checkpointing
from rapidlite.precision import Precision
from rapidlite.runtime.distributed import DistributedContext


@dataclass(frozen=True)
class StrategyContext:
    """What every strategy is built from: the run's settings, topology, precision and logger."""

    config: Sections
    dist: DistributedContext  # its topology (the resolved one) says how the world is split and sharded
    precision: Precision
    logger: logging.Logger

    @property
    def topology(self) -> Topology:
        return self.dist.topology

    @property
    def is_main_process(self) -> bool:
        return self.dist.is_main_process


def set_dropout(model: torch.nn.Module, hidden: float | None, attention: float | None) -> None:
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


def inconsistent_losses() -> TypeError:
    return TypeError(
        "run_forward_step returned a loss in one micro-batch and (loss_sum, num_items) in another; return one kind"
    )


class Strategy:
    """One backend. ``setup`` applies every flag to a model and returns it with the optimizer the trainer
    drives (``backward``, ``step(grad_divisor)``, ``zero_grad``, ``param_groups``, ``loss_scale``,
    ``skipped_steps``, ``last_grad_norm``); the rest serves the trainer's loop and its checkpoints."""

    # Whether forward_backward needs each micro-batch's item count before the forward passes (``items``): a
    # backend that divides the losses itself (DeepSpeed). Elsewhere the trainers do not count them twice.
    needs_item_counts = False
    # The pipeline runner under pipeline parallelism (the trainer then hands forward steps as record/replay
    # pairs); None for every other backend.
    pipeline: Any = None
    # A mixture-of-experts model's router loss (``models.moe.RouterLoss``, set by compose): added to each
    # micro-batch's loss before its backward. None for a dense model.
    router_loss: Any = None
    # The experts modules split by expert parallelism (``parallel.expert_parallel``); empty without it.
    expert_modules: list = []

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.config, self.dist, self.topology = ctx.config, ctx.dist, ctx.dist.topology
        self.precision, self.logger = ctx.precision, ctx.logger
        self.device = ctx.dist.device
        # --offload-activations: the saved-tensor hooks each micro-batch's forward runs under.
        self.offload = OffloadActivations(self.device) if ctx.config.model.offload_activations else None
        self._offload_reported = False

    @property
    def name(self) -> str:
        """What trains the model, for the logs: "single process", "DDP", "ZeRO-3 (FSDP2) + CPU offload", ..."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ setup
    def setup(self, model: torch.nn.Module, optimizer: Any, dynamic_shapes: bool | None) -> tuple[Any, Any]:
        """``(model, optimizer)`` with every flag applied; ``optimizer`` None: built from the flags."""
        raise NotImplementedError

    def _prepare_module(self, model: torch.nn.Module, dynamic_shapes: bool | None, split: Callable | None) -> None:
        """What every backend applies to the plain module, in torchtitan's order: dropout, this rank's pipeline
        stages (``split``), expert and tensor parallelism, activation checkpointing, compile."""
        cfg = self.config.model
        set_dropout(model, cfg.hidden_dropout, cfg.attention_dropout)
        if split is not None:
            split(model)
        if self.dist.ep_mesh is not None:
            from rapidlite.parallel.expert_parallel import apply_expert_parallel

            self.expert_modules = apply_expert_parallel(model, self.dist.ep_mesh)
        if self.dist.tp_mesh is not None:
            from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, self.dist.tp_mesh, self.config.parallel.sequence_parallel)
        if self.dist.cp_group is not None:
            from rapidlite.parallel.context_parallel import apply_context_parallel

            apply_context_parallel(model, self.dist.cp_group, self.config.parallel.cp_comm_type)
        if cfg.checkpoint_activations:
            apply_activation_checkpointing(model, cfg.recompute_granularity, cfg.recompute_num_layers)
        if cfg.torch_compile:
            self._compile(model, dynamic_shapes)
        if self.offload is not None and self.ctx.is_main_process:
            where = "pinned host memory" if self.offload.cuda else "host memory (a CPU's device: nothing saved)"
            kept = cfg.checkpoint_activations and cfg.recompute_granularity == "selective"
            kept_note = "; selective recompute's kept outputs stay on the device (the checkpoint holds them)"
            self.logger.info(
                f"--offload-activations: the tensors each forward saves wait in {where}{kept_note if kept else ''}"
            )

    def _compile(self, model: torch.nn.Module, dynamic_shapes: bool | None) -> None:
        """``--torch-compile``: each block compiled in place, after checkpointing and tensor parallelism and
        before the data-parallel wrappers (as torchtitan orders them)."""
        from rapidlite.graph import compile_model

        count = compile_model(model, self.config.model.compile_mode, dynamic_shapes)
        if self.ctx.is_main_process:
            shapes = "; any batch and sequence length" if dynamic_shapes else ""
            mode = self.config.model.compile_mode
            self.logger.info(
                f"torch.compile: {count} module{'s' if count > 1 else ''} (mode {mode}{shapes}); "
                "they compile during the first step"
            )

    def prepare_frozen(self, model: torch.nn.Module) -> Any:
        """A model that is only run forward, never trained (a preference task's reference), laid out as the
        trained one is: on its device, in its precision, split by tensor parallelism and sharded as ZeRO-3
        shards it, so it takes the memory the trained model's parameters take per rank and no more."""
        raise NotImplementedError

    def prepare_resume(self, load_dir: str) -> None:
        """Called before ``setup`` when the run resumes from ``load_dir``."""

    # ------------------------------------------------------------------ one step
    def forward_backward(
        self, model: Any, optimizer: Any, micro_steps: Sequence[Any], items: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, float]:
        """Run the forward and backward pass of each micro-batch of one global batch. Returns the sum of the
        micro-batch losses and what the summed gradients are to be divided by (see ``grad_divisor``). ``items``:
        each micro-batch's item count, where the task knows it up front (a backend that divides the losses itself
        reads it, see ``strategies.deepspeed``).

        Gradients are reduced over data-parallel ranks only with the last micro-batch."""
        losses, num_items, mode = [], 0, None
        for i, forward in enumerate(micro_steps):
            with gradient_sync(model, enabled=i == len(micro_steps) - 1):
                with self.offload or contextlib.nullcontext():
                    result = forward()
                loss, items = self._micro_loss(result)
                step_mode = "mean" if items is None else "sum"
                if mode is not None and step_mode != mode:
                    raise inconsistent_losses()
                mode = step_mode
                penalty = self.router_loss.penalty(self._router_weight(items)) if self.router_loss else None
                optimizer.backward(loss if penalty is None else loss + penalty)
            losses.append(loss.detach().float())
            num_items += items or 0
        if self.offload is not None and not self._offload_reported:
            self._report_offload(len(micro_steps))
        return torch.stack(losses).sum(), self.grad_divisor(mode == "sum", num_items, len(micro_steps))

    def _report_offload(self, micro_batches: int) -> None:
        """One line after the first step: what the hooks moved, so a run that offloads nothing says so."""
        self._offload_reported = True
        if self.ctx.is_main_process:
            n, mib = self.offload.packed, self.offload.packed_bytes / 2**20
            small = f" (tensors under {self.offload.min_bytes // 2**20} MiB stay)" if self.offload.min_bytes else ""
            self.logger.info(
                f"--offload-activations: {n} saved tensors, {mib:.1f} MiB, went to host memory in the first step's "
                f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''}{small}"
            )

    def _micro_loss(self, result: Any) -> tuple[torch.Tensor, int | None]:
        return unpack_loss(result)

    def _router_weight(self, items: int | None) -> float | None:
        """What the router loss of a micro-batch is multiplied by to be weighted as its loss (``_micro_loss``'s
        result): its item count for a summed loss, None (1) for a mean."""
        return items

    def grad_divisor(self, summed: bool, num_items: float, micro_batches: int) -> float:
        """What the summed gradients are divided by: the micro-batch count for mean losses; for
        ``(loss_sum, num_items)`` the items of the whole global batch, times the data- (x context-) parallel
        size that the replicas' averaging already divided by."""
        if not summed:
            return micro_batches
        total = self.dist.all_reduce(torch.tensor(float(num_items), dtype=torch.float64), "sum")
        return max(float(total), 1.0) / self.topology.reduce_size

    # ------------------------------------------------------------------ checkpoints and export
    def module(self, model: Any) -> torch.nn.Module:
        """The user's module inside what ``setup`` returned."""
        return model

    def whole_parameters(self, model: Any) -> contextlib.AbstractContextManager:
        """Around calls that reach the model's submodules past its own forward (Hugging Face ``generate`` runs a
        sequence-to-sequence model's encoder directly): the parameters the backend shards stay whole inside. Here
        nothing is needed: the parameters are whole, or gathered per submodule (DeepSpeed's ZeRO-3)."""
        return contextlib.nullcontext()

    # The parameters are sharded over the data-parallel ranks (ZeRO-3): a forward is collective there.
    shards_parameters: bool = False

    def gathered_for_generation(self, model: Any) -> contextlib.AbstractContextManager:
        """Around sampling with the model (many forwards of a few tokens each): parameters the backend shards are
        gathered once on entry and kept whole until exit, not gathered again at every forward. Here nothing is
        sharded."""
        return contextlib.nullcontext()

    def parameter_count(self, model: Any) -> int:
        return sum(p.numel() for p in self.module(model).parameters())

    def model_state_bytes(self, model: Any, optimizer: Any) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state."""
        raise NotImplementedError

    def save_checkpoint(
        self,
        save_dir: str,
        iteration: int,
        model: Any,
        optimizer: Any,
        state: dict[str, Any],
        with_optimizer: bool,
        files: dict[str, str] | None = None,
    ) -> Path:
        """``dcp.save_checkpoint``: ``state`` and the text ``files`` are rank 0's."""
        inner = optimizer.optimizer if with_optimizer else None
        return dcp.save_checkpoint(save_dir, iteration, model, inner, state, files=files)

    def load_checkpoint(
        self, load_dir: str, model: Any, optimizer: Any, *, with_optimizer: bool, weights_only: bool
    ) -> tuple[int, dict[str, Any] | None]:
        """``(iteration, state)`` of ``load_dir``'s latest checkpoint, loaded into ``model`` (and the optimizer)."""
        inner = optimizer.optimizer if with_optimizer else None
        return dcp.load_checkpoint(load_dir, model, inner, weights_only=weights_only)

    def export(self, model: Any, out_dir: str, tokenizer: Any) -> Path | None:
        """The whole model in Hugging Face format on rank 0 (a collective); None for other models and ranks."""
        return export_hf(model, out_dir, tokenizer, merge_adapters=self.config.lora.merge_lora)


def refuse_foreign_optimizer(strategy: Strategy, optimizer: Any, builds_it: bool) -> None:
    """A strategy that shards the optimizer must build it itself."""
    if builds_it and optimizer is not None:
        raise ConfigError(
            f"{strategy.topology.name} shards the optimizer, so it must build it: return None for the optimizer "
            "from model_optimizer_lr_scheduler_provider (or pass none to compose) and set it with the flags"
        )
