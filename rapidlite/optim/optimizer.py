"""``RapidliteOptimizer``: the step every strategy takes (gradient clipping over every layout, loss scaling,
skipped steps), and its hooks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.observe.logging import LOGGER_NAME
from rapidlite.precision import LossScaler


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
