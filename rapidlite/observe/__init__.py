"""What a run shows: logging and timers, progress bars, the curves, and the trackers beside ``metrics.jsonl``."""
