"""Optimizers (weight-decay groups, fused kernels, bitsandbytes' 8-bit AdamW) and Megatron's learning-rate
schedule."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.apex_kernels import nvidia_apex
from rapidlite.config.sections import EIGHT_BIT_OPTIMIZERS, OptimizerConfig
from rapidlite.errors import ConfigError
from rapidlite.logging import LOGGER_NAME
from rapidlite.optim import eight_bit
from rapidlite.precision import LossScaler


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr: float = 0.0, loraplus_lr_ratio: float | None = None
) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; never biases or norm weights (the tensors of rank < 2).

    Under tensor parallelism some parameters are sharded (DTensor) and others plain: they go in separate
    groups, since one fused/foreach kernel call cannot mix the two. With ``loraplus_lr_ratio`` (LoRA+), the
    adapters' B matrices and the 1-D trainable tensors (peft's ``create_loraplus_optimizer`` grouping: a DoRA
    magnitude among them) learn at that multiple of ``lr``: their groups carry ``lr_mult``, which the schedule
    keeps."""
    groups: dict[tuple[bool, bool, float], list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            fast = loraplus_lr_ratio is not None and ("lora_B" in name or param.ndim == 1)
            mult = loraplus_lr_ratio if fast else 1.0
            groups.setdefault((param.ndim >= 2, hasattr(param, "placements"), mult), []).append(param)
    out = []
    for (decay, _, mult), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1], item[0][2])):
        group = {"params": params, "weight_decay": weight_decay if decay else 0.0}
        if mult != 1.0:
            group |= {"lr_mult": mult, "lr": lr * mult}
        out.append(group)
    return out


def _fused_supported(params: Iterable[torch.Tensor]) -> bool:
    # The fused kernels exist for CUDA and CPU float tensors; anything else (meta, mps, xla) uses foreach.
    return all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)


@functools.cache
def _apex_adamw(fused_adam: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Apex's FusedAdam with torch AdamW's bookkeeping, so the rest of rapidlite sees no difference.

    FusedAdam counts steps per parameter group, in a Python int, and takes no ``set_to_none`` in
    ``zero_grad``. Checkpoints keep only tensors and torch's checkpoint helpers call
    ``zero_grad(set_to_none=True)``; so the count is mirrored into a per-parameter ``step`` tensor (torch
    AdamW's key: checkpoints of either optimizer load into the other) and ``zero_grad`` is torch's."""

    class ApexAdamW(fused_adam):
        def zero_grad(self, set_to_none: bool = True) -> None:
            torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)

        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            loss = super().step(closure)
            for group in self.param_groups:
                if "step" not in group:
                    continue
                count = float(group["step"])
                for p in group["params"]:
                    state = self.state.get(p)
                    if not state:  # no gradient yet: no moments either
                        continue
                    if "step" in state:
                        state["step"].fill_(count)
                    else:
                        state["step"] = torch.tensor(count)
            return loss

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                counts = [float(self.state[p]["step"]) for p in group["params"] if "step" in self.state.get(p, {})]
                if counts:
                    group["step"] = int(max(counts))

    return ApexAdamW


def apex_adamw_class(device_type: str, sharded: bool) -> type[torch.optim.Optimizer] | None:
    """NVIDIA Apex's FusedAdam (adapted by ``_apex_adamw``) where it applies, else None for torch's AdamW.

    It applies to parameters on CUDA that are plain tensors stepped by one optimizer: not ``sharded``
    (DTensor parameters under FSDP or tensor parallelism, or ZeRO-1's partitioned optimizer, which torch's
    own kernels handle), and only when Apex is installed."""
    if device_type != "cuda" or sharded:
        return None
    apex = nvidia_apex()
    return _apex_adamw(apex.fused_adam) if apex is not None else None


def optimizer_state_bytes(cfg: OptimizerConfig, sizes: Iterable[int]) -> int:
    """The bytes of state ``cfg``'s optimizer keeps for parameters of ``sizes`` elements each (what the
    ``model_state`` record measures once every parameter has stepped): AdamW two fp32 moments, SGD one with
    momentum, the 8-bit AdamW bitsandbytes' layout (``eight_bit.state_bytes``)."""
    sizes = list(sizes)
    if cfg.optimizer == "sgd":
        return 4 * sum(sizes) if cfg.sgd_momentum else 0
    return eight_bit.state_bytes(sizes) if cfg.eight_bit else 8 * sum(sizes)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, zero1_group: Any = None, *, allow_apex: bool = True
) -> torch.optim.Optimizer:
    """AdamW or SGD over decay groups, fused where the device has the kernels: Apex's FusedAdam for AdamW on
    CUDA when Apex is installed (see ``apex_adamw_class``; ``allow_apex=False`` keeps torch's), else torch's
    fused or foreach kernels; bitsandbytes' 8-bit AdamW (``eight_bit``) over the same groups. With
    ``zero1_group`` the optimizer state is sharded over that process group (ZeRO-1)."""
    groups = param_groups(model, cfg.weight_decay, cfg.lr, cfg.loraplus_lr_ratio)
    if not groups:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
    params = [p for g in groups for p in g["params"]]
    fused = _fused_supported(params)
    kernels = {"fused": fused or None, "foreach": None if fused else True}
    if cfg.optimizer == "adamw":
        cls, defaults = torch.optim.AdamW, {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
        device_types = {p.device.type for p in params}
        device_type = device_types.pop() if len(device_types) == 1 else "mixed"
        sharded = zero1_group is not None or any(hasattr(p, "placements") for p in params)
        apex_cls = apex_adamw_class(device_type, sharded) if allow_apex else None
        if apex_cls is not None:
            try:
                return apex_cls(groups, lr=cfg.lr, **defaults, adam_w_mode=True)
            except (RuntimeError, ImportError):  # an Apex built without its CUDA extensions: torch's AdamW
                pass
    elif cfg.optimizer == "sgd":
        cls, defaults = torch.optim.SGD, {"momentum": cfg.sgd_momentum}
        if any(hasattr(p, "placements") for p in params):  # DTensor has no sharding rule for the fused SGD kernel
            kernels = {"fused": None, "foreach": True}
    elif cfg.eight_bit:  # plain tensors, one optimizer: resolve refuses the layouts that shard them
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        return eight_bit.build(cfg.optimizer, groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps)
    else:
        raise ConfigError(f"--optimizer {cfg.optimizer}: unknown; choose adamw, sgd, {', '.join(EIGHT_BIT_OPTIMIZERS)}")
    if zero1_group is not None:
        from rapidlite.parallel.data_parallel import build_zero1_optimizer

        return build_zero1_optimizer(groups, cls, zero1_group, lr=cfg.lr, **defaults, **kernels)
    return cls(groups, lr=cfg.lr, **defaults, **kernels)


class LRScheduler:
    """Megatron's ``OptimizerParamScheduler`` over iterations.

    Linear warmup from 0 to ``max_lr`` over ``warmup_steps`` (the lr at iteration 0 is the
    warmup start), then ``decay_style`` down to ``min_lr`` at ``decay_steps``, ``min_lr`` after.
    ``step()`` is called once per successful optimizer step; the lr it sets is used by the next.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
    ) -> None:
        if decay_style != "constant" and decay_steps < warmup_steps:
            raise ConfigError(
                f"learning-rate warmup ({warmup_steps} iterations) must be shorter than the decay "
                f"({decay_steps} iterations): lower --lr-warmup-iters/--lr-warmup-fraction or "
                "raise --lr-decay-iters"
            )
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.decay_style = warmup_steps, decay_steps, decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(self.min_lr, lr)
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ConfigError(f"--lr-decay-style {self.decay_style}: unknown")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def resize(self, decay_steps: int, warmup_steps: int | None = None, warmup_fraction: float | None = None) -> None:
        """Decay over ``decay_steps`` from now on (a run sized by --time-budget): the schedule a run of that length
        has. The warmup is ``warmup_steps`` if given, else ``warmup_fraction`` of the new length if given, else
        unchanged; never longer than the run."""
        if warmup_steps is None and warmup_fraction is not None:
            warmup_steps = int(warmup_fraction * decay_steps)
        if warmup_steps is not None:
            self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        if self.decay_style != "constant":
            self.warmup_steps = min(self.warmup_steps, decay_steps)
        self.step(0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The flags of the resumed run win (as in Megatron with --override-opt_param-scheduler);
        # only the position in the schedule is restored.
        self.num_steps = int(state["num_steps"])
        self.step(0)


def warmup_steps(cfg: OptimizerConfig, decay_steps: int) -> int:
    if cfg.lr_warmup_iters is not None:
        return cfg.lr_warmup_iters
    if cfg.lr_warmup_fraction is not None:
        return int(cfg.lr_warmup_fraction * decay_steps)
    return 0


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimizerConfig,
    total_iters: int,
    lr_scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Any:
    """The user's scheduler factory if given (e.g. ``partial(get_linear_schedule_with_warmup, ...)``), else
    Megatron's schedule from the flags with ``--lr-decay-iters`` defaulting to the run's length."""
    if lr_scheduler_fn is not None:
        return lr_scheduler_fn(optimizer)
    decay_steps = cfg.lr_decay_iters or total_iters
    warmup = warmup_steps(cfg, decay_steps)
    if warmup > decay_steps and cfg.lr_decay_style != "constant":
        # Known only now for an epoch-based run (its length comes from the data): warm up over the whole run,
        # as the Hugging Face Trainer does, and say so.
        logging.getLogger(LOGGER_NAME).warning(
            f"--lr-warmup-iters {warmup} is longer than the run's {decay_steps} iterations: warming up over "
            "the whole run (the learning rate reaches --lr only at its end); lower --lr-warmup-iters"
        )
        warmup = decay_steps
    return LRScheduler(
        optimizer,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        decay_style=cfg.lr_decay_style,
    )


def _by_layout(items: list[Any], grad_of: Callable[[Any], torch.Tensor]) -> dict[Any, list[Any]]:
    """Items grouped by their gradient's layout: (mesh, placements) for DTensors, None for plain tensors."""
    groups: dict[Any, list[Any]] = {}
    for item in items:
        grad = grad_of(item)
        key = (grad.device_mesh, tuple(grad.placements)) if hasattr(grad, "placements") else None
        groups.setdefault(key, []).append(item)
    return groups


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients. Sharded (DTensor) gradients are grouped by layout, each group's norm is
    made whole over its shards, and plain (replicated) gradients count once."""
    norms = []
    for group in _by_layout(grads, lambda g: g).values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        if hasattr(norm, "full_tensor"):  # a DTensor: each rank holds a partial sum of squares
            norm = norm.full_tensor()
        norms.append(norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


@dataclass(frozen=True)
class StepHooks:
    """What a parallel layout adds around the optimizer step; its strategy builds them once, at setup.

    ``backward_context``: entered around every backward (the parallel cross-entropy's ``loss_parallel``).
    ``sync_grads``: called with the parameters that hold gradients before they are unscaled (averaging over
    replicas where no wrapper does it, summing a pipeline's tied embedding over its stages).
    ``reduce_norm_sq``: makes this rank's squared gradient norm the whole model's (pipeline stages).
    ``norm_exclude``: ids of parameters left out of the norm (a tied copy counted on another stage).
    ``reduce_found_inf``: the max over the ranks whose gradients may overflow independently, so every rank
    agrees to skip an fp16 step."""

    backward_context: Callable[[], Any] | None = None
    sync_grads: Callable[[list[torch.Tensor]], None] | None = None
    reduce_norm_sq: Callable[[torch.Tensor], torch.Tensor] | None = None
    norm_exclude: frozenset[int] = field(default_factory=frozenset)
    reduce_found_inf: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Max over every rank of the job: ranks hold different losses, and all must skip a step together.
    any_rank: Callable[[torch.Tensor], torch.Tensor] | None = None


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class RapidliteOptimizer:
    """A torch optimizer with the step the flags ask for.

    ``backward(loss)`` scales the loss for fp16. ``step(grad_divisor)`` divides the accumulated
    gradients by the loss scale and by ``grad_divisor`` (micro-batch count, or the token/item count
    of the whole global batch), skips the update if any gradient overflowed (fp16), clips to
    ``clip_grad`` by the global norm, and steps. Everything else is the wrapped optimizer's.

    The optimizer knows whether the gradients it holds were scaled: only those that came through
    ``backward`` (``engine.backward(loss)``) carry the loss scale. Gradients from a plain
    ``loss.backward()`` in a user's own loop are stepped as they are (divided by ``grad_divisor`` only),
    with one warning that fp16 then trains without loss scaling; dividing them by a scale they never
    received would shrink every update by that factor.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grad: float = 0.0,
        loss_scaler: LossScaler | None = None,
        hooks: StepHooks | None = None,
        warn: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.warn = warn  # warnings about the user's loop come from the main process only
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        self.hooks = hooks or StepHooks()
        self.skipped_steps = 0
        self.nonfinite_steps = 0  # steps skipped for a NaN/inf loss or gradient norm (not fp16 overflows)
        self.last_grad_norm: torch.Tensor | None = None
        self._grads_scaled = False  # the gradients since the last step came through a scaled backward
        self._unscaled_warned = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float | None:
        return self.loss_scaler.scale if self.loss_scaler is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._grads_scaled = False

    def note_scaled_backward(self) -> None:
        """The gradients now held were produced from a loss multiplied by ``loss_scale`` elsewhere (the
        pipeline schedule scales its losses itself)."""
        self._grads_scaled = self.loss_scaler is not None

    def backward(self, loss: torch.Tensor) -> None:
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
            self._grads_scaled = True
        if self.hooks.backward_context is not None:
            with self.hooks.backward_context():
                loss.backward()
        else:
            loss.backward()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    @staticmethod
    def _local_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
        # Sharded (DTensor) gradients are scaled shard by shard.
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]

    def _unscale(self, grads: list[torch.Tensor], grad_divisor: float, scale: float) -> bool:
        """Divide gradients in place by ``scale * grad_divisor``; return whether any is inf/nan (checked only
        when loss scaling)."""
        inv = 1.0 / (scale * grad_divisor)
        if self.loss_scaler is None:
            if inv != 1.0 and grads:
                torch._foreach_mul_(grads, inv)
            return False
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        found = torch.zeros(1)
        for device, device_grads in by_device.items():
            found_inf = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                device_grads, found_inf, torch.full((), inv, device=device)
            )
            found += found_inf.cpu()
        if self.hooks.reduce_found_inf is not None:
            found = self.hooks.reduce_found_inf(found)
        return bool(found.item())

    def _norm(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The global gradient norm (over every shard of every rank)."""
        grads = [p.grad for p in params if id(p) not in self.hooks.norm_exclude]
        if not params:
            return None
        norm = _global_norm(grads) if grads else torch.zeros((), device=params[0].grad.device)
        if self.hooks.reduce_norm_sq is not None:
            norm = self.hooks.reduce_norm_sq(norm.float() ** 2).sqrt()
        return norm

    def _clip(self, params: list[torch.Tensor], norm: torch.Tensor) -> None:
        if self.clip_grad > 0:
            for group in _by_layout(params, lambda p: p.grad).values():
                torch.nn.utils.clip_grads_with_norm_(group, self.clip_grad, norm, foreach=True)

    def _non_finite(self, norm: torch.Tensor | None, loss: torch.Tensor | None) -> bool:
        """Whether the loss or the gradient norm is NaN/inf on any rank: one flag, reduced once per step."""
        values = [_whole(v).detach().float().reshape(()) for v in (norm, loss) if v is not None]
        if not values:
            return False
        flag = (~torch.isfinite(torch.stack([v.to(values[0].device) for v in values]))).any().float().reshape(1)
        if self.hooks.any_rank is not None:
            flag = self.hooks.any_rank(flag)
        return bool(flag.item())

    def step(self, grad_divisor: float = 1.0, loss: torch.Tensor | None = None) -> bool:
        """Returns False when the step was skipped: the gradients overflowed (fp16), or the loss (``loss``, this
        rank's) or the gradient norm is not finite on some rank (``nonfinite_steps`` counts those)."""
        params = self._params()
        if self.hooks.sync_grads is not None:
            self.hooks.sync_grads(params)
        scaled, self._grads_scaled = self._grads_scaled, False
        if self.loss_scaler is not None and not scaled and params:
            self._warn_unscaled()
        scale = self.loss_scaler.scale if scaled else 1.0
        if self._unscale(self._local_grads(params), grad_divisor, scale):
            self.skipped_steps += 1
            if scaled:  # an unscaled overflow says nothing about the scale
                self.loss_scaler.update(found_inf=True)
            self.last_grad_norm = None
            return False
        norm = self._norm(params)
        if self._non_finite(norm, loss):  # the update would write NaN/inf into the weights
            self.skipped_steps += 1
            self.nonfinite_steps += 1
            self.last_grad_norm = None
            return False
        self._clip(params, norm)
        self.last_grad_norm = norm
        self.optimizer.step()
        if scaled:
            self.loss_scaler.update(found_inf=False)
        return True

    def _warn_unscaled(self) -> None:
        if self._unscaled_warned or not self.warn:
            return
        self._unscaled_warned = True
        logging.getLogger(LOGGER_NAME).warning(
            "fp16: the gradients came from loss.backward(), not engine.backward(loss), so they carry no loss "
            "scale; they are stepped as they are, without loss scaling (small fp16 gradients may underflow to "
            "zero): call engine.backward(loss) for dynamic loss scaling"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
