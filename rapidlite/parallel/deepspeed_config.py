"""The DeepSpeed config of a run: the user's JSON (``--deepspeed-config``) merged with the flags.

Torch-free, so flag validation stays fast. The rule: a flag given on the command line wins over the file
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

import argparse
import copy
import json
import math
import os
from typing import Any

from rapidlite.config.settings import Sections
from rapidlite.errors import ConfigError

AUTO = "auto"
_UNSET = object()


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


def _get(config: dict[str, Any], *path: str) -> Any:
    """The value at ``path``, or ``_UNSET`` when missing or "auto"."""
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _UNSET
        node = node[key]
    return _UNSET if node == AUTO else node


def _positive_int(value: Any, where: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"--deepspeed-config {path}: {where} must be a positive integer, got {value!r}")
    return value


def _stage_of(args: argparse.Namespace) -> int:
    if args.zero_3_memory_optimization:
        return 3
    if args.zero_2_memory_optimization:
        return 2
    return 1 if args.zero_1_memory_optimization else 0


def adopt_user_config(args: argparse.Namespace, config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What ``config`` supplies for the flags the command line left open, as ``{dest: value}`` (``args`` is
    only read; ``deepspeed_accumulation`` is the file's accumulation when no batch size decides it), and the
    notices of the file's values the command line overrides."""
    path = args.deepspeed_config
    explicit = args.explicit_flags  # None (args built by hand): every flag counts as given

    def given(*dests: str) -> bool:
        return explicit is None or any(d in explicit for d in dests)

    values: dict[str, Any] = {}
    notices: list[str] = []

    def notice(key: str, value: Any, flag: str, flag_value: Any) -> None:
        notices.append(f"{path}: {key} {value!r} replaced by {flag} {flag_value}")

    micro = _get(config, "train_micro_batch_size_per_gpu")
    if micro is not _UNSET:
        micro = _positive_int(micro, "train_micro_batch_size_per_gpu", path)
        if not given("micro_batch_size"):
            values["micro_batch_size"] = micro
        elif micro != args.micro_batch_size:
            notice("train_micro_batch_size_per_gpu", micro, "--micro-batch-size", args.micro_batch_size)

    total = _get(config, "train_batch_size")
    accumulation = _get(config, "gradient_accumulation_steps")
    if given("global_batch_size"):
        if total is not _UNSET and total != args.global_batch_size:
            notice("train_batch_size", total, "--global-batch-size", args.global_batch_size)
        elif accumulation is not _UNSET:
            notices.append(f"{path}: gradient_accumulation_steps follows --global-batch-size {args.global_batch_size}")
    elif total is not _UNSET:
        values["global_batch_size"] = _positive_int(total, "train_batch_size", path)
    elif accumulation is not _UNSET:
        values["deepspeed_accumulation"] = _positive_int(accumulation, "gradient_accumulation_steps", path)

    clip = _get(config, "gradient_clipping")
    if clip is not _UNSET:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
            raise ConfigError(f"--deepspeed-config {path}: gradient_clipping must be a number >= 0, got {clip!r}")
        if not given("clip_grad"):
            values["clip_grad"] = float(clip)
        elif float(clip) != args.clip_grad:
            notice("gradient_clipping", clip, "--clip-grad", args.clip_grad)

    bf16 = _get(config, "bf16", "enabled")
    if bf16 is _UNSET:
        bf16 = _get(config, "bfloat16", "enabled")
    fp16 = _get(config, "fp16", "enabled")
    wanted = "bf16" if bf16 is True else "fp16" if fp16 is True else None
    if wanted is not None:
        if not given("fp16", "bf16", "mixed_precision"):
            values["precision"] = wanted
        elif args.precision not in (wanted, "auto"):
            flag = {"fp32": "(no precision flag)", "fp16": "--fp16", "bf16": "--bf16"}[args.precision]
            notices.append(f"{path}: {wanted} enabled, but the command line asks for {args.precision} {flag}")

    stage = _get(config, "zero_optimization", "stage")
    if stage is not _UNSET:
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"--deepspeed-config {path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        zero_dests = [f"zero_{n}_memory_optimization" for n in (1, 2, 3)] + ["fsdp_memory_optimization"]
        if not given(*zero_dests):
            if stage:
                values[f"zero_{stage}_memory_optimization"] = True
        elif stage != _stage_of(args):
            flag = f"--zero-{_stage_of(args)}-memory-optimization" if _stage_of(args) else "(no ZeRO flag)"
            notices.append(f"{path}: zero_optimization.stage {stage} replaced by {flag}")

    device = _get(config, "zero_optimization", "offload_optimizer", "device")
    if device == "cpu" and not given("cpu_offload"):
        values["cpu_offload"] = True

    dropped = [f"'{section}'" for section in ("optimizer", "scheduler") if section in config]
    if dropped:
        notices.append(
            f"{path}: {' and '.join(dropped)} left out; rapidlite's flags (--optimizer, --lr, --weight-decay, "
            "--lr-decay-style, --lr-warmup-*) define the optimizer and its schedule"
        )
    return values, notices


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
    run, scaling = settings.training, settings.precision
    config["train_micro_batch_size_per_gpu"] = run.micro_batch_size
    config["gradient_accumulation_steps"] = run.gradient_accumulation_steps
    config["train_batch_size"] = run.global_batch_size
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
            if settings.given(dest) or _get(fp16, key) is _UNSET:
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
