"""DeepSpeed as a strategy (``--deepspeed``): its engine owns the step (accumulation, gradient average, ZeRO
partitions and offload, clipping, bf16/fp16 with fp32 master weights) and its checkpoint format; rapidlite
keeps the flags, the data, the optimizer it builds, the LR schedule and the checkpoint layout around it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rapidlite.checkpoint import dcp, layout, selection
from rapidlite.checkpoint.export import export_hf
from rapidlite.errors import CheckpointError, ConfigError
from rapidlite.models import lora
from rapidlite.optim import build_optimizer
from rapidlite.parallel import deepspeed_backend
from rapidlite.strategies.base import Strategy


class DeepSpeed(Strategy):
    """The model handed back by ``setup`` is DeepSpeed's engine: forward through it, as DeepSpeed requires."""

    needs_item_counts = True  # it divides each micro-batch's loss itself (see forward_backward)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._resume_weights: dict[str, torch.Tensor] | None = None
        self._resume_from: tuple[int, Path] | None = None  # the checkpoint prepare_resume verified
        self._per_micro_mean_warned = False
        self._scaled_items: float | None = None  # the last micro-batch's items x its scale, where counted
        self._counted: tuple[list[int], float] | None = None  # this step's item counts and loss scale
        self._weights_loaded = False  # the resume's weights went in before deepspeed.initialize

    @property
    def name(self) -> str:
        return self.topology.name

    def prepare_resume(self, load_dir: str) -> None:
        """A checkpoint written without DeepSpeed: its weights go into the model before DeepSpeed builds its
        fp32 copies from them (the optimizer state does not carry over)."""
        cfg = self.config.checkpoint
        self._resume_from = selection.select_checkpoint(load_dir)
        path = self._resume_from[1]
        if layout.is_deepspeed_checkpoint(path):
            saved = deepspeed_backend.optimizer_partitions(path / layout.DEEPSPEED_TAG)
            if saved in (0, self.dist.dp_size):
                return
            # DeepSpeed cannot repartition ZeRO's optimizer state over another number of ranks (it raises
            # deep inside load_checkpoint); the weights, consolidated by zero_to_fp32, load on any layout.
            if not (cfg.finetune or cfg.no_load_optim):
                raise CheckpointError(
                    f"--load {load_dir}: the DeepSpeed checkpoint's ZeRO optimizer state is partitioned over "
                    f"{saved} data-parallel ranks and this run has {self.dist.dp_size}, which DeepSpeed cannot "
                    f"repartition: resume on {saved}, or add --no-load-optim to continue from its weights and "
                    "schedule (or --finetune for the weights)"
                )
        elif not (cfg.finetune or cfg.no_load_optim):
            raise dcp.cross_backend_optimizer_error(load_dir, saved_by_deepspeed=False)
        self._resume_weights = dcp.read_model_tensors(path)

    def setup(self, model: torch.nn.Module, optimizer: Any, dynamic_shapes: bool | None) -> tuple[Any, Any]:
        """Dropout and activation checkpointing as usual, then DeepSpeed's engine takes the model and the
        optimizer (it casts the weights for bf16/fp16 itself, so no autocast)."""
        from rapidlite.parallel.deepspeed_config import build_config

        if deepspeed_backend.is_deepspeed_engine(model):
            raise TypeError("compose() was given a DeepSpeed engine: pass the plain model")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("under --deepspeed, compose() takes a torch.optim.Optimizer (or None: built from flags)")
        topology = self.topology
        model.to(self.device)
        self._prepare_module(model, dynamic_shapes, split=None)
        if self._resume_weights is not None:  # a checkpoint from another backend: its weights, loaded whole
            dcp.check_shapes(self.config.checkpoint.load, model.state_dict(), self._resume_weights)
            model.load_state_dict(self._resume_weights, strict=not lora.trainable_only(model))
            self._resume_weights = None
            self._weights_loaded = True
        # DeepSpeed steps the optimizer on its own fp32 partitions (in host memory with --cpu-offload), where
        # Apex's CUDA kernels may not run: torch's AdamW steps either.
        optimizer = optimizer or build_optimizer(model, self.config.optim, allow_apex=False)
        config = build_config(self.config, self.precision.name, topology.zero_stage, topology.cpu_offload)
        self.logger.info(f"starting {topology.name} (its ops are compiled on first use: that can take minutes)")
        ds_engine = deepspeed_backend.initialize(model, optimizer, config)
        return ds_engine, deepspeed_backend.DeepSpeedOptimizer(ds_engine)

    def prepare_frozen(self, model: torch.nn.Module) -> Any:
        """Under ZeRO-3 an engine of its own with no optimizer (its parameters partitioned as the trained
        model's, in host memory with --cpu-offload); under ZeRO-0/1/2, which keep whole parameters, an engine of
        stage 0 (DeepSpeed's cast to bf16/fp16, as TRL prepares its reference)."""
        from rapidlite.parallel.deepspeed_config import build_config

        topology = self.topology
        model.requires_grad_(False)
        model.eval()
        model.to(self.device)
        stage = topology.zero_stage if topology.zero_stage == 3 else 0
        config = build_config(self.config, self.precision.name, stage, False)
        zero = config["zero_optimization"]
        zero.pop("offload_optimizer", None)
        if topology.cpu_offload and topology.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        ds_engine = deepspeed_backend.initialize(model, None, config)
        ds_engine.eval()
        return ds_engine

    def forward_backward(
        self, model: Any, optimizer: Any, micro_steps: Sequence[Any], items: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, float]:
        """DeepSpeed divides every micro-batch's loss by the accumulation steps and averages the gradients over
        the data-parallel ranks itself. Where the task counts each micro-batch's items up front (``items``), a
        summed loss is scaled by ``steps x ranks / the global batch's items`` before that, so the gradients are
        the token-exact mean over the global batch, as on every other backend."""
        self._counted = None
        if items is not None:
            total = self.dist.all_reduce(torch.tensor(float(sum(items)), dtype=torch.float64), "sum")
            scale = len(micro_steps) * self.dist.dp_size / max(float(total), 1.0)
            self._counted = (list(items), scale)
        return super().forward_backward(model, optimizer, micro_steps, items)

    def _micro_loss(self, result: Any) -> tuple[torch.Tensor, int | None]:
        loss, items = super()._micro_loss(result)
        self._scaled_items = None
        if items is None:
            return loss, None
        if self._counted is not None:
            counts, scale = self._counted
            expected = counts.pop(0)
            if items != expected:
                raise ConfigError(
                    f"count_items said {expected} items for a micro-batch whose run_forward_step returned {items}: "
                    "make the two count alike"
                )
            self._scaled_items = items * scale  # the router loss is scaled as the summed loss
            return loss * scale, None
        # Not counted up front: a summed loss becomes its micro-batch mean (exact when micro-batches hold equal
        # item counts).
        if not self._per_micro_mean_warned and self.ctx.is_main_process:
            self._per_micro_mean_warned = True
            self.logger.warning(
                "under --deepspeed a (loss_sum, num_items) forward step is averaged per micro-batch (DeepSpeed "
                "scales each micro-batch's loss itself): equal to the global-batch average when micro-batches "
                "hold the same number of items"
            )
        return loss / max(items, 1), None

    def _router_weight(self, items: int | None) -> float | None:
        return self._scaled_items

    def module(self, model: Any) -> torch.nn.Module:
        return model.module

    @property
    def shards_parameters(self) -> bool:  # type: ignore[override]
        return self.topology.zero_stage == 3

    @contextlib.contextmanager
    def gathered_for_generation(self, model: Any) -> Iterator[None]:
        """ZeRO-3: every parameter gathered once (``deepspeed.zero.GatheredParameters``) and ZeRO-3's module hooks,
        which would fetch and release each submodule's parameters at every forward, taken off while the model
        samples, then put back."""
        if self.topology.zero_stage != 3:
            yield
            return
        import deepspeed

        offload = getattr(model.optimizer, "parameter_offload", None) if model.optimizer is not None else None
        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            if offload is not None:
                offload._remove_module_hooks()
                offload.forward_hooks.clear()
                offload.backward_hooks.clear()
            try:
                yield
            finally:
                if offload is not None:
                    offload.setup_zero_stage3_hooks()

    def parameter_count(self, model: Any) -> int:
        return deepspeed_backend.parameter_count(model.module)

    def model_state_bytes(self, model: Any, optimizer: Any) -> dict[str, int]:
        return deepspeed_backend.model_state_bytes(model)

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
        def write(directory: Path) -> None:
            model.save_checkpoint(
                str(directory),
                tag=layout.DEEPSPEED_TAG,
                save_latest=False,
                exclude_frozen_parameters=lora.trainable_only(model.module),
            )

        return dcp.save_checkpoint(save_dir, iteration, model, None, state, write_tensors=write, files=files)

    def load_checkpoint(
        self, load_dir: str, model: Any, optimizer: Any, *, with_optimizer: bool, weights_only: bool
    ) -> tuple[int, dict[str, Any] | None]:
        iteration, path = self._resume_from or selection.select_checkpoint(load_dir)
        native = layout.is_deepspeed_checkpoint(path) and not self._weights_loaded
        if native:
            loaded, _ = model.load_checkpoint(
                str(path),
                tag=layout.DEEPSPEED_TAG,
                load_optimizer_states=with_optimizer,
                load_lr_scheduler_states=False,
                load_module_only=weights_only,
                load_module_strict=not lora.trainable_only(model.module),
            )
            if loaded is None:
                raise CheckpointError(f"--load {load_dir}: DeepSpeed could not read the checkpoint in {path}")
        # else: the weights were loaded before deepspeed.initialize (prepare_resume)
        if weights_only:
            return iteration, None
        return iteration, dcp.read_state(path, load_dir, optimizer_loaded=native and with_optimizer)

    def export(self, model: Any, out_dir: str, tokenizer: Any) -> Path | None:
        module = model.module
        if not hasattr(module, "save_pretrained"):
            return None
        full = deepspeed_backend.full_state_dict(model)  # a collective under ZeRO-3; None off rank 0
        merge = self.config.lora.merge_lora
        return export_hf(module, out_dir, tokenizer, full, merge_adapters=merge) if full is not None else None
