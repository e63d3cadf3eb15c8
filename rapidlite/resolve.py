"""Settings resolved once: ``resolve(namespace) -> RunConfig`` checks every flag and derives every value.

One pure function between parsing (``rapidlite.arguments``) and everything that runs: it reads the parsed
flags, refuses each contradiction with a ``ConfigError`` of one line naming the flag and the fix, and returns
a new, frozen ``RunConfig`` holding every flag plus the derived values (data-parallel size, global batch and
accumulation steps, precision including what a DeepSpeed file decides, recompute, pipeline schedule, the
graph switches ``use_ort``/``torch_compile``, a task's defaults such as the pretraining sequence length, the
embedded demo's data). Nothing writes to the result afterwards; what resolve has to tell the user (a clamped
warmup, a DeepSpeed file's value overridden by a flag) travels with it as ``notices`` for the main process to
log. Nothing here builds or downloads anything: a refused command leaves no trace.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapidlite import megatron_flags
from rapidlite.config.fields import derived_defaults
from rapidlite.config.runtime import ParallelConfig
from rapidlite.config.sections import LR_DECAY_STYLES
from rapidlite.config.settings import SECTIONS, Sections
from rapidlite.config.tasks import TaskSpec, get_task, task_names
from rapidlite.environ import env_int, launch_int, launch_value
from rapidlite.errors import ConfigError
from rapidlite.tracking import check_wandb_flags


class FrozenConfigError(ConfigError, AttributeError):
    """A write to the resolved settings (an ``AttributeError``, as for a frozen dataclass)."""


class RunConfig(argparse.Namespace):
    """The run's settings after ``resolve``, frozen: the typed sections (``config.sections.optim``, ...) that
    the code below the command line receives, and the flat view by flag name.

    The flat view (``config.micro_batch_size``, ``vars(config)``) is what ``get_args()`` returns: Megatron- and
    Rapidformer-style user scripts read it, with the flags only their script declares
    (``extra_args_provider``), which no section of ours could list. Library code takes a section instead.
    Both are built once from the same values; the freeze covers the attributes (``data_path`` stays a list, as
    argparse gives it).
    """

    __slots__ = ("_notices", "_deepspeed_notices", "_sections")

    def __init__(
        self, values: Mapping[str, Any], notices: Sequence[str] = (), deepspeed_notices: Sequence[str] = ()
    ) -> None:
        self.__dict__.update(values)
        object.__setattr__(self, "_notices", tuple(notices))
        object.__setattr__(self, "_deepspeed_notices", tuple(deepspeed_notices))
        object.__setattr__(self, "_sections", Sections.of(values))

    @property
    def sections(self) -> Sections:
        """The settings as typed sections, one per part of the system (``rapidlite.config.sections``)."""
        return self._sections

    def given(self, dest: str) -> bool:
        """Whether the command line (or a ``--config`` file) gave ``dest``'s flag rather than a default."""
        return self._sections.given(dest)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenConfigError(
            f"the run's settings are resolved and frozen: cannot set {name!r}; pass it as a flag, or add the flag "
            "through RapidliteEngine(extra_args_provider=...)"
        )

    def __delattr__(self, name: str) -> None:
        raise FrozenConfigError(f"the run's settings are resolved and frozen: cannot delete {name!r}")

    def __reduce__(self):  # pickling and copying rebuild through __init__, not attribute by attribute
        return type(self), (dict(vars(self)), self._notices, self._deepspeed_notices)

    @property
    def notices(self) -> list[str]:
        """What resolve adjusted or decided that the user should read (the main process logs them)."""
        return list(self._notices)

    @property
    def deepspeed_notices(self) -> list[str]:
        """The ``--deepspeed-config`` file's values that the command line overrides or leaves out."""
        return list(self._deepspeed_notices)


def _default_nproc_per_node() -> int:
    import torch  # only when the flag is not given: --help and flag errors stay fast

    return max(torch.cuda.device_count(), 1)


def num_nodes(cfg: ParallelConfig) -> int:
    return cfg.nnodes or launch_int("NNODES", 1)


def nproc_per_node(cfg: ParallelConfig) -> int:
    return cfg.nproc_per_node or _default_nproc_per_node()


def target_world_size(cfg: ParallelConfig) -> int:
    """Processes of the whole job: the launcher's WORLD_SIZE inside a worker, else nodes x processes."""
    return env_int("WORLD_SIZE", 0) or num_nodes(cfg) * nproc_per_node(cfg)


def _section(args: argparse.Namespace, name: str) -> Any:
    """One section of the flags being resolved (for the rules that live with a section's reader)."""
    return getattr(Sections.of(vars(args)), name)


def resolve(namespace: argparse.Namespace, require_task: bool = True) -> RunConfig:
    """Check the parsed flags and derive every value, in one place; ``namespace`` is left as it was.

    Raises ``ConfigError`` (one line) on any contradiction. ``require_task``: the command needs ``--task`` or
    ``--user-script`` (a user script's own ``RapidliteEngine()`` does not).
    """
    # The scratch copy the steps below fill in, in order, starting from every derived field's default.
    args = argparse.Namespace(**{**derived_defaults(SECTIONS), **vars(namespace)})
    notices: list[str] = []
    if require_task and args.task is None and args.user_script is None:
        raise ConfigError(f"no task given: pass --task {{{','.join(task_names())}}} or --user-script PATH")
    task = get_task(args.task) if args.task is not None else None
    if args.user_script is not None:
        task = None  # a script runs its own trainer; --task is accepted, as on Rapidformer's page
        if os.path.isdir(args.user_script):
            raise ConfigError(f"--user-script {args.user_script}: is a directory; pass the script's .py file")
        if not os.path.isfile(args.user_script):
            raise ConfigError(f"--user-script {args.user_script}: file not found")
    model = args.pretrained_model_name_or_path
    if model and os.path.isfile(model):  # transformers would read it as a vocabulary file, or fail deep inside
        folder = os.path.dirname(model) or "."
        raise ConfigError(
            f"--pretrained-model-name-or-path {model}: is a file; pass the directory that holds the model's "
            f"config.json and weights (--pretrained-model-name-or-path {folder})"
        )
    _check_ranges(args)
    _resolve_eval_only(task, args)

    # Rapidformer's page reads these names: load_dataset(args.dataset_path, args.dataset_name).
    paths = args.data_path
    args.dataset_path = paths[0] if paths and len(paths) == 1 else paths
    args.dataset_name = args.data_name

    notices += megatron_flags.check_megatron_flags(args)
    args.precision = _precision_of_flags(args)
    _resolve_recompute(args)
    # A DeepSpeed file may decide the precision, the batch and the ZeRO stage: it is read before anything is
    # checked against them (--loss-scale against fp16, --cpu-offload against a ZeRO stage).
    deepspeed_notices = _resolve_deepspeed(args)
    _check_precision(args)
    _check_data_parallel(args)
    _resolve_batch(args)
    megatron_flags.samples_to_iterations(args)
    notices += _check_lr(args)
    given_load = args.load  # before a first launch's --save D --load D drops it
    notices += _resolve_load(args)
    _check_save_dir(args, given_load)
    if args.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", args.tensorboard_dir, "the TensorBoard event files")
    _check_lora(args)
    if task is not None:
        _check_task(task, args)
    _check_rest(args)
    if task is not None:
        _apply_task_defaults(task, args)  # last: a default may load a model's config (after every cheap check)
    notices += _resolve_graph(args)
    return RunConfig(vars(args), notices, deepspeed_notices)


def with_embedded_demo(namespace: argparse.Namespace) -> argparse.Namespace:
    """The command line's flags for the run it asks for: with ``--task T --demo`` (or a task whose embedded run
    starts without ``--data-path``) a new namespace holding the demo's flag values for the flags not given (as
    if they came first on the command line) and its assets (data, tokenizer, model), which belong together and
    so replace any given, with ``demo`` set; otherwise ``namespace`` itself. Only where the assets will be: the
    CLI builds them after resolve, so a refused command writes nothing."""
    if namespace.task is None or namespace.user_script is not None:
        return namespace
    task = get_task(namespace.task)
    if not (namespace.demo or (task.demo_without_data and namespace.data_path is None)):
        return namespace
    demo = task.demo_run()
    args = argparse.Namespace(**vars(namespace))
    given = args.explicit_flags
    for dest, value in demo.defaults.items():
        if given is None or dest not in given:
            setattr(args, dest, value)
    for dest, value in demo.assets.items():
        setattr(args, dest, value)
    # The values the demo chose, not the command line: a sized run (--time-budget) may space them over its length.
    args.demo_defaults = frozenset(d for d in demo.defaults if given is None or d not in given)
    if given is not None:  # the demo's values count as given (a DeepSpeed file's do not replace them)
        args.explicit_flags = given | frozenset(demo.defaults) | frozenset(demo.assets)
        if given & {"train_iters", "train_samples", "epochs"} and "time_budget" not in given:
            args.time_budget = None  # the demo's budget gives way to the length asked for
    args.demo = True
    return args


def _apply_task_defaults(task: TaskSpec, args: argparse.Namespace) -> None:
    """The task's defaults (``TaskSpec.defaults``) for the flags left unset."""
    for dest, default in task.defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default(args) if callable(default) else default)


def _resolve_eval_only(task: TaskSpec | None, args: argparse.Namespace) -> None:
    """``--eval-only``: refused where the trainer does not honour it; without ``--split``, data that has no
    validation split of its own is not split (``100,0,0``): a user who asks to evaluate a file means all of
    it, not the 3% a training run would carve out (``--split`` as in training evaluates that share)."""
    if not args.eval_only:
        return
    if task is not None and not task.eval_only:
        raise ConfigError(
            f"--eval-only evaluates fine-tuning tasks ({', '.join(t for t in task_names() if get_task(t).eval_only)});"
            f" --task {task.name} evaluates every --eval-interval while it trains: drop --eval-only"
        )
    if args.save_interval is not None:
        raise ConfigError("--save-interval: --eval-only trains nothing and writes no checkpoint; drop the flag")
    if args.explicit_flags is not None and "split" not in args.explicit_flags:
        args.split = "100,0,0"


def _check_ranges(args: argparse.Namespace) -> None:
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
        "keep_last",
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
    budget = args.time_budget
    if budget is not None and not budget > 0:
        raise ConfigError(f"--time-budget {budget:g}: must be a positive number of minutes")
    for name in ("num_workers", "max_restarts", "node_rank", "eval_generate", "max_skipped_steps"):
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


def _check_rest(args: argparse.Namespace) -> None:
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
    if args.padding_free and args.packing:
        raise ConfigError(
            "--padding-free and --packing both remove padding: --packing packs rows into --seq-length sequences "
            "before training, --padding-free packs each micro-batch into one row; choose one"
        )
    if args.memory_budget is not None and not args.dry_run:
        raise ConfigError("--memory-budget is read by the plan: add --dry-run")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise ConfigError(f"--memory-budget {args.memory_budget:g}: must be a positive number of GiB per device")
    check_wandb_flags(_section(args, "logging"))


def _check_lora(args: argparse.Namespace) -> None:
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
            )
            if on
        ]
        if given:
            raise ConfigError(f"{given[0]} configures LoRA adapters: add --lora-rank R (for example 8)")
        if quant:
            raise ConfigError(f"{quant} freezes the base weights: add --lora-rank R to train LoRA adapters on them")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha {args.lora_alpha}: must be positive")
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


def _check_task(task: TaskSpec, args: argparse.Namespace) -> None:
    """What the chosen black-box task needs (``rapidlite.config.tasks``)."""
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
    if task.check is not None:
        task.check(args)


def _resolve_graph(args: argparse.Namespace) -> list[str]:
    """``--onnx-runtime-training`` becomes ``use_ort`` on a single process with a working ORTModule, and
    ``--torch-compile`` otherwise, with a notice."""
    args.use_ort = False
    if not args.onnx_runtime_training:
        return []
    from rapidlite.graph import ort_import_error  # imports torch: only for runs that ask for ONNX Runtime

    error = ort_import_error()
    if error is None and args.world_size == 1:
        args.use_ort = True
        return []
    args.torch_compile = True
    reason = f"ONNX Runtime's ORTModule is not usable here ({error})" if error else f"{args.world_size} ranks"
    return [f"--onnx-runtime-training: {reason}; using torch.compile"]


def _resolve_load(args: argparse.Namespace) -> list[str]:
    """``--load``: a checkpoint to resume (checked now, before any loading), or, as on Rapidformer's page, a
    Hugging Face model directory that a fine-tuning job loads with ``from_pretrained(args.load)``
    (``args.load_is_pretrained_model``: nothing is resumed).

    ``--save D --load D`` with no checkpoint in ``D`` yet (or no ``D``) starts fresh, so one command both starts
    and resumes a requeued job; ``--load D`` alone still has to exist (a mistyped path must not start over). A
    worker group restarted by ``--max-restarts`` resumes from ``--save``'s latest checkpoint."""
    from rapidlite.checkpoint.layout import is_pretrained_model_dir
    from rapidlite.checkpoint.selection import check_loadable

    args.load_is_pretrained_model = False
    notices = _resume_restarted_attempt(args)
    if args.load is None:
        return notices
    if _same_dir(args.load, args.save) and not args.finetune and _no_checkpoint_yet(args.load):
        where = "does not exist yet" if not os.path.exists(args.load) else "holds no checkpoint yet"
        args.load = None
        return [f"--load {args.save} {where}: starting fresh (the same command resumes from its checkpoints)"]
    if not is_pretrained_model_dir(args.load):
        check_loadable(args.load)  # nothing to resume fails here; verifying waits for the load
        return notices
    args.load_is_pretrained_model = True
    if args.user_script is not None:
        return notices
    model = args.pretrained_model_name_or_path
    task = get_task(args.task) if args.task is not None else None
    if task is not None and task.load_model_dir and model in (None, args.load):
        args.pretrained_model_name_or_path = args.load
        return notices
    from_config = task is not None and task.from_config  # it starts from a config unless asked for the weights
    hint = "--pretrained-model-name-or-path DIR" + (" --load-pretrained-weights" if from_config else "")
    raise ConfigError(
        f"--load {args.load} holds a Hugging Face model, not a rapidlite checkpoint (no 'latest'): start from it "
        f"with {hint}; --load resumes a --save directory"
    )


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _no_checkpoint_yet(path: str) -> bool:
    """No directory, or an empty start of one: no 'latest', no iter_* and no Hugging Face model (a crash during
    the first save leaves only a .tmp_ directory, which is never loaded)."""
    from rapidlite.checkpoint.layout import LATEST_FILE, is_pretrained_model_dir

    if not os.path.exists(path):
        return True
    if not os.path.isdir(path) or is_pretrained_model_dir(path):
        return False
    return not os.path.exists(os.path.join(path, LATEST_FILE)) and not any(
        name.startswith("iter_") for name in os.listdir(path)
    )


def _resume_restarted_attempt(args: argparse.Namespace) -> list[str]:
    """In a worker group that torchrun restarted (``--max-restarts``; TORCHELASTIC_RESTART_COUNT > 0): resume
    from ``--save``'s latest checkpoint, whatever ``--load`` said for the first attempt."""
    from rapidlite.checkpoint.layout import LATEST_FILE, is_pretrained_model_dir

    attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if not attempt:
        return []
    restarted = f"restarted attempt {attempt} (--max-restarts)"
    if args.save is None or not os.path.isfile(os.path.join(args.save, LATEST_FILE)):
        why = "no --save" if args.save is None else f"no checkpoint in {args.save} yet"
        return [f"{restarted}: {why}, so training starts again from iteration 0"]
    if args.load is not None and not _same_dir(args.load, args.save) and is_pretrained_model_dir(args.load):
        return [
            f"{restarted}: --load {args.load} is the Hugging Face model the run starts from, so training starts "
            f"again from it; to resume instead, pass it as --pretrained-model-name-or-path with --load {args.save}"
        ]
    args.load, args.finetune = args.save, False
    return [f"{restarted}: resuming from the latest checkpoint in {args.save}"]


def check_writable_dir(flag: str, path: str, purpose: str) -> None:
    """One line unless ``path`` is, or can be made as, a directory this process can write: not a file, and no
    file or unwritable directory on the way to it."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ConfigError(f"{flag} {path}: is a file, not a directory; pass a directory for {purpose}")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path}: {existing} is a file, so no directory can be made under it; pass another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable; pass a directory you can write to")


def _check_save_dir(args: argparse.Namespace, given_load: str | None = None) -> None:
    """``--save``: a directory that can be written, and not another run's unless this one resumes it (``--load``
    the same directory) or replaces it (``--overwrite``, carried out by the trainer when the run starts).
    ``--eval-only`` only appends to ``metrics.jsonl``."""
    args.overwrite_save = False
    if args.save is None:
        return
    save = os.path.abspath(args.save)
    check_writable_dir("--save", args.save, "the checkpoints")
    # A worker group restarted by --max-restarts continues the run that owns the directory.
    if args.eval_only or not os.path.isdir(save) or env_int("TORCHELASTIC_RESTART_COUNT", 0):
        return
    names = os.listdir(save)
    iterations = sorted(n for n in names if n.startswith("iter_"))
    held = [*iterations[-1:], *(n for n in ("latest", "metrics.jsonl", "hf") if n in names)]
    resumes = _same_dir(given_load, args.save) or _same_dir(args.load, args.save)
    if not held or resumes:
        return
    if not args.overwrite:
        raise ConfigError(
            f"--save {args.save} holds another run ({', '.join(held)}): pass --load {args.save} to resume it, "
            "--overwrite to replace it, or a new --save directory"
        )
    args.overwrite_save = True


def _check_lr(args: argparse.Namespace) -> list[str]:
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


def _precision_of_flags(args: argparse.Namespace) -> str:
    """'fp32', 'bf16', 'fp16' or 'auto' (mixed: the engine picks per device), as the flags ask."""
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive: give one of them (or --mixed-precision)")
    if args.fp16:
        return "fp16"
    if args.bf16:
        return "bf16"
    return "auto" if args.mixed_precision else "fp32"


def _check_precision(args: argparse.Namespace) -> None:
    """The loss-scaling flags against the precision the run ends up with (after a DeepSpeed file)."""
    if args.loss_scale is not None and args.precision in ("fp32", "bf16"):
        raise ConfigError("--loss-scale only applies to fp16: add --fp16 or drop --loss-scale")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError("--min-loss-scale is larger than --initial-loss-scale")


def _resolve_recompute(args: argparse.Namespace) -> None:
    if args.recompute_granularity is not None or args.recompute_num_layers is not None:
        args.checkpoint_activations = True
    if args.checkpoint_activations and args.recompute_granularity is None:
        args.recompute_granularity = "full"


def _check_data_parallel(args: argparse.Namespace) -> None:
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
    _check_pipeline(args)
    if args.deepspeed and args.no_save_optim:
        raise ConfigError(
            "--no-save-optim: DeepSpeed's checkpoints always hold the optimizer state (its fp32 weights live "
            "there); drop the flag under --deepspeed"
        )
    nnodes = num_nodes(_section(args, "parallel"))
    if nnodes > 1 and not env_int("WORLD_SIZE", 0) and not (args.master_addr or launch_value("MASTER_ADDR")):
        raise ConfigError(f"--nnodes {nnodes}: give --master-addr (or MASTER_ADDR), the host of node 0")
    if args.per_rank_logs and args.save is None:
        raise ConfigError("--per-rank-logs writes to --save DIR/logs: add --save DIR")


def _check_pipeline(args: argparse.Namespace) -> None:
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


def _resolve_deepspeed(args: argparse.Namespace) -> list[str]:
    """``--deepspeed-config``: read the file (torch-free) and let it fill what the flags leave open; returns
    the notices of its values the command line overrides."""
    args.deepspeed_user_config = None
    args.deepspeed_accumulation = None
    if args.deepspeed_config is None:
        return []
    from rapidlite.parallel.deepspeed_config import adopt_user_config, read_user_config

    args.deepspeed = True
    args.deepspeed_user_config = read_user_config(args.deepspeed_config)
    values, notices = adopt_user_config(args, args.deepspeed_user_config)
    for dest, value in values.items():
        setattr(args, dest, value)
    return notices


def _resolve_batch(args: argparse.Namespace) -> None:
    """Megatron's batch arithmetic: accumulation = global / (micro x data-parallel size)."""
    world = target_world_size(_section(args, "parallel"))
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
        args.global_batch_size = per_step * (args.deepspeed_accumulation or 1)
    if args.global_batch_size % per_step != 0:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}; "
            f"use a multiple of {per_step}"
        )
    args.gradient_accumulation_steps = args.global_batch_size // per_step
    _check_pipeline_micro_batches(args)
