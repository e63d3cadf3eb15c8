"""Rollouts for online RL: completions sampled from the training model (``sampling``), keyed per completion so
that every layout samples what one process samples."""
