"""Which strategy a run gets, from its flags and topology."""

from __future__ import annotations

from rapidlite.strategies.base import Strategy, StrategyContext


def select(ctx: StrategyContext) -> Strategy:
    """DeepSpeed when asked for; else pipeline parallelism when there are stages; else FSDP2 for ZeRO-2/3;
    else one process, DDP or ZeRO-1."""
    if ctx.topology.deepspeed:
        from rapidlite.strategies.deepspeed import DeepSpeed

        return DeepSpeed(ctx)
    if ctx.dist.topology.pp > 1:
        from rapidlite.strategies.pipeline import Pipeline

        return Pipeline(ctx)
    from rapidlite.strategies.torch_native import DataParallel, FullySharded

    if ctx.dist.initialized and ctx.topology.fully_sharded:
        return FullySharded(ctx)
    return DataParallel(ctx)
