"""Trackers beside ``metrics.jsonl``: one interface (``base``), TensorBoard, Weights & Biases and MLflow behind it,
and the registry that resolves ``--report-to``."""

from rapidlite.observe.trackers.base import Tracker, Trackers, TrackingError
from rapidlite.observe.trackers.registry import TRACKERS, build_trackers, resolve_trackers

__all__ = ["TRACKERS", "Tracker", "Trackers", "TrackingError", "build_trackers", "resolve_trackers"]
