"""Optimizers: weight-decay groups, fused kernels (torch's, Apex's), bitsandbytes' 8-bit AdamW."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rapidlite.config.sections import EIGHT_BIT_OPTIMIZERS, OptimizerConfig
from rapidlite.errors import ConfigError
from rapidlite.models.apex import nvidia_apex
from rapidlite.optim import eight_bit


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
    model: torch.nn.Module,
    cfg: OptimizerConfig,
    zero1_group: Any = None,
    *,
    allow_apex: bool = True,
    apart: frozenset[int] = frozenset(),
) -> torch.optim.Optimizer:
    """AdamW or SGD over decay groups, fused where the device has the kernels: Apex's FusedAdam for AdamW on
    CUDA when Apex is installed (see ``apex_adamw_class``; ``allow_apex=False`` keeps torch's), else torch's
    fused or foreach kernels; bitsandbytes' 8-bit AdamW (``eight_bit``) over the same groups. With
    ``zero1_group`` the optimizer state is sharded over that process group (ZeRO-1), but for the parameters whose
    ids are in ``apart`` (this rank's experts under expert parallelism)."""
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

        return build_zero1_optimizer(groups, cls, zero1_group, apart, lr=cfg.lr, **defaults, **kernels)
    return cls(groups, lr=cfg.lr, **defaults, **kernels)
