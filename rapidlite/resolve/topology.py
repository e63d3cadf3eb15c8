"""Every spelling of a layout, mapped onto one ``Topology`` and one ``Batching`` (``rapidlite.config.topology``).

The one table of spellings. Megatron's and Rapidformer's flags, Megatron's ``--use-distributed-optimizer`` and a
DeepSpeed file's keys all say the same few things; here they become the flags' values (a flag given on the command
line wins over the file, with a notice), and from those, once, the frozen ``Topology`` and ``Batching`` the code
below ``resolve`` reads. Nothing below reads the ZeRO flags or derives a stage again (a test keeps it so).

================================================  ==============================================================
spelling                                          Topology / Batching
================================================  ==============================================================
(none)                                            zero_stage 0: DDP over the data-parallel ranks
``--zero-1-memory-optimization``                  zero_stage 1
``--use-distributed-optimizer`` (Megatron)        zero_stage 1 (ZeRO-2/3 shard the optimizer state already)
``--zero-2-memory-optimization``                  zero_stage 2
``--zero-3-memory-optimization``                  zero_stage 3
``--fsdp-memory-optimization``                    zero_stage 3
``zero_optimization.stage`` (DeepSpeed file)      zero_stage, where no ZeRO flag is given
``--cpu-offload``                                 cpu_offload
``zero_optimization.offload_optimizer.device``    cpu_offload (``"cpu"``), where ``--cpu-offload`` is not given
``--deepspeed``, ``--deepspeed-config``           backend ``deepspeed`` (else ``torch``)
``--tensor/pipeline-model-parallel-size``         tp, pp; dp = world / (tp x pp x cp)
``--context-parallel-size``                       cp
``--micro-batch-size``                            micro_batch_size
``train_micro_batch_size_per_gpu`` (DeepSpeed)    micro_batch_size, where the flag is not given
``--global-batch-size``                           global_batch_size (default: micro x dp)
``train_batch_size`` (DeepSpeed)                  global_batch_size, where the flag is not given
``gradient_accumulation_steps`` (DeepSpeed)       global_batch_size = micro x dp x steps, where neither batch is given
(derived)                                         gradient_accumulation_steps = global / (micro x dp)
================================================  ==============================================================
"""

from __future__ import annotations

import argparse
from typing import Any

from rapidlite.config.topology import Batching, Topology
from rapidlite.errors import ConfigError
from rapidlite.parallel.deepspeed_config import UNSET, file_value, positive_int

# The flags that ask for a ZeRO stage, and the stage each asks for; given together, the highest wins (the checks
# refuse the pairs that contradict each other).
ZERO_STAGE_FLAGS: dict[str, int] = {
    "zero_1_memory_optimization": 1,
    "zero_2_memory_optimization": 2,
    "zero_3_memory_optimization": 3,
    "fsdp_memory_optimization": 3,
    "use_distributed_optimizer": 1,
}


def zero_stage(args: argparse.Namespace) -> int:
    """The ZeRO stage the flags ask for: the one derivation of it."""
    return max((stage for dest, stage in ZERO_STAGE_FLAGS.items() if getattr(args, dest)), default=0)


def adopt_distributed_optimizer(args: argparse.Namespace) -> None:
    """Megatron's ``--use-distributed-optimizer`` in the ZeRO flags' spelling: ZeRO-1 (with expert parallelism
    beside the experts' own optimizer), unless ZeRO-2/3 shard the optimizer state already."""
    if not args.use_distributed_optimizer or zero_stage(args) >= 2:
        return
    if args.tensor_model_parallel_size > 1:
        raise ConfigError(
            "--use-distributed-optimizer is ZeRO-1 here, which does not combine with tensor parallelism; with "
            "it use --zero-2-memory-optimization (FSDP2 over the data-parallel ranks)"
        )
    args.zero_1_memory_optimization = True


def adopt_user_config(args: argparse.Namespace, config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a DeepSpeed file supplies for the flags the command line left open, as ``{dest: value}`` (``args`` is
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

    micro = file_value(config, "train_micro_batch_size_per_gpu")
    if micro is not UNSET:
        micro = positive_int(micro, "train_micro_batch_size_per_gpu", path)
        if not given("micro_batch_size"):
            values["micro_batch_size"] = micro
        elif micro != args.micro_batch_size:
            notice("train_micro_batch_size_per_gpu", micro, "--micro-batch-size", args.micro_batch_size)

    total = file_value(config, "train_batch_size")
    accumulation = file_value(config, "gradient_accumulation_steps")
    if given("global_batch_size"):
        if total is not UNSET and total != args.global_batch_size:
            notice("train_batch_size", total, "--global-batch-size", args.global_batch_size)
        elif accumulation is not UNSET:
            notices.append(f"{path}: gradient_accumulation_steps follows --global-batch-size {args.global_batch_size}")
    elif total is not UNSET:
        values["global_batch_size"] = positive_int(total, "train_batch_size", path)
    elif accumulation is not UNSET:
        values["deepspeed_accumulation"] = positive_int(accumulation, "gradient_accumulation_steps", path)

    clip = file_value(config, "gradient_clipping")
    if clip is not UNSET:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
            raise ConfigError(f"--deepspeed-config {path}: gradient_clipping must be a number >= 0, got {clip!r}")
        if not given("clip_grad"):
            values["clip_grad"] = float(clip)
        elif float(clip) != args.clip_grad:
            notice("gradient_clipping", clip, "--clip-grad", args.clip_grad)

    bf16 = file_value(config, "bf16", "enabled")
    if bf16 is UNSET:
        bf16 = file_value(config, "bfloat16", "enabled")
    fp16 = file_value(config, "fp16", "enabled")
    wanted = "bf16" if bf16 is True else "fp16" if fp16 is True else None
    if wanted is not None:
        if not given("fp16", "bf16", "mixed_precision"):
            values["precision"] = wanted
        elif args.precision not in (wanted, "auto"):
            flag = {"fp32": "(no precision flag)", "fp16": "--fp16", "bf16": "--bf16"}[args.precision]
            notices.append(f"{path}: {wanted} enabled, but the command line asks for {args.precision} {flag}")

    stage = file_value(config, "zero_optimization", "stage")
    if stage is not UNSET:
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"--deepspeed-config {path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        if not given(*ZERO_STAGE_FLAGS):
            if stage:
                values[f"zero_{stage}_memory_optimization"] = True
        elif stage != zero_stage(args):
            flag = f"--zero-{zero_stage(args)}-memory-optimization" if zero_stage(args) else "(no ZeRO flag)"
            notices.append(f"{path}: zero_optimization.stage {stage} replaced by {flag}")

    device = file_value(config, "zero_optimization", "offload_optimizer", "device")
    if device == "cpu" and not given("cpu_offload"):
        values["cpu_offload"] = True

    dropped = [f"'{section}'" for section in ("optimizer", "scheduler") if section in config]
    if dropped:
        notices.append(
            f"{path}: {' and '.join(dropped)} left out; rapidlite's flags (--optimizer, --lr, --weight-decay, "
            "--lr-decay-style, --lr-warmup-*) define the optimizer and its schedule"
        )
    return values, notices


def topology_of(args: argparse.Namespace, world_size: int) -> Topology:
    """The run's ``Topology``: ``world_size`` processes split as the flags ask (after the spellings above are
    adopted and the checks passed)."""
    return Topology.split(
        world_size,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        zero_stage=zero_stage(args),
        cpu_offload=args.cpu_offload,
        backend="deepspeed" if args.deepspeed else "torch",
    )


def batching_of(args: argparse.Namespace, topology: Topology) -> Batching:
    """Megatron's batch arithmetic: accumulation = global / (micro x data-parallel size); the global batch
    defaults to one micro-batch per rank (times a DeepSpeed file's accumulation)."""
    per_step = args.micro_batch_size * topology.dp
    global_batch = args.global_batch_size
    if global_batch is None:
        global_batch = per_step * (args.deepspeed_accumulation or 1)
    if global_batch % per_step != 0:
        raise ConfigError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {topology.dp} = {per_step}; use a multiple of {per_step}"
        )
    return Batching(
        micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=global_batch // per_step,
        global_batch_size=global_batch,
    )
