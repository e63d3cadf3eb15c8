"""Optimizers (weight-decay groups, fused kernels, bitsandbytes' 8-bit AdamW), the optimizer step every strategy
takes, and Megatron's learning-rate schedule."""

from rapidlite.optim.builders import apex_adamw_class, build_optimizer, optimizer_state_bytes, param_groups
from rapidlite.optim.optimizer import RapidliteOptimizer, StepHooks
from rapidlite.optim.schedule import LRScheduler, build_lr_scheduler, warmup_steps

__all__ = [
    "LRScheduler",
    "RapidliteOptimizer",
    "StepHooks",
    "apex_adamw_class",
    "build_lr_scheduler",
    "build_optimizer",
    "optimizer_state_bytes",
    "param_groups",
    "warmup_steps",
]
