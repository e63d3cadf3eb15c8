"""The black-box tasks ``--task`` can name: what each runs, what it needs, what it supports.

One ``TaskSpec`` per task, looked up by name: everything the rest of rapidlite knows about a task. The command
line (``rapidlite.cli.main``), ``resolve`` (``rapidlite.resolve``) and the planner (``--dry-run``) consult this
table and never compare task names. A built-in task declares itself in its own torch-free module,
``rapidlite/tasks/<name>_spec.py`` (its ``TaskSpec`` as ``TASK``, its options, its checks), found here on the
first lookup; a task from outside the package calls ``register_task``. Nothing here imports torch or a task's
trainer: trainers and demos are named by ``"module:attribute"`` and imported only when a run needs them, so
``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rapidlite.config.fields import option
from rapidlite.errors import ConfigError

# The built-in tasks' declarations: the modules of this package whose names end so.
BUILT_IN_PACKAGE = "rapidlite.tasks"
SPEC_SUFFIX = "_spec"


def _import(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


# What reading a data file and tokenising it imports: datasets (with pyarrow, about 80 MiB), the scipy.io its
# builders patch for streaming and transformers' tokenizer loading (about 16 MiB together), all lazily.
DATA_LIBRARIES = (
    "datasets",
    "scipy.io",
    "transformers.models.auto.tokenization_auto",
    "transformers.convert_slow_tokenizer",
    "transformers.tokenization_utils_tokenizers",
)


@dataclass(frozen=True)
class Demo:
    """A task's embedded offline run. ``defaults``: flag values (by destination) the run starts from; flags
    given on the command line win. ``assets``: where its data, tokenizer and model are, which belong together
    and replace any given. ``prepare()``: builds them once (idempotent, safe when ranks race); the CLI calls it
    after resolve, so a refused command builds nothing."""

    defaults: Mapping[str, Any]
    assets: Mapping[str, Any]
    prepare: Callable[[], None]


@dataclass(frozen=True)
class TaskSpec:
    """A black-box task: each field is documented beside it."""

    name: str  # the --task value
    summary: str  # one line for --help and errors
    trainer: str  # "module:function" returning the trainer class for the resolved settings
    # Flags the task cannot run without (unless --demo or an embedded default fills them).
    required: tuple[str, ...] = ()
    # The task's own flags: a frozen dataclass of flag() fields (rapidlite.config.fields). They make a --help
    # group of their own, reach the trainer as settings.task_options, and are refused under another task.
    options: type | None = None
    iteration_based: bool = False  # the run's length is --train-iters
    pipeline: bool = False  # pipeline parallelism is supported (fixed-length samples)
    demo: str | None = None  # "module:function" returning the Demo of the embedded offline run
    demo_without_data: bool = False  # the embedded run also starts when --data-path is absent
    # More embedded runs, by the name --demo NAME gives: "module:function" each, as demo.
    named_demos: Mapping[str, str] = field(default_factory=dict)
    # The task's values of flags left unset, by destination: each a value or a function of the otherwise
    # resolved settings (Sections), applied by resolve.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    load_model_dir: bool = False  # a Hugging Face model directory given to --load is the model to start from
    # The task's own validation of the flags (torch-free), given the settings (Sections, task_options included).
    check: Callable[[Any], None] | None = None
    eval_only: bool = False  # the trainer honours --eval-only (a Finetuner does)
    # The transformers class the task builds from a config (another where a model type takes one, as BERT
    # pretraining does), which the planner builds on the meta device.
    auto_class: str | None = None
    auto_class_by_model_type: Mapping[str, str] = field(default_factory=dict)
    # Data with images makes the run a vision-language one: a vision-language config's model is then built with
    # AutoModelForImageTextToText (rapidlite.tasks.vision_language).
    images: bool = False
    inputs_per_sample: int = 1  # sequences one sample feeds the model (a multiple-choice question: one a choice)
    # The model is built from a config and trained from scratch (weights only with --load-pretrained-weights): the
    # size flags reshape the config, the position table grows to --seq-length; without a model name, the built-in GPT.
    from_config: bool = False
    # Which reference model the task scores against, given the settings: the one rule the trainer and the planner
    # (which counts its memory) read.
    reference: Callable[[Any], str] | None = None
    # Shared flags the task does not read, by destination or settings section (a Sections attribute: all of its
    # flags): one set off its default is refused in one line rather than ignored.
    ignored: tuple[str, ...] = ()
    # The loss goes through the chunked output layer (rapidlite.models.head), so the planner counts no whole
    # logits: "sum" a summed loss, "tokens" per-token log-probabilities (each chunk recomputed in the backward).
    chunked_loss: Literal["sum", "tokens"] | None = None
    # The modules the run imports beyond torch and transformers, which the planner loads before it reads a CPU
    # run's resident size (every task but pretraining reads its data through datasets; only seq2seq scores
    # through torchmetrics).
    libraries: tuple[str, ...] = DATA_LIBRARIES
    # An online-RL task samples from the model between steps: given the settings, (completions sampled together on
    # a rank, tokens each at most: prompt + completion), whose key/value cache the planner counts.
    generation: Callable[[Any], tuple[int, int]] | None = None
    # An encoder-decoder task's target tokens at most, given the settings: the planner runs the decoder at that
    # length (its self- and cross-attention grow with it), the encoder at the sequence length.
    target_length: Callable[[Any], int] | None = None
    # The share of a sequence's tokens the loss scores, given the settings, where it is a fixed share (a masked
    # LM's --mlm-probability): the planner projects that many rows through the chunked output layer.
    scored_share: Callable[[Any], float] | None = None
    eval_harness: bool = False  # --eval-harness: the task's model is a causal LM the harness can score
    streaming: bool = False  # --streaming: the task reads text as a stream (rapidlite.data.streaming)
    # --context-parallel-size: the task cuts its fixed-length sequences into the ranks' shards (its check
    # refuses the models it cannot split)
    context_parallel: bool = False

    def model_class_name(self, model_type: str | None) -> str | None:
        """The ``transformers`` class this task builds for a config of ``model_type``."""
        return self.auto_class_by_model_type.get(model_type or "", self.auto_class)

    def trainer_class(self, settings: Any) -> type:
        """The trainer class for the resolved settings (``Sections``; the table imports nothing above it)."""
        return _import(self.trainer)(settings)

    def demo_run(self, name: Any = None) -> Demo:
        """The embedded offline run ``--demo NAME`` picks (torch-free: nothing is built until ``prepare``)."""
        if name in (None, True, "default"):
            if self.demo is None:
                raise ConfigError(f"--task {self.name} has no embedded demo; give its data and model flags")
            return _import(self.demo)()
        if name not in self.named_demos:
            known = ", ".join(["default", *self.named_demos]) if self.demo is not None else "none"
            raise ConfigError(f"--demo {name}: --task {self.name} has no such demo; its demos: {known}")
        return _import(self.named_demos[name])()

    def option_names(self) -> tuple[str, ...]:
        """The destinations of the task's own flags."""
        return tuple(f.name for f in dataclasses.fields(self.options)) if self.options else ()


# Every task by name: the built-in ones once found (_discover), then those register_task adds.
TASKS: dict[str, TaskSpec] = {}
_found: list[bool] = []


def _discover() -> dict[str, TaskSpec]:
    """``TASKS``, with the built-in tasks' declarations imported on the first call. A declaration module imports
    only ``rapidlite.config.fields`` and this module at its top, so finding it loads nothing more."""
    if not _found:
        _found.append(True)
        package = importlib.import_module(BUILT_IN_PACKAGE)
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.endswith(SPEC_SUFFIX):
                _add(importlib.import_module(f"{BUILT_IN_PACKAGE}.{info.name}").TASK)
    return TASKS


def _add(spec: TaskSpec) -> None:
    """Register ``spec``. Its options may share a name with another task's (``--loss-type``, ``--beta``): one flag,
    with each task's default, choices and help (``shared_options``), which must then take the same type."""
    if spec.name in TASKS:
        raise ConfigError(f"task {spec.name!r} is registered already; give the new task another name")
    hints = _option_types(spec)
    for other in TASKS.values():
        theirs = _option_types(other)
        for name in hints.keys() & theirs.keys():
            if hints[name] != theirs[name]:
                raise ConfigError(
                    f"task {spec.name!r}: its option {name!r} is --task {other.name}'s already, of another type "
                    f"({theirs[name]}); give it another name or the same type"
                )
    TASKS[spec.name] = spec


def _option_types(spec: TaskSpec) -> dict[str, Any]:
    return typing.get_type_hints(spec.options) if spec.options is not None else {}


def shared_options() -> dict[str, list[tuple[TaskSpec, dataclasses.Field]]]:
    """The option names several tasks declare, each with its declarations (task, field) in registration order.
    The command line has one flag for each, whose value is None until given: each task reads its own default."""
    declared: dict[str, list[tuple[TaskSpec, dataclasses.Field]]] = {}
    for spec in _discover().values():
        for f in dataclasses.fields(spec.options) if spec.options else ():
            declared.setdefault(f.name, []).append((spec, f))
    return {name: rows for name, rows in declared.items() if len(rows) > 1}


def task_options(spec: TaskSpec, values: Mapping[str, Any]) -> Any:
    """``spec``'s options (its ``options`` dataclass) from flat settings: a field the values lack, or a shared
    option left unset (None), at the task's own default."""
    shared = shared_options()
    kwargs = {}
    for f in dataclasses.fields(spec.options):
        if f.name in values and not (f.name in shared and values[f.name] is None):
            kwargs[f.name] = values[f.name]
    return spec.options(**kwargs)


def check_options(task: TaskSpec, values: Mapping[str, Any]) -> None:
    """Another task's option set under ``task`` is one line naming whose it is; so is a shared option's value
    outside ``task``'s own choices."""
    own = set(task.option_names())
    for other in registered():
        for f in dataclasses.fields(other.options) if other.options and other is not task else ():
            if f.name not in own and values.get(f.name) != unset_value(f.name):
                owners = [t.name for t in registered() if f.name in t.option_names()]
                whose = f"--task {owners[0]}'s" if len(owners) == 1 else f"{', '.join(owners)} use it"
                raise ConfigError(f"{option(f.name)}: --task {task.name} does not use it ({whose}); drop the flag")
    for f in dataclasses.fields(task.options) if task.options else ():
        choices, value = f.metadata["flag"].choices, values.get(f.name)
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{option(f.name)} {value}: --task {task.name} takes {', '.join(map(str, choices))}")


def unset_value(name: str) -> Any:
    """What a task option holds when its flag is not given: None for a shared one, else its declared default."""
    if name in shared_options():
        return None
    for spec in _discover().values():
        for f in dataclasses.fields(spec.options) if spec.options else ():
            if f.name == name:
                return f.default
    raise KeyError(name)


def task_names() -> list[str]:
    return list(_discover())


def context_parallel_tasks() -> str:
    """The tasks that split their sequences over context-parallel ranks, as a message lists them."""
    return ", ".join(spec.name for spec in registered() if spec.context_parallel)


def registered() -> list[TaskSpec]:
    """Every task ``--task`` can name, in the order ``task_names`` lists them."""
    return list(_discover().values())


def register_task(spec: TaskSpec) -> None:
    """Add a task ``--task spec.name`` can name, from outside the package: its trainer and demo are named by
    ``"module:attribute"`` as the built-in tasks' are. A name already taken is refused, as is an option another
    task declares (the parser checks it against the shared flags)."""
    _discover()
    _add(spec)


def find_task(name: str | None) -> TaskSpec | None:
    """The task named ``name``, or None (no task, or a name no task has)."""
    return _discover().get(name or "")


def get_task(name: str) -> TaskSpec:
    """The task ``--task name`` names; an unknown name is one line listing the known ones."""
    spec = _discover().get(name)
    if spec is None:
        raise ConfigError(f"--task {name}: unknown task; choose one of {', '.join(TASKS)}")
    return spec
