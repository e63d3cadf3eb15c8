"""The memory and time plan of a run, from its settings alone (``memory``: what each rank holds; ``timing``: how long
a step takes; ``search``: the layouts that fit)."""

from rapidlite.planning.memory import GiB, MiB, Plan, RankPlan, largest_micro_batch, plan

__all__ = ["GiB", "MiB", "Plan", "RankPlan", "largest_micro_batch", "plan"]
