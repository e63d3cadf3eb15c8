"""Settings resolved once: ``resolve(namespace) -> RunConfig`` checks every flag and derives every value.

One pure function between parsing (``rapidlite.config.parser``) and everything that runs: it reads the parsed
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
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapidlite.config import megatron as megatron_flags
from rapidlite.config.fields import derived_defaults
from rapidlite.config.parser import ExtraArgsProvider, parse
from rapidlite.config.settings import SECTIONS, Sections
from rapidlite.config.tasks import TaskSpec, get_task, task_names
from rapidlite.config.topology import Batching, Topology
from rapidlite.errors import ConfigError
from rapidlite.observe.trackers import resolve_trackers
from rapidlite.observe.trackers.tensorboard import default_dir as tensorboard_default_dir
from rapidlite.resolve.checks import (
    check_data_parallel,
    check_lora,
    check_lr,
    check_offload_activations,
    check_optimizer,
    check_pipeline_micro_batches,
    check_precision,
    check_ranges,
    check_rest,
    check_task,
    precision_of_flags,
    resolve_recompute,
    section_of,
)
from rapidlite.resolve.run_dirs import check_save_dir, resolve_load
from rapidlite.resolve.topology import adopt_distributed_optimizer, adopt_user_config, batching_of, topology_of
from rapidlite.runtime.paths import check_writable_dir
from rapidlite.runtime.world import target_world_size


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
        self,
        values: Mapping[str, Any],
        notices: Sequence[str] = (),
        deepspeed_notices: Sequence[str] = (),
        topology: Topology | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.__dict__.update(values)
        object.__setattr__(self, "_notices", tuple(notices))
        object.__setattr__(self, "_deepspeed_notices", tuple(deepspeed_notices))
        object.__setattr__(self, "_sections", Sections.of(values, topology, batching))

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
        layout = (self._sections.topology, self._sections.batching)
        return type(self), (dict(vars(self)), self._notices, self._deepspeed_notices, *layout)

    @property
    def notices(self) -> list[str]:
        """What resolve adjusted or decided that the user should read (the main process logs them)."""
        return list(self._notices)

    @property
    def deepspeed_notices(self) -> list[str]:
        """The ``--deepspeed-config`` file's values that the command line overrides or leaves out."""
        return list(self._deepspeed_notices)


# What runpy runs: a Python source or compiled file, a zip holding __main__.py, or a file without a suffix.
RUNNABLE_SUFFIXES = ("", ".py", ".pyw", ".pyc", ".zip")


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
        suffix = os.path.splitext(args.user_script)[1].lower()
        if suffix not in RUNNABLE_SUFFIXES:  # runpy would run a .csv's first line as Python
            raise ConfigError(
                f"--user-script {args.user_script}: a {suffix} file is not a Python script; give the trainer "
                "script (.py), and data with --data-path"
            )
    model = args.pretrained_model_name_or_path
    if model and os.path.isfile(model):  # transformers would read it as a vocabulary file, or fail deep inside
        folder = os.path.dirname(model) or "."
        raise ConfigError(
            f"--pretrained-model-name-or-path {model}: is a file; pass the directory that holds the model's "
            f"config.json and weights (--pretrained-model-name-or-path {folder})"
        )
    check_ranges(args)
    _resolve_eval_only(task, args)

    # Rapidformer's page reads these names: load_dataset(args.dataset_path, args.dataset_name).
    paths = args.data_path
    args.dataset_path = paths[0] if paths and len(paths) == 1 else paths
    args.dataset_name = args.data_name

    notices += megatron_flags.check_megatron_flags(args)
    adopt_distributed_optimizer(args)
    args.precision = precision_of_flags(args)
    resolve_recompute(args)
    # A DeepSpeed file may decide the precision, the batch and the ZeRO stage: it is read before anything is
    # checked against them (--loss-scale against fp16, --cpu-offload against a ZeRO stage).
    deepspeed_notices = _resolve_deepspeed(args)
    check_precision(args)
    check_data_parallel(args)
    check_optimizer(args)
    check_offload_activations(args)
    topology, batching = _resolve_batch(args)
    megatron_flags.samples_to_iterations(args)
    notices += check_lr(args)
    given_load = args.load  # before a first launch's --save D --load D drops it
    notices += resolve_load(args)
    notices += check_save_dir(args, given_load)
    args.trackers = resolve_trackers(section_of(args, "logging"))
    if "tensorboard" in args.trackers and args.tensorboard_dir is None:
        args.tensorboard_dir = tensorboard_default_dir(args.save)
    if args.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", args.tensorboard_dir, "the TensorBoard event files")
    check_lora(args)
    if task is not None:
        check_task(task, args, topology, batching)
    check_rest(args)
    if task is not None:
        _apply_task_defaults(task, args)  # last: a default may load a model's config (after every cheap check)
    notices += _resolve_graph(args)
    batching = dataclasses.replace(batching, seq_length=args.seq_length)
    return RunConfig(vars(args), notices, deepspeed_notices, topology, batching)


def resolve_command(namespace: argparse.Namespace) -> RunConfig:
    """What a parsed command line asks for: a task's run (with its embedded demo's flags where it takes them),
    or a user script's (whose task, if any, is the script's own)."""
    if namespace.user_script is None:
        return resolve(with_embedded_demo(namespace))
    return resolve(namespace, require_task=False)


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
    demo = task.demo_run(namespace.demo)
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
        if given & {"train_iters", "train_samples", "train_tokens", "epochs"} and "time_budget" not in given:
            args.time_budget = None  # the demo's budget gives way to the length asked for
    args.demo = namespace.demo if isinstance(namespace.demo, str) else "default"
    return args


def _apply_task_defaults(task: TaskSpec, args: argparse.Namespace) -> None:
    """The task's defaults (``TaskSpec.defaults``) for the flags left unset."""
    for dest, default in task.defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default(Sections.of(vars(args))) if callable(default) else default)


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


def _resolve_deepspeed(args: argparse.Namespace) -> list[str]:
    """``--deepspeed-config``: read the file (torch-free) and let it fill what the flags leave open; returns
    the notices of its values the command line overrides."""
    args.deepspeed_user_config = None
    args.deepspeed_accumulation = None
    if args.deepspeed_config is None:
        return []
    from rapidlite.parallel.deepspeed_config import read_user_config

    args.deepspeed = True
    args.deepspeed_user_config = read_user_config(args.deepspeed_config)
    values, notices = adopt_user_config(args, args.deepspeed_user_config)
    for dest, value in values.items():
        setattr(args, dest, value)
    return notices


def _resolve_batch(args: argparse.Namespace) -> tuple[Topology, Batching]:
    """The run's ``Topology`` and ``Batching`` (``rapidlite.resolve.topology``), and the flat view's derived values
    from them (``get_args().data_parallel_size``, ``.gradient_accumulation_steps``, ...)."""
    topology = topology_of(args, target_world_size(section_of(args, "parallel")))
    batching = batching_of(args, topology)
    args.world_size = topology.world_size
    args.data_parallel_size = topology.dp
    args.global_batch_size = batching.global_batch_size
    args.gradient_accumulation_steps = batching.gradient_accumulation_steps
    check_pipeline_micro_batches(args)
    return topology, batching


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: ExtraArgsProvider | None = None,
    require_task: bool = True,
) -> RunConfig:
    """Parse argv once (``rapidlite.config.parser.parse``) and resolve it; raise ``ConfigError`` (one line) on any
    contradiction."""
    return resolve(parse(argv, extra_args_provider), require_task=require_task)
