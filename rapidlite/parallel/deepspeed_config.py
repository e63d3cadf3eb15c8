"""The DeepSpeed config of a run: the user's JSON (``--deepspeed-config``) merged with the flags.

Torch-free, so flag validation stays fast. The file's keys are read into the flags once, by
``rapidlite.resolve.topology`` (the one table of spellings); here the resolved settings are written back
out for ``deepspeed.initialize``. The rule: a flag given on the command line wins over the file
(with a notice when they disagree); what the flags leave open, the file supplies (and the flags' derived
values follow it: a file's ``train_micro_batch_size_per_gpu`` is the run's micro batch); what neither
gives takes rapidlite's defaults. ``"auto"`` in the file (the Hugging Face convention) means "not given".
rapidlite's flags own the optimizer and the learning-rate schedule, so a file's ``optimizer`` and
``scheduler`` sections are left out, with a notice.

=====================================  ====================================================================
DeepSpeed key                          flag
=====================================  ====================================================================
``train_micro_batch_size_per_gpu``     ``--micro-batch-size``
``train_batch_size``                   ``--global-batch-size``
``gradient_accumulation_steps``        derived: global / (micro x data-parallel size)
``gradient_clipping``                  ``--clip-grad``
``bf16.enabled`` / ``fp16.enabled``    ``--bf16`` / ``--fp16`` / ``--mixed-precision``
``fp16.loss_scale``, ...               ``--loss-scale`` (0: dynamic), ``--initial-loss-scale`` (as a power
                                       of 2), ``--loss-scale-window``, ``--hysteresis``, ``--min-loss-scale``
``zero_optimization.stage``            ``--zero-{1,2,3}-memory-optimization``
``zero_optimization.offload_*``        ``--cpu-offload``: optimizer state, and with ZeRO-3 parameters too
=====================================  ====================================================================
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from rapidlite.config.settings import Sections
from rapidlite.errors import ConfigError

AUTO = "auto"
UNSET = object()


def read_user_config(path: str) -> dict[str, Any]:
    """The file as a dict, or a one-line error naming what is wrong with it."""
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed-config {path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--deepspeed-config {path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed-config {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed-config {path}: expected a JSON object of DeepSpeed settings")
    return config


def file_value(config: dict[str, Any], *path: str) -> Any:
    """The value at ``path``, or ``UNSET`` when missing or "auto"."""
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return UNSET
        node = node[key]
    return UNSET if node == AUTO else node


def positive_int(value: Any, where: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"--deepspeed-config {path}: {where} must be a positive integer, got {value!r}")
    return value


def _drop_auto(node: Any) -> Any:
    """Remove leftover "auto" values, so DeepSpeed's own defaults apply there."""
    if isinstance(node, dict):
        return {k: _drop_auto(v) for k, v in node.items() if v != AUTO}
    return node


def build_config(settings: Sections, precision: str, stage: int, cpu_offload: bool) -> dict[str, Any]:
    """The config handed to ``deepspeed.initialize``: the user's file with every flag applied."""
    config = copy.deepcopy(settings.parallel.deepspeed_user_config or {})
    for section in ("optimizer", "scheduler"):
        config.pop(section, None)
    batch, scaling = settings.batching, settings.precision
    config["train_micro_batch_size_per_gpu"] = batch.micro_batch_size
    config["gradient_accumulation_steps"] = batch.gradient_accumulation_steps
    config["train_batch_size"] = batch.global_batch_size
    config["gradient_clipping"] = settings.optim.clip_grad

    config.pop("bfloat16", None)
    bf16 = config.setdefault("bf16", {})
    fp16 = config.setdefault("fp16", {})
    bf16["enabled"] = precision == "bf16"
    fp16["enabled"] = precision == "fp16"
    if precision == "fp16":
        # Flags given on the command line win; otherwise the file's values, else the flags' defaults.
        for key, dest, value in (
            ("loss_scale", "loss_scale", scaling.loss_scale or 0),
            ("initial_scale_power", "initial_loss_scale", int(round(math.log2(scaling.initial_loss_scale)))),
            ("loss_scale_window", "loss_scale_window", scaling.loss_scale_window),
            ("hysteresis", "hysteresis", scaling.hysteresis),
            ("min_loss_scale", "min_loss_scale", scaling.min_loss_scale),
        ):
            if settings.given(dest) or file_value(fp16, key) is UNSET:
                fp16[key] = value

    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = stage
    if cpu_offload:
        zero.setdefault("offload_optimizer", {})["device"] = "cpu"
        if stage == 3:
            zero.setdefault("offload_param", {})["device"] = "cpu"
    # The optimizer is a torch one built from the flags (decay groups, fused kernels): allow it under ZeRO
    # and under offload, where DeepSpeed would otherwise insist on its own CPU Adam.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config.setdefault("steps_per_print", 2**31 - 1)  # rapidlite logs the steps itself
    return _drop_auto(config)
