"""The rules ``resolve`` checks the parsed flags against: each contradiction is a ``ConfigError`` of one line
naming the flag and the fix (ranges, LoRA, the task's needs, the schedule, precision, the parallel layout)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rapidlite.config import moe as moe_flags
from rapidlite.config.fields import flag_fields, option
from rapidlite.config.sections import LR_DECAY_STYLES
from rapidlite.config.settings import SECTION_NAMES, Sections
from rapidlite.config.tasks import TaskSpec, check_options, context_parallel_tasks, get_task, task_names
from rapidlite.config.topology import Batching, Topology, check_context_parallel
from rapidlite.errors import ConfigError
from rapidlite.runtime.environ import env_int, launch_value
from rapidlite.runtime.world import num_nodes


def section_of(args: argparse.Namespace, name: str) -> Any:
    """One section of the flags being resolved (for the rules that live with a section's reader)."""
    return getattr(Sections.of(vars(args)), name)


# Flags whose values must be positive integers, and those that must not be negative.
POSITIVE_INTS = """
micro_batch_size global_batch_size epochs train_iters num_layers hidden_size num_attention_heads
ffn_hidden_size seq_length max_position_embeddings log_interval eval_interval eval_iters save_interval
keep_last tensor_model_parallel_size pipeline_model_parallel_size expert_model_parallel_size loss_scale_window
hysteresis recompute_num_layers make_vocab_size_divisible_by vocab_size nproc_per_node nnodes max_prompt_length
""".split()
NOT_NEGATIVE = "num_workers max_restarts node_rank eval_generate max_skipped_steps moe_aux_loss_coeff".split()


def check_ranges(args: argparse.Namespace) -> None:
    for name in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    for name in ("time_budget", "distributed_timeout_minutes"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value:g}: must be a positive number of minutes")
    for name in NOT_NEGATIVE:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be >= 0")
    for name in ("lr", "initial_loss_scale", "min_loss_scale", "loss_scale", "peak_flops"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be positive")
    for name in ("min_lr", "weight_decay", "clip_grad", "adam_eps", "sgd_momentum", "moe_z_loss_coeff"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    for name in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be in [0, 1)")


def check_rest(args: argparse.Namespace) -> None:
    pretrained = args.pretrained_model_name_or_path
    tp = args.tensor_model_parallel_size or 1
    moe_flags.check(section_of(args, "moe"), args.explicit_flags or frozenset(), pretrained, tp)
    ep = args.expert_model_parallel_size
    moe_flags.check_expert_parallel(ep, tp, args.deepspeed)
    for name in ("mask_prob", "short_seq_prob"):
        if not 0 <= getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in [0, 1)")
    if args.init_method_std <= 0:
        raise ConfigError(f"--init-method-std {args.init_method_std}: must be positive")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.keep_last is not None and args.save is None:
        raise ConfigError("--keep-last needs --save DIR")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.streaming and (args.task is None or args.user_script is not None):
        raise ConfigError("--streaming is read by --task causal_lm and pretraining; a user script streams its own data")
    if args.context_parallel_size > 1 and (args.task is None or args.user_script is not None):
        raise ConfigError(
            f"--context-parallel-size is read by the tasks that cut sequences into the ranks' shards "
            f"({context_parallel_tasks()}); a user script's forward step sees whole ones"
        )
    if args.padding_free and args.packing:
        raise ConfigError(
            "--padding-free and --packing both remove padding: --packing packs rows into --seq-length sequences "
            "before training, --padding-free packs each micro-batch into one row; choose one"
        )
    if args.memory_budget is not None and not args.dry_run:
        raise ConfigError("--memory-budget is read by the plan: add --dry-run")
    if args.device_profile is not None and not args.dry_run:
        raise ConfigError("--device-profile is read by the plan: add --dry-run")
    if args.search and (not args.dry_run or args.device_profile is None or args.memory_budget is None):
        raise ConfigError(
            "--search ranks the layouts that fit a device: give it with --dry-run --device-profile NAME "
            "--memory-budget GIB"
        )
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise ConfigError(f"--memory-budget {args.memory_budget:g}: must be a positive number of GiB per device")


def check_lora(args: argparse.Namespace) -> None:
    """The LoRA and quantisation flags: consistent, installed, and on a layout that can take them."""
    rank = args.lora_rank
    if rank < 0:
        raise ConfigError(f"--lora-rank {rank}: must be a positive integer (0 or absent: full fine-tuning)")
    quant = "--load-in-4bit" if args.load_in_4bit else "--load-in-8bit" if args.load_in_8bit else None
    if rank == 0:
        given = [
            flag
            for flag, on in (
                ("--lora-alpha", args.lora_alpha is not None),
                ("--lora-dropout", args.lora_dropout != 0.0),
                ("--lora-target-modules", args.lora_target_modules is not None),
                ("--lora-modules-to-save", args.lora_modules_to_save is not None),
                ("--merge-lora", args.merge_lora),
                ("--use-dora", args.use_dora),
                ("--use-rslora", args.use_rslora),
                ("--loraplus-lr-ratio", args.loraplus_lr_ratio is not None),
                ("--lora-init", args.lora_init != "default"),
            )
            if on
        ]
        if given:
            raise ConfigError(f"{given[0]} configures LoRA adapters: add --lora-rank R (for example 8)")
        if quant:
            raise ConfigError(f"{quant} freezes the base weights: add --lora-rank R to train LoRA adapters on them")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha {args.lora_alpha}: must be positive")
    if args.loraplus_lr_ratio is not None and args.loraplus_lr_ratio <= 0:
        raise ConfigError(f"--loraplus-lr-ratio {args.loraplus_lr_ratio:g}: must be positive (LoRA+ suggests 16)")
    if args.lora_init in ("pissa", "olora") and (args.load_in_4bit or args.load_in_8bit):
        raise ConfigError(
            f"--lora-init {args.lora_init} rewrites the base weights from their decomposition, which quantised "
            "weights do not allow: drop --load-in-4bit/--load-in-8bit or use --lora-init default"
        )
    if not 0 <= args.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout {args.lora_dropout}: must be in [0, 1)")
    if args.load_in_4bit and args.load_in_8bit:
        raise ConfigError("--load-in-4bit and --load-in-8bit are exclusive: choose one")
    if args.bnb_4bit_use_double_quant and not args.load_in_4bit:
        raise ConfigError("--bnb-4bit-use-double-quant quantises 4-bit scales: add --load-in-4bit")
    if rank == 0:
        return
    from rapidlite.models.lora import require_bitsandbytes, require_peft

    require_peft()
    for flag, size in (
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
    ):
        if size > 1:
            raise ConfigError(
                f"--lora-rank with {flag} {size}: LoRA trains with data parallelism (DDP, ZeRO, FSDP, DeepSpeed); "
                f"drop {flag}"
            )
    if quant:
        require_bitsandbytes(quant)
        sharded = (
            "--deepspeed"
            if args.deepspeed
            else next(
                (
                    flag
                    for flag, on in (
                        ("--zero-2-memory-optimization", args.zero_2_memory_optimization),
                        ("--zero-3-memory-optimization", args.zero_3_memory_optimization),
                        ("--fsdp-memory-optimization", args.fsdp_memory_optimization),
                    )
                    if on
                ),
                None,
            )
        )
        if sharded:
            raise ConfigError(
                f"{quant} with {sharded}: quantised base weights are not sharded; train them on one process, with "
                "DDP or with --zero-1-memory-optimization (drop one of the two)"
            )


def check_task(
    task: TaskSpec, args: argparse.Namespace, topology: Topology | None = None, batching: Batching | None = None
) -> None:
    """What the chosen black-box task needs (``rapidlite.config.tasks``); its own check sees the resolved layout."""
    if not args.demo:
        missing = [flag for flag in task.required if getattr(args, flag.lstrip("-").replace("-", "_")) is None]
        if missing:
            hint = " (or --demo for the embedded offline example)" if task.demo else ""
            raise ConfigError(f"--task {task.name} needs {' and '.join(missing)}{hint}")
    if task.iteration_based and args.train_iters is None:
        raise ConfigError(f"--task {task.name} is iteration-based: pass --train-iters N")
    if task.iteration_based and (args.group_by_length or args.padding_free):
        flag = "--group-by-length" if args.group_by_length else "--padding-free"
        raise ConfigError(
            f"{flag} batches fine-tuning data of varying lengths; --task {task.name} trains fixed-length samples: "
            f"drop {flag}"
        )
    check_options(task, vars(args))
    if task.ignored:
        sections = Sections.of(vars(args))
        for name in SECTION_NAMES:
            section = getattr(sections, name)
            for f, _ in flag_fields(type(section)):
                if (name in task.ignored or f.name in task.ignored) and getattr(section, f.name) != f.default:
                    raise ConfigError(f"{option(f.name)}: --task {task.name} does not use it; drop the flag")
    if args.eval_harness:
        if not task.eval_harness:
            raise ConfigError(
                f"--eval-harness scores a causal language model: --task causal_lm, dpo or kto, not {task.name}"
            )
        from rapidlite.evaluation.harness import load_harness

        load_harness(args.eval_harness)  # read and checked before anything loads
    if args.streaming:
        check_streaming(task, args)
    if args.context_parallel_size > 1 and not task.context_parallel:
        raise ConfigError(
            f"--context-parallel-size: --task {task.name} does not split its sequences over ranks; context "
            f"parallelism serves --task {context_parallel_tasks()}"
        )
    if topology is not None:
        given = "cp_comm_type" in (args.explicit_flags or ())
        check_context_parallel(topology, args.seq_length, args.sequence_parallel, given)
    if task.check is not None:
        task.check(Sections.of(vars(args), topology, batching))


def check_streaming(task: TaskSpec, args: argparse.Namespace) -> None:
    """``--streaming``: a task that reads text as a stream, one local text source, a run sized in iterations."""
    if not task.streaming:
        streams = " and ".join(name for name in task_names() if get_task(name).streaming)
        raise ConfigError(f"--streaming serves --task {streams}; --task {task.name} reads its data whole: drop it")
    if args.data_path is None or args.demo:
        raise ConfigError("--streaming reads --data-path (a .jsonl or .parquet file, or a directory of them)")
    if len(args.data_path) > 1:
        raise ConfigError("--streaming reads one --data-path (a file, or a directory with train and validation files)")
    path = args.data_path[0]
    if path.endswith((".bin", ".idx")) or os.path.isfile(f"{path}.bin") or os.path.isfile(f"{path}.idx"):
        raise ConfigError(
            f"--streaming reads text; --data-path {path} is Megatron .bin/.idx data, already tokenized and "
            "memory-mapped (it never loads whole): drop --streaming"
        )
    given = args.explicit_flags or frozenset()
    if "epochs" in given or args.train_iters is None:
        raise ConfigError(
            "--streaming: a stream's length is unknown until it is read, so --epochs cannot size the run; give "
            "--train-iters N"
        )
    if "split" in given:
        raise ConfigError(
            "--split: a stream is not carved into splits (its length is unknown); hold validation rows out in a "
            "validation.jsonl beside train.jsonl"
        )
    for name, on in (
        ("--eval-only", args.eval_only),
        ("--group-by-length", args.group_by_length),
        ("--padding-free", args.padding_free),
    ):
        if on:
            raise ConfigError(f"{name} needs the whole data set up front; --streaming reads it as it trains: drop one")


def check_lr(args: argparse.Namespace) -> list[str]:
    if args.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"--lr-decay-style {args.lr_decay_style}: unknown; choose one of {', '.join(LR_DECAY_STYLES)}"
        )
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise ConfigError("--lr-warmup-iters and --lr-warmup-fraction are exclusive: give one of them")
    if args.lr_warmup_iters is not None and args.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters {args.lr_warmup_iters}: must be >= 0")
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction <= 1:
        raise ConfigError(f"--lr-warmup-fraction {args.lr_warmup_fraction}: must be in [0, 1]")
    if args.lr_decay_iters is not None and args.lr_decay_iters <= 0:
        raise ConfigError(f"--lr-decay-iters {args.lr_decay_iters}: must be a positive integer")
    # A warmup longer than the run warms up over the whole run, as the Hugging Face Trainer does, said in one
    # line before anything loads when the run's length is on the command line (an epoch-based run learns its
    # length from the data: optim.build_lr_scheduler clamps and says it then).
    decay = args.lr_decay_iters or args.train_iters
    warmup = args.lr_warmup_iters
    if decay and warmup is not None and warmup > decay and args.lr_decay_style != "constant":
        which = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        args.lr_warmup_iters = decay
        return [
            f"--lr-warmup-iters {warmup} is longer than {which} {decay}: warming up over all {decay} iterations "
            f"(the learning rate reaches --lr only at the end); lower --lr-warmup-iters"
        ]
    return []


def precision_of_flags(args: argparse.Namespace) -> str:
    """'fp32', 'bf16', 'fp16' or 'auto' (mixed: the engine picks per device), as the flags ask."""
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive: give one of them (or --mixed-precision)")
    if args.fp16:
        return "fp16"
    if args.bf16:
        return "bf16"
    return "auto" if args.mixed_precision else "fp32"


def check_precision(args: argparse.Namespace) -> None:
    """The loss-scaling flags against the precision the run ends up with (after a DeepSpeed file)."""
    if args.loss_scale is not None and args.precision in ("fp32", "bf16"):
        raise ConfigError("--loss-scale only applies to fp16: add --fp16 or drop --loss-scale")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError("--min-loss-scale is larger than --initial-loss-scale")


def resolve_recompute(args: argparse.Namespace) -> None:
    if args.recompute_granularity is not None or args.recompute_num_layers is not None:
        args.checkpoint_activations = True
    if args.checkpoint_activations and args.recompute_granularity is None:
        args.recompute_granularity = "full"


def check_offload_activations(args: argparse.Namespace) -> None:
    """``--offload-activations`` hooks the forward pass the strategy runs for each micro-batch: layouts that run
    their own forward and backward, or save tensor subclasses the hooks leave on the device, are refused."""
    if not args.offload_activations:
        return
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    for on, flag, why in (
        (args.deepspeed, "--deepspeed", "DeepSpeed's engine runs the backward pass itself"),
        (pp > 1, f"--pipeline-model-parallel-size {pp}", "the pipeline schedule runs its own forward and backward"),
        (tp > 1, f"--tensor-model-parallel-size {tp}", "DTensor activations would stay on the device"),
    ):
        if on:
            raise ConfigError(
                f"--offload-activations does not combine with {flag} ({why}): drop one of them "
                "(it runs on one process, DDP, ZeRO-1 and ZeRO-2/3 on FSDP2)"
            )


def check_data_parallel(args: argparse.Namespace) -> None:
    stages = [
        flag
        for flag, on in (
            ("--zero-1-memory-optimization", args.zero_1_memory_optimization),
            ("--zero-2-memory-optimization", args.zero_2_memory_optimization),
            ("--zero-3-memory-optimization", args.zero_3_memory_optimization),
        )
        if on
    ]
    if len(stages) > 1:
        raise ConfigError(f"{' and '.join(stages)} are exclusive: give one ZeRO stage")
    if args.fsdp_memory_optimization and (args.zero_1_memory_optimization or args.zero_2_memory_optimization):
        raise ConfigError(f"--fsdp-memory-optimization is ZeRO-3 already: drop {stages[0]}")
    if args.cpu_offload and not (
        args.zero_2_memory_optimization or args.zero_3_memory_optimization or args.fsdp_memory_optimization
    ):
        raise ConfigError(
            "--cpu-offload keeps sharded state in host memory: add --zero-2-memory-optimization, "
            "--zero-3-memory-optimization or --fsdp-memory-optimization"
        )
    if args.deepspeed and args.fsdp_memory_optimization:
        raise ConfigError(
            "--fsdp-memory-optimization is PyTorch's FSDP; with --deepspeed use --zero-3-memory-optimization"
        )
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits tensor-parallel regions: add --tensor-model-parallel-size N > 1")
    if tp > 1:
        for on, flag, why in (
            (args.deepspeed, "--deepspeed", "rapidlite's tensor parallelism runs on PyTorch's DTensor"),
            (args.zero_1_memory_optimization, "--zero-1-memory-optimization", "use --zero-2 or --zero-3 (FSDP2)"),
            (args.cpu_offload, "--cpu-offload", "offload is not tested with tensor parallelism yet"),
        ):
            if on:
                raise ConfigError(f"{flag} does not combine with --tensor-model-parallel-size {tp}: {why}")
    check_pipeline(args)
    if args.deepspeed and args.no_save_optim:
        raise ConfigError(
            "--no-save-optim: DeepSpeed's checkpoints always hold the optimizer state (its fp32 weights live "
            "there); drop the flag under --deepspeed"
        )
    nnodes = num_nodes(section_of(args, "parallel"))
    launching = not args.dry_run  # a plan of a cluster needs no rendezvous
    if (
        launching
        and nnodes > 1
        and not env_int("WORLD_SIZE", 0)
        and not (args.master_addr or launch_value("MASTER_ADDR"))
    ):
        raise ConfigError(f"--nnodes {nnodes}: give --master-addr (or MASTER_ADDR), the host of node 0")
    if args.per_rank_logs and args.save is None:
        raise ConfigError("--per-rank-logs writes to --save DIR/logs: add --save DIR")


def check_optimizer(args: argparse.Namespace) -> None:
    """``--optimizer adamw8bit``/``paged_adamw8bit``: bitsandbytes installed, a layout whose optimizer steps whole
    plain tensors (one process, DDP, pipeline stages), and CUDA for the paged one."""
    optim = section_of(args, "optim")
    if not optim.eight_bit:
        return
    name = f"--optimizer {optim.optimizer}"
    shards = "its parameters are DTensor shards, and bitsandbytes quantises whole plain tensors"
    tp = args.tensor_model_parallel_size
    for on, flag, why in (
        (args.deepspeed, "--deepspeed", "DeepSpeed steps the optimizer on its own flattened partitions"),
        (
            args.zero_1_memory_optimization,
            "--zero-1-memory-optimization",
            "ZeRO-1's ZeroRedundancyOptimizer partitions torch optimizers' state",
        ),
        (args.zero_2_memory_optimization, "--zero-2-memory-optimization", f"FSDP2: {shards}"),
        (args.zero_3_memory_optimization, "--zero-3-memory-optimization", f"FSDP2: {shards}"),
        (args.fsdp_memory_optimization, "--fsdp-memory-optimization", f"FSDP2: {shards}"),
        (tp > 1, f"--tensor-model-parallel-size {tp}", f"tensor parallelism: {shards}"),
    ):
        if on:
            raise ConfigError(
                f"{name} does not combine with {flag} ({why}): use --optimizer adamw with it, or drop {flag} "
                "(8-bit AdamW trains on one process, with DDP or with pipeline parallelism)"
            )
    from rapidlite.models.lora import require_bitsandbytes

    require_bitsandbytes(name)
    if optim.optimizer == "paged_adamw8bit":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"{name} pages its state through CUDA unified memory and this machine has no CUDA device "
                "(bitsandbytes would keep it unpaged): use --optimizer adamw8bit"
            )


def check_pipeline(args: argparse.Namespace) -> None:
    pp = args.pipeline_model_parallel_size
    virtual_layers = args.num_layers_per_virtual_pipeline_stage
    if virtual_layers is not None and virtual_layers <= 0:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {virtual_layers}: must be a positive integer")
    if args.pipeline_schedule is None:
        args.pipeline_schedule = "interleaved-1f1b" if virtual_layers else "1f1b"
    if pp == 1:
        for on, flag in (
            (args.num_layers_per_virtual_pipeline_stage, "--num-layers-per-virtual-pipeline-stage"),
            (args.pipeline_split, "--pipeline-split"),
        ):
            if on:
                raise ConfigError(f"{flag} splits a pipeline: add --pipeline-model-parallel-size N > 1")
        return
    if args.pipeline_schedule == "interleaved-1f1b" and not virtual_layers:
        raise ConfigError(
            "--pipeline-schedule interleaved-1f1b runs several stages per rank: add "
            "--num-layers-per-virtual-pipeline-stage N"
        )
    if virtual_layers and args.pipeline_schedule != "interleaved-1f1b":
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage runs the interleaved schedule, not {args.pipeline_schedule}: "
            "use --pipeline-schedule interleaved-1f1b"
        )
    if args.task is not None and args.user_script is None and not get_task(args.task).pipeline:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} runs pretraining (fixed-length samples); fine-tune "
            f"--task {args.task} with data, tensor or ZeRO parallelism instead"
        )
    for on, flag, why in (
        (args.deepspeed, "--deepspeed", "rapidlite's pipeline runs on torch.distributed.pipelining"),
        (args.cpu_offload, "--cpu-offload", "offload is not tested with pipeline parallelism yet"),
    ):
        if on:
            raise ConfigError(f"{flag} does not combine with --pipeline-model-parallel-size {pp}: {why}")
    if args.num_layers is not None and args.user_script is None:
        stages = pp * (args.num_layers // virtual_layers // pp if virtual_layers else 1)
        if virtual_layers and args.num_layers % (virtual_layers * pp):
            raise ConfigError(
                f"--num-layers {args.num_layers} is not divisible by --num-layers-per-virtual-pipeline-stage "
                f"{virtual_layers} x --pipeline-model-parallel-size {pp}"
            )
        if args.num_layers < stages:
            raise ConfigError(
                f"--num-layers {args.num_layers} is fewer than the {stages} pipeline stages: lower "
                "--pipeline-model-parallel-size or add layers"
            )


def check_pipeline_micro_batches(args: argparse.Namespace) -> None:
    """The schedules' constraints on the micro-batches of a global batch (the accumulation steps)."""
    pp, m = args.pipeline_model_parallel_size, args.gradient_accumulation_steps
    if pp == 1:
        return
    if args.pipeline_schedule == "1f1b" and m < pp:
        raise ConfigError(
            f"--pipeline-schedule 1f1b needs at least as many micro-batches per global batch ({m}) as pipeline "
            f"stages ({pp}): raise --global-batch-size to {args.global_batch_size // m * pp} or more"
        )
    if args.pipeline_schedule == "interleaved-1f1b" and m % max(1, m // pp):
        raise ConfigError(
            f"--pipeline-schedule interleaved-1f1b needs the micro-batches per global batch ({m}) to be a multiple "
            f"of {max(1, m // pp)}: use a multiple of --pipeline-model-parallel-size {pp}"
        )
