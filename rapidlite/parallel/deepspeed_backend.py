"""The DeepSpeed backend (``--deepspeed`` / ``--deepspeed-config``): the same templates through
``deepspeed.initialize``.

DeepSpeed then owns what its engine is built for: gradient accumulation and the gradient average over
ranks (``backward`` divides by the accumulation steps, ``step`` applies the update at the boundary),
ZeRO partitioning and offload, clipping, bf16/fp16 weights with fp32 master copies and loss scaling, and
the format of optimizer state in checkpoints. rapidlite keeps the flags, the data, the optimizer (built
from the flags and handed to DeepSpeed), the learning-rate schedule, logging and the checkpoint layout
around DeepSpeed's files (``DIR/iter_N/deepspeed``; see ``rapidlite.checkpoint``).

On a machine without CUDA DeepSpeed runs on its CPU accelerator over gloo; its communication op is
compiled on first use (needs g++ and ninja) into ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from rapidlite.errors import ConfigError

INSTALL_HINT = "pip install 'rapidlite[deepspeed]' (DeepSpeed builds its ops with g++ and ninja on first use)"


def import_deepspeed() -> Any:
    """Import DeepSpeed quietly, choosing its CPU accelerator when there is no GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
    except ImportError as e:
        raise ConfigError(f"--deepspeed needs DeepSpeed, which is not installed ({e}): {INSTALL_HINT}") from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls collectives torch 2.13 has renamed; the warning is about DeepSpeed, not the user's run.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a DeepSpeed engine (without importing DeepSpeed where nothing has)."""
    deepspeed = sys.modules.get("deepspeed")
    engine_class = getattr(deepspeed, "DeepSpeedEngine", None)
    return engine_class is not None and isinstance(model, engine_class)


def base_optimizer(ds_engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's ZeRO wrapper; its ``param_groups`` are the ones that step."""
    optimizer = ds_engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` on the process group rapidlite already started."""
    deepspeed = import_deepspeed()
    accelerator = deepspeed.get_accelerator()
    if config.get("fp16", {}).get("enabled") and not accelerator.is_fp16_supported():
        raise ConfigError(
            f"DeepSpeed does not train in fp16 on its {accelerator.device_name()} accelerator: use --bf16 "
            "(or --mixed-precision, which picks bf16 there)"
        )
    if config.get("bf16", {}).get("enabled") and not accelerator.is_bf16_supported():
        raise ConfigError(f"DeepSpeed does not train in bf16 on its {accelerator.device_name()} accelerator")
    # DeepSpeed asserts that a launcher set LOCAL_RANK; a single process (one GPU, or this CPU) has none. Its
    # group is rapidlite's one-process group, so its local rank is 0.
    os.environ.setdefault("LOCAL_RANK", "0")
    if accelerator.device_name() == "cpu":
        _skip_shared_memory_op()
    # Its op loader prints each op it builds or loads, from every rank: kept out of the run's output.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", FutureWarning)
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return ds_engine


def _skip_shared_memory_op() -> None:
    """DeepSpeed's torch backend compiles its shared-memory all-reduce (g++ and ninja, about a minute, once per
    ``TORCH_EXTENSIONS_DIR``) when it starts, for ``inference_all_reduce`` alone, which training never calls:
    on the CPU accelerator the op is not built, and that all-reduce, were it called, takes the process group's."""
    backend = sys.modules.get("deepspeed.comm.torch")
    if backend is not None and hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


class _LossScale:
    """DeepSpeed's current fp16 loss scale, read where rapidlite's scaler would be."""

    def __init__(self, ds_engine: Any) -> None:
        self._engine = ds_engine

    @property
    def scale(self) -> float:
        return float(self._engine._get_optimizer_loss_scale())


class DeepSpeedOptimizer:
    """The optimizer interface the trainer drives (``backward``, ``step``, ``param_groups``, the step
    statistics), carried out by a DeepSpeed engine.

    ``backward`` runs DeepSpeed's backward and step for one micro-batch: DeepSpeed divides the loss by
    the accumulation steps and applies the update on the last micro-batch of the global batch. So a
    micro-batch loss is always averaged, never summed (``strategies.DeepSpeed`` turns a summed loss into its
    micro-batch mean).
    """

    def __init__(self, ds_engine: Any) -> None:
        self.engine = ds_engine
        self.optimizer = base_optimizer(ds_engine)
        self.clip_grad = float(ds_engine.gradient_clipping() or 0.0)
        self.loss_scaler = None  # DeepSpeed's scaler lives in its optimizer and checkpoint
        self.nonfinite_steps = 0
        self._fp16 = ds_engine.fp16_enabled()
        self.last_grad_norm: torch.Tensor | None = None
        self._backward_calls = 0  # micro-batches that went through DeepSpeed's backward since the last step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.engine.skipped_steps = int(value)

    @property
    def loss_scale(self) -> float | None:
        return _LossScale(self.engine).scale if self._fp16 else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # DeepSpeed clears the gradients after each update

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.engine.step()
        self._backward_calls += 1

    def step(self, grad_divisor: float = 1.0, loss: torch.Tensor | None = None) -> bool:
        """The update already ran in the last ``backward``; report whether it was applied. DeepSpeed (bf16, fp32)
        applies a NaN/inf update too: such a step counts in ``nonfinite_steps`` and reports not applied, so the
        trainer stops after ``--max-skipped-steps`` of them and never saves the weights it wrote."""
        calls, self._backward_calls = self._backward_calls, 0
        if calls == 0:
            # A plain loss.backward() fills gradients DeepSpeed never reduces, scales or applies.
            raise ConfigError(
                "under --deepspeed the backward pass must go through engine.backward(loss) (DeepSpeed scales, "
                "accumulates and applies the update there): replace loss.backward()"
            )
        accumulation = self.engine.gradient_accumulation_steps()
        if self.engine.micro_steps % accumulation:
            raise RuntimeError(
                f"DeepSpeed is set for {accumulation} micro-batches per step, but the step ended after "
                f"{self.engine.micro_steps % accumulation}"
            )
        applied = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        self.last_grad_norm = torch.as_tensor(float(norm)) if applied and norm is not None else None
        values = [float(norm) if norm is not None else 0.0, float(loss.detach()) if loss is not None else 0.0]
        from rapidlite.runtime.distributed import all_reduce_world

        flag = torch.tensor([0.0 if all(math.isfinite(v) for v in values) else 1.0])
        if applied and all_reduce_world(flag, op="max").item():
            self.nonfinite_steps += 1
            self.last_grad_norm = None
            return False
        return applied

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state)


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the whole model, also when ZeRO-3 has partitioned them (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def model_state_bytes(ds_engine: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state under DeepSpeed.

    Parameters: the module's tensors (ZeRO-3: this rank's partition, ``ds_tensor``). Optimizer state:
    the moments the torch optimizer keeps for this rank's fp32 partition, and that fp32 partition itself (a copy
    DeepSpeed steps, even when the model trains in fp32). Gradients: DeepSpeed reduces
    them into buffers the size of that partition (ZeRO-2/3) or of the whole model (ZeRO-0/1); those are
    freed after each step, so their size is counted from the partition the optimizer steps."""
    module = ds_engine.module
    params = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    param_bytes = sum(t.numel() * t.element_size() for t in params)
    optimizer = base_optimizer(ds_engine)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    zero = ds_engine.optimizer  # ZeRO's fp32 partitions: stage 3 names them differently from stages 1-2
    flat = getattr(zero, "fp32_partitioned_groups_flat", None) or getattr(zero, "single_partition_of_fp32_groups", [])
    partition = sum(t.numel() * 4 for t in flat)
    full = sum(getattr(p, "ds_numel", p.numel()) * 4 for p in module.parameters())
    grad_bytes = partition if ds_engine.zero_optimization_stage() >= 2 else full
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state) + partition,
    }


def optimizer_partitions(directory: str | os.PathLike) -> int:
    """How many data-parallel ranks a DeepSpeed checkpoint's ZeRO optimizer state is partitioned over (one
    file per rank); 0 without ZeRO, whose optimizer state is whole."""
    return len(list(Path(directory).glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")))


def full_state_dict(ds_engine: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere); a collective under ZeRO-3. Trained parameters
    come from DeepSpeed's fp32 master copies: under bf16/fp16 the module holds them rounded to 16 bits, and
    the other backends (and DeepSpeed's own ``zero_to_fp32``) give fp32, which small updates such as LoRA's
    need. Frozen parameters have no master copy and keep their dtype."""
    from deepspeed.utils import safe_get_full_fp32_param

    if ds_engine.zero_optimization_partition_weights():
        state = ds_engine._zero3_consolidated_16bit_state_dict()
    else:
        state = ds_engine.module.state_dict()
    master = {}
    for name, param in ds_engine.module.named_parameters(remove_duplicate=False):
        if param.requires_grad and param.dtype != torch.float32:
            full = safe_get_full_fp32_param(param)  # a collective under ZeRO-3, like the state above
            if full is not None:
                master[name] = full
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    out = {k: v.detach().cpu().clone() for k, v in state.items()}
    out.update({k: v.detach().cpu().clone() for k, v in master.items() if k in out})
    return out
