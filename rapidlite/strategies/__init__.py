"""Strategies: one object per backend that sets a model up and carries out its step, checkpoints and export
(see ``base.Strategy``). ``select`` picks the run's from its flags and topology."""

from rapidlite.strategies.base import Strategy, StrategyContext
from rapidlite.strategies.selection import select

__all__ = ["Strategy", "StrategyContext", "select"]
