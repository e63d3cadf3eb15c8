"""Command-line flags: Megatron's and Rapidformer's names, grouped, validated up front.

``parse_args`` turns argv into a ``Namespace`` whose fields every other module reads
by name. Validation runs before any model or data is touched: each contradiction is a
``ConfigError`` with one line naming the flag and the fix. Derived values (data-parallel
size, global batch, gradient-accumulation steps, precision) are resolved here, once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from rapidlite.environ import env_int
from rapidlite.errors import ConfigError
from rapidlite.tasks.registry import get_task, task_names

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
)
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite --help')")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}") from None


def _add_task_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("task and model")
    g.add_argument("--task", default=None, help=f"black-box task: {', '.join(task_names())}")
    g.add_argument(
        "--user-script",
        default=None,
        metavar="PATH",
        help="run a user's Finetuner/PreTrainer script (white box)",
    )
    g.add_argument(
        "--demo",
        action="store_true",
        help="run the task on an embedded offline default (tiny model and generated data)",
    )
    g.add_argument(
        "--pretrained-model-name-or-path",
        default=None,
        metavar="NAME_OR_DIR",
        help="Hugging Face model name or local directory",
    )
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="maximum sequence length (tokens); default 128 for fine-tuning",
    )
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="built-in GPT: pad the vocabulary to a multiple of this",
    )
    g.add_argument("--init-method-std", type=float, default=0.02, help="built-in GPT: std of the normal init")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm", help="built-in GPT")
    g.add_argument("--swiglu", action="store_true", help="built-in GPT: SwiGLU MLP (LLaMA-style)")
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="built-in GPT",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="built-in GPT: a separate output layer instead of the input embedding's transpose",
    )
    g.add_argument(
        "--load-pretrained-weights",
        action="store_true",
        help="--task pretraining: start from the weights of --pretrained-model-name-or-path (default: its config only)",
    )
    g.add_argument("--hidden-dropout", type=float, default=None, help="override the model's hidden dropout probability")
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="override the model's attention dropout probability",
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per rank per forward pass")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step over all ranks (default: micro x data-parallel size); "
        "gradient accumulation = global / (micro x data-parallel size)",
    )
    g.add_argument("--epochs", type=int, default=None, help="epochs (Finetuner); default 3")
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="optimizer steps (PreTrainer); also bounds an epoch-based run",
    )
    g.add_argument("--seed", type=int, default=1234)


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-4)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", help=f"one of {', '.join(LR_DECAY_STYLES)}")
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iterations to decay over (default: the run's total iterations)",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warmup as a fraction of --lr-decay-iters (exclusive with --lr-warmup-iters)",
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm; 0 disables")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 autocast where the device runs it fast (Ampere+ GPUs, CPUs with AVX-512 BF16/AMX); fp16 with "
        "loss scaling on older GPUs; fp32 on other CPUs",
    )
    g.add_argument("--fp16", action="store_true", help="fp16 autocast with dynamic loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast")
    g.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fp32 matrix multiplies on TF32 tensor cores (CUDA; default: on for Ampere and newer GPUs)",
    )
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale for fp16 (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000, help="clean steps before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the dynamic scale halves")


def _add_memory_speed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory and speed")
    g.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute activations in the backward pass (activation checkpointing)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: recompute whole blocks; selective: keep matmul outputs, recompute the rest",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="checkpoint only the first N transformer blocks (default: all)",
    )
    g.add_argument(
        "--zero-1-memory-optimization",
        action="store_true",
        help="shard optimizer state across data-parallel ranks",
    )
    g.add_argument("--zero-2-memory-optimization", action="store_true", help="shard optimizer state and gradients")
    g.add_argument(
        "--zero-3-memory-optimization",
        action="store_true",
        help="shard optimizer state, gradients and parameters",
    )
    g.add_argument("--fsdp-memory-optimization", action="store_true", help="fully sharded data parallel")
    g.add_argument("--cpu-offload", action="store_true", help="keep optimizer state in host memory")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tensor parallelism: also split norms, dropout and the residual stream along the sequence",
    )
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--pipeline-schedule",
        choices=("gpipe", "1f1b", "interleaved-1f1b"),
        default=None,
        help="pipeline schedule (default 1f1b; interleaved-1f1b with virtual stages)",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual stage: each rank runs several stages (interleaved 1F1B)",
    )
    g.add_argument(
        "--pipeline-split",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="layers per pipeline stage (default: as even as possible)",
    )
    g.add_argument(
        "--onnx-runtime-training",
        action="store_true",
        help="graph optimisation with ONNX Runtime's ORTModule (torch.compile where it cannot run)",
    )
    g.add_argument("--torch-compile", action="store_true", help="compile each transformer block with torch.compile")
    g.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode",
    )


def _add_deepspeed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DeepSpeed backend (pip install 'rapidlite[deepspeed]')")
    g.add_argument(
        "--deepspeed",
        action="store_true",
        help="train through deepspeed.initialize; the ZeRO, precision, batch and clipping flags become its config",
    )
    g.add_argument(
        "--deepspeed-config",
        default=None,
        metavar="JSON",
        help="a DeepSpeed config file (implies --deepspeed); flags given on the command line win over its values",
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        "--dataset-path",
        nargs="+",
        default=None,
        help="hub dataset name, local directory, or local file (one or more for pretraining); "
        "args.dataset_path is the same as one string (Rapidformer's name)",
    )
    g.add_argument(
        "--data-name",
        "--dataset-name",
        default=None,
        help="hub dataset configuration, e.g. mrpc (also args.dataset_name)",
    )
    g.add_argument("--data-dir", default=None, help="hub dataset data_dir")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights used to split a single data source")
    g.add_argument("--data-impl", choices=("mmap", "infer", "lazy", "cached"), default="mmap")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="pretraining: the tokenizer the data was preprocessed with",
    )
    g.add_argument("--vocab-file", default=None, help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer name/dir or SentencePiece model")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the vocabulary size")
    g.add_argument("--eod-mask-loss", action="store_true", help="GPT: no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="GPT: positions restart after each EOD")
    g.add_argument(
        "--reset-attention-mask", action="store_true", help="GPT: attention does not cross EOD (built-in GPT)"
    )
    g.add_argument("--mmap-warmup", action="store_true", help="read the .bin files once before training")
    g.add_argument("--mask-prob", type=float, default=0.15, help="BERT: fraction of tokens to predict (80/10/10)")
    g.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="BERT: probability of a shorter sample than --seq-length"
    )
    g.add_argument(
        "--binary-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BERT: next-sentence prediction (needs --split-sentences data); --no-binary-head for masked LM only",
    )
    g.add_argument("--text-keys", nargs="+", default=None, help="text column(s) of tabular data")
    g.add_argument("--label-key", default=None, help="label column of tabular data")


def _add_checkpoint_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints, logging and evaluation")
    g.add_argument("--save", default=None, metavar="DIR", help="checkpoint directory (also metrics.jsonl)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, metavar="DIR", help="resume from DIR/latest")
    g.add_argument("--finetune", action="store_true", help="with --load: load weights only and restart at iteration 0")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="iterations between evaluations (PreTrainer; Finetuner evaluates each epoch)",
    )
    g.add_argument("--eval-iters", type=int, default=10, help="batches per evaluation (PreTrainer)")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        metavar="FLOP/S",
        help="one device's peak, for the MFU in the logs (default: a known GPU's datasheet peak at the training "
        "precision; measure a CPU's with rapidlite-bench peak)",
    )


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: visible GPUs, else 1)"
    )
    g.add_argument("--nnodes", type=int, default=None, help="nodes (default: $NNODES or 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: $NODE_RANK or 0)")
    g.add_argument("--master-addr", default=None, help="rendezvous host (default: $MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: $MASTER_PORT)")
    g.add_argument(
        "--distributed-backend", choices=("nccl", "gloo"), default=None, help="default: nccl on GPUs, else gloo"
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="collective timeout")
    g.add_argument(
        "--max-restarts", type=int, default=0, help="restarts of the whole worker group after a failure (torchrun)"
    )
    g.add_argument("--per-rank-logs", action="store_true", help="every rank also logs to --save DIR/logs/rank<R>.log")


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog="rapidlite",
        description="Train transformer models with Megatron-style flags.",
        allow_abbrev=False,
    )
    for add in (
        _add_task_args,
        _add_training_args,
        _add_optimizer_args,
        _add_precision_args,
        _add_memory_speed_args,
        _add_deepspeed_args,
        _add_data_args,
        _add_checkpoint_logging_args,
        _add_distributed_args,
    ):
        add(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p) or p
    return p


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: ExtraArgsProvider | None = None,
    require_task: bool = True,
) -> argparse.Namespace:
    """Parse and validate argv; raise ``ConfigError`` (one line) on any contradiction."""
    parser = build_parser(extra_args_provider)
    args = parser.parse_args(argv)
    mark_explicit(parser, argv, args)
    validate_args(args, require_task=require_task)
    return args


class _Unset:
    pass


def mark_explicit(parser: argparse.ArgumentParser, argv: Sequence[str] | None, args: argparse.Namespace) -> None:
    """Record in ``args.explicit_flags`` the destinations set on the command line (not by defaults), so a
    DeepSpeed config file can supply what the flags leave open."""
    unset = _Unset()
    probe = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, probe)
    args.explicit_flags = frozenset(k for k, v in vars(parsed).items() if v is not unset)


def validate_args(args: argparse.Namespace, require_task: bool = True) -> None:
    """Check every flag and resolve derived values in place (see module docstring)."""
    if require_task and args.task is None and args.user_script is None:
        raise ConfigError(f"no task given: pass --task {{{','.join(task_names())}}} or --user-script PATH")
    task = get_task(args.task) if args.task is not None else None
    if args.user_script is not None:
        task = None  # a script runs its own trainer; --task is accepted, as on Rapidformer's page
    if args.user_script is not None and not os.path.isfile(args.user_script):
        raise ConfigError(f"--user-script {args.user_script}: file not found")

    for name in (
        "micro_batch_size",
        "global_batch_size",
        "epochs",
        "train_iters",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "seq_length",
        "max_position_embeddings",
        "log_interval",
        "eval_interval",
        "eval_iters",
        "save_interval",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "loss_scale_window",
        "hysteresis",
        "recompute_num_layers",
        "make_vocab_size_divisible_by",
        "vocab_size",
        "nproc_per_node",
        "nnodes",
        "distributed_timeout_minutes",
    ):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
    for name in ("num_workers", "max_restarts", "node_rank"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be >= 0")
    for name in ("lr", "initial_loss_scale", "min_loss_scale", "loss_scale", "peak_flops"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be positive")
    for name in ("min_lr", "weight_decay", "clip_grad", "adam_eps", "sgd_momentum"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    for name in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be in [0, 1)")

    args.notices = []  # what validation adjusted, for the engine to log
    # Rapidformer's page reads these names: load_dataset(args.dataset_path, args.dataset_name).
    paths = args.data_path
    args.dataset_path = paths[0] if paths and len(paths) == 1 else paths
    args.dataset_name = args.data_name

    _validate_lr(args)
    _resolve_precision(args)
    _resolve_recompute(args)
    _resolve_deepspeed(args)
    _validate_data_parallel(args)
    _resolve_batch(args)

    _resolve_load(args)
    if task is not None:
        _validate_task(task, args)
    for name in ("mask_prob", "short_seq_prob"):
        if not 0 <= getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in [0, 1)")
    if args.init_method_std <= 0:
        raise ConfigError(f"--init-method-std {args.init_method_std}: must be positive")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.epochs is None:
        args.epochs = 3
    if args.lr is None:
        args.lr = 1e-4
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


def _validate_task(task, args: argparse.Namespace) -> None:
    """What the chosen black-box task needs (``rapidlite.tasks.registry``)."""
    if not args.demo:
        missing = [flag for flag in task.required if getattr(args, flag.lstrip("-").replace("-", "_")) is None]
        if missing:
            hint = " (or --demo for the embedded offline example)" if task.demo else ""
            raise ConfigError(f"--task {task.name} needs {' and '.join(missing)}{hint}")
    if task.iteration_based and args.train_iters is None:
        raise ConfigError(f"--task {task.name} is iteration-based: pass --train-iters N")
    if task.check is not None:
        task.check(args)


def _resolve_load(args: argparse.Namespace) -> None:
    """``--load``: a checkpoint to resume (checked now, before any loading), or, as on Rapidformer's page, a
    Hugging Face model directory that a fine-tuning job loads with ``from_pretrained(args.load)``
    (``args.load_is_pretrained_model``: nothing is resumed)."""
    args.load_is_pretrained_model = False
    if args.load is None:
        return
    from rapidlite.checkpoint import is_pretrained_model_dir, latest_iteration

    if not is_pretrained_model_dir(args.load):
        latest_iteration(args.load)  # a missing or corrupt checkpoint fails here
        return
    args.load_is_pretrained_model = True
    if args.user_script is not None:
        return
    model = args.pretrained_model_name_or_path
    task = get_task(args.task) if args.task is not None else None
    if task is not None and task.load_model_dir and model in (None, args.load):
        args.pretrained_model_name_or_path = args.load
        return
    hint = "--pretrained-model-name-or-path DIR" + (" --load-pretrained-weights" if args.task == "pretraining" else "")
    raise ConfigError(
        f"--load {args.load} holds a Hugging Face model, not a rapidlite checkpoint (no 'latest'): start from it "
        f"with {hint}; --load resumes a --save directory"
    )


def _validate_lr(args: argparse.Namespace) -> None:
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
        args.notices.append(
            f"--lr-warmup-iters {warmup} is longer than {which} {decay}: warming up over all {decay} iterations "
            f"(the learning rate reaches --lr only at the end); lower --lr-warmup-iters"
        )
        args.lr_warmup_iters = decay


def _resolve_precision(args: argparse.Namespace) -> None:
    """Set ``args.precision`` to 'fp32', 'bf16', 'fp16' or 'auto' (mixed: the engine picks per device)."""
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive: give one of them (or --mixed-precision)")
    if args.fp16:
        args.precision = "fp16"
    elif args.bf16:
        args.precision = "bf16"
    elif args.mixed_precision:
        args.precision = "auto"
    else:
        args.precision = "fp32"
    if args.loss_scale is not None and args.precision in ("fp32", "bf16"):
        raise ConfigError("--loss-scale only applies to fp16: add --fp16 or drop --loss-scale")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError("--min-loss-scale is larger than --initial-loss-scale")


def _resolve_recompute(args: argparse.Namespace) -> None:
    if args.recompute_granularity is not None or args.recompute_num_layers is not None:
        args.checkpoint_activations = True
    if args.checkpoint_activations and args.recompute_granularity is None:
        args.recompute_granularity = "full"


def _default_nproc_per_node() -> int:
    import torch  # only when the flag is not given: --help and flag errors stay fast

    return max(torch.cuda.device_count(), 1)


def num_nodes(args: argparse.Namespace) -> int:
    return args.nnodes or env_int("NNODES", 1)


def nproc_per_node(args: argparse.Namespace) -> int:
    return args.nproc_per_node or _default_nproc_per_node()


def target_world_size(args: argparse.Namespace) -> int:
    """Processes of the whole job: the launcher's WORLD_SIZE inside a worker, else nodes x processes."""
    return env_int("WORLD_SIZE", 0) or num_nodes(args) * nproc_per_node(args)


def _validate_data_parallel(args: argparse.Namespace) -> None:
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
    _validate_pipeline(args)
    if args.deepspeed and args.no_save_optim:
        raise ConfigError(
            "--no-save-optim: DeepSpeed's checkpoints always hold the optimizer state (its fp32 weights live "
            "there); drop the flag under --deepspeed"
        )
    nnodes = num_nodes(args)
    if nnodes > 1 and not env_int("WORLD_SIZE", 0) and not (args.master_addr or os.environ.get("MASTER_ADDR")):
        raise ConfigError(f"--nnodes {nnodes}: give --master-addr (or MASTER_ADDR), the host of node 0")
    if args.per_rank_logs and args.save is None:
        raise ConfigError("--per-rank-logs writes to --save DIR/logs: add --save DIR")


def _validate_pipeline(args: argparse.Namespace) -> None:
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


def _check_pipeline_micro_batches(args: argparse.Namespace) -> None:
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


def _resolve_deepspeed(args: argparse.Namespace) -> None:
    """``--deepspeed-config``: read the file (torch-free) and let it fill what the flags leave open."""
    args.deepspeed_user_config = None
    args.deepspeed_notices = []
    if args.deepspeed_config is None:
        return
    from rapidlite.parallel.deepspeed_config import adopt_user_config, read_user_config

    args.deepspeed = True
    args.deepspeed_user_config = read_user_config(args.deepspeed_config)
    args.deepspeed_notices = adopt_user_config(args, args.deepspeed_user_config)


def _resolve_batch(args: argparse.Namespace) -> None:
    """Megatron's batch arithmetic: accumulation = global / (micro x data-parallel size)."""
    world = target_world_size(args)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel:
        raise ConfigError(
            f"the world of {world} process{'es' if world > 1 else ''} is not divisible by tensor x pipeline "
            f"parallel size {args.tensor_model_parallel_size} x {args.pipeline_model_parallel_size}: set "
            f"--nproc-per-node (x --nnodes) to a multiple of {model_parallel}"
        )
    args.world_size = world
    args.data_parallel_size = world // model_parallel
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step * (getattr(args, "deepspeed_accumulation", None) or 1)
    if args.global_batch_size % per_step != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}; "
            f"use a multiple of {per_step}"
        )
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    _check_pipeline_micro_batches(args)
