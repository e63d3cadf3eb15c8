"""Where and how the run executes: precision, parallelism, checkpoints and logging (see ``rapidlite.config.sections``
for how a section declares its flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rapidlite.config.fields import derived, flag
from rapidlite.config.sections import (
    CHECKPOINTS_AND_LOGGING,
    DEEPSPEED,
    DISTRIBUTED,
    MEGATRON,
    MEMORY_AND_SPEED,
    PRECISION,
    int_list,
)


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision and fp16 loss scaling."""

    GROUP: ClassVar[str] = PRECISION

    mixed_precision: bool = flag(
        False,
        "bf16 autocast where the device runs it fast (Ampere+ GPUs, CPUs with AVX-512 BF16/AMX); fp16 with loss "
        "scaling on older GPUs; fp32 on other CPUs",
    )
    fp16: bool = flag(False, "fp16 autocast with dynamic loss scaling")
    bf16: bool = flag(False, "bf16 autocast")
    tf32: bool | None = flag(
        None,
        "fp32 matrix multiplies on TF32 tensor cores (CUDA; default: on for Ampere and newer GPUs)",
        negatable=True,
    )
    loss_scale: float | None = flag(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = flag(2.0**16, "fp16's first dynamic loss scale (2^16, as DeepSpeed and Apex start)")
    min_loss_scale: float = flag(1.0)
    loss_scale_window: int = flag(1000, "clean steps before the dynamic scale doubles")
    hysteresis: int = flag(2, "overflows tolerated before the dynamic scale halves")
    precision: str = derived("fp32", "fp32, bf16, fp16, or auto (mixed: the engine picks per device)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the run is split: ZeRO/FSDP, tensor, pipeline, context and data parallelism, DeepSpeed, the process
    group."""

    GROUP: ClassVar[str] = MEMORY_AND_SPEED

    zero_1_memory_optimization: bool = flag(False, "shard optimizer state across data-parallel ranks")
    zero_2_memory_optimization: bool = flag(False, "shard optimizer state and gradients")
    zero_3_memory_optimization: bool = flag(False, "shard optimizer state, gradients and parameters")
    fsdp_memory_optimization: bool = flag(False, "fully sharded data parallel")
    cpu_offload: bool = flag(False, "keep optimizer state in host memory")
    tensor_model_parallel_size: int = flag(1)
    sequence_parallel: bool = flag(
        False, "with tensor parallelism: also split norms, dropout and the residual stream along the sequence"
    )
    pipeline_model_parallel_size: int = flag(1)
    expert_model_parallel_size: int = flag(
        1,
        "mixture of experts: split each layer's experts over this many data-parallel ranks, the tokens sent to "
        "their experts by all-to-all",
    )
    context_parallel_size: int = flag(
        1,
        "split each sequence over this many ranks (long context); attention crosses them as --cp-comm-type says",
    )
    cp_comm_type: str = flag(
        "p2p",
        "context parallelism's attention: p2p (ring: key/value blocks passed round, any head count) or a2a "
        "(Ulysses: all-to-all to head shards; heads divisible by --context-parallel-size)",
        choices=("p2p", "a2a"),
    )
    pipeline_schedule: str | None = flag(
        None,
        "pipeline schedule (default 1f1b; interleaved-1f1b with virtual stages)",
        choices=("gpipe", "1f1b", "interleaved-1f1b"),
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "layers per virtual stage: each rank runs several stages (interleaved 1F1B)"
    )
    pipeline_split: list[int] | None = flag(
        None, "layers per pipeline stage (default: as even as possible)", type=int_list, metavar="N,N,..."
    )
    deepspeed: bool = flag(
        False,
        "train through deepspeed.initialize; the ZeRO, precision, batch and clipping flags become its config",
        group=DEEPSPEED,
    )
    deepspeed_config: str | None = flag(
        None,
        "a DeepSpeed config file (implies --deepspeed); flags given on the command line win over its values",
        metavar="JSON",
        group=DEEPSPEED,
    )
    nproc_per_node: int | None = flag(None, "processes per node (default: visible GPUs, else 1)", group=DISTRIBUTED)
    nnodes: int | None = flag(None, "nodes (default: $NNODES or 1)", group=DISTRIBUTED)
    node_rank: int | None = flag(None, "this node's rank (default: $NODE_RANK or 0)", group=DISTRIBUTED)
    master_addr: str | None = flag(None, "rendezvous host (default: $MASTER_ADDR)", group=DISTRIBUTED)
    master_port: int | None = flag(None, "rendezvous port (default: $MASTER_PORT)", group=DISTRIBUTED)
    distributed_backend: str | None = flag(
        None, "default: nccl on GPUs, else gloo", choices=("nccl", "gloo"), group=DISTRIBUTED
    )
    distributed_timeout_minutes: float = flag(
        10, "collective timeout (fractions allowed: 0.5 is 30 s)", group=DISTRIBUTED
    )
    max_restarts: int = flag(0, "restarts of the whole worker group after a failure (torchrun)", group=DISTRIBUTED)
    start_method: str = flag(
        "auto",
        "how the launcher starts its workers: fork (from the launcher, the training code already imported: "
        "seconds less start-up per rank), spawn (each a new Python process, torchrun's way), auto (fork on a "
        "machine without CUDA, spawn with it)",
        choices=("auto", "fork", "spawn"),
        group=DISTRIBUTED,
    )
    use_distributed_optimizer: bool = flag(
        False,
        "shard the optimizer state over the data-parallel ranks: ZeRO-1 (--zero-1-memory-optimization)",
        group=MEGATRON,
    )
    world_size: int = derived(1, "processes of the whole job")
    data_parallel_size: int = derived(1, "world size / (tensor x pipeline x context parallel size)")
    deepspeed_user_config: dict | None = derived(None, "the --deepspeed-config file's contents")
    deepspeed_accumulation: int | None = derived(None, "the accumulation steps the DeepSpeed file asks for")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, what resumes from them, and what they keep."""

    GROUP: ClassVar[str] = CHECKPOINTS_AND_LOGGING

    save: str | None = flag(None, "checkpoint directory (also metrics.jsonl)", metavar="DIR")
    save_interval: int | None = flag(None, "iterations between checkpoints")
    keep_last: int | None = flag(
        None,
        "after each save, delete the checkpoints older than the newest N (the one just saved always stays)",
        metavar="N",
    )
    load: str | None = flag(None, "resume from DIR/latest", metavar="DIR")
    finetune: bool = flag(False, "with --load: load weights only and restart at iteration 0")
    overwrite: bool = flag(
        False,
        "start a new run in a --save directory that holds another run (its checkpoints, export and metrics are "
        "removed); without it such a directory is refused unless --load resumes it",
    )
    no_save_optim: bool = flag(False)
    no_load_optim: bool = flag(False)
    no_load_rng: bool = flag(False)
    load_is_pretrained_model: bool = derived(False, "--load names a Hugging Face model directory, not a checkpoint")
    overwrite_save: bool = derived(False, "--overwrite replaces another run held in --save")


@dataclass(frozen=True)
class LoggingConfig:
    """Logs, progress bars, the trackers (TensorBoard, Weights & Biases, MLflow) and the MFU's peak."""

    GROUP: ClassVar[str] = CHECKPOINTS_AND_LOGGING

    log_interval: int = flag(10)
    no_progress: bool = flag(
        False, "no progress bars (drawn only on an interactive terminal; also RAPIDLITE_NO_PROGRESS=1)"
    )
    no_curves: bool = flag(
        False,
        "no --save DIR/curves.png at the end of the run ('rapidlite plot DIR' draws it from metrics.jsonl later; "
        "also RAPIDLITE_NO_CURVES=1)",
    )
    report_to: str | None = flag(
        None,
        "trackers that also get every metrics record and the run's settings (rank 0), comma-separated: "
        "tensorboard, wandb, mlflow; none; all (those installed). A tracker's own flag below implies it",
        metavar="NAMES",
    )
    tensorboard_dir: str | None = flag(
        None,
        "TensorBoard's event files (implies --report-to tensorboard; with it alone: --save DIR/tensorboard, "
        "else ./runs)",
        metavar="DIR",
    )
    wandb_project: str | None = flag(
        None,
        "report to this Weights & Biases project (implies --report-to wandb; pip install 'rapidlite[wandb]')",
        metavar="NAME",
    )
    wandb_entity: str | None = flag(None, "W&B user or team (default: W&B's)", metavar="TEAM")
    wandb_run_name: str | None = flag(None, "W&B run name (default: W&B's)", metavar="NAME")
    wandb_mode: str | None = flag(
        None,
        "W&B mode (default: $WANDB_MODE, else online); offline writes the run locally for 'wandb sync'",
        choices=("online", "offline", "disabled"),
    )
    mlflow_experiment: str | None = flag(
        None,
        "report to this MLflow experiment (implies --report-to mlflow; default with it alone: "
        "$MLFLOW_EXPERIMENT_NAME, else rapidlite), in $MLFLOW_TRACKING_URI's store, else ./mlruns; pip install "
        "'rapidlite[mlflow]'",
        metavar="NAME",
    )
    peak_flops: float | None = flag(
        None,
        "one device's peak, for the MFU in the logs (default: a known GPU's datasheet peak at the training "
        "precision; measure a CPU's with rapidlite-bench peak)",
        metavar="FLOP/S",
    )
    per_rank_logs: bool = flag(False, "every rank also logs to --save DIR/logs/rank<R>.log", group=DISTRIBUTED)
    trackers: tuple[str, ...] = derived((), "the trackers the run reports to (--report-to and the flags implying it)")
