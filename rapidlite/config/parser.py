"""The command line: the parser built from the flag declarations (``rapidlite.config.sections``).

``parse`` reads argv once into an ``argparse.Namespace`` (which flags were given is recorded in the same
pass, as ``explicit_flags``); ``rapidlite.resolve.resolve`` then checks it and derives everything else into
the frozen ``RunConfig`` every other module reads (``rapidlite.resolve.parse_args`` is the two in a row).
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from rapidlite.config import files as config_file
from rapidlite.config import sections
from rapidlite.config.fields import add_flags, argparse_kwargs, flag_fields, option
from rapidlite.config.megatron import MEGATRON_DESCRIPTION, add_megatron_args
from rapidlite.config.settings import SECTIONS
from rapidlite.config.tasks import registered, shared_options
from rapidlite.errors import ConfigError

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]

# The --help groups in their order, with their descriptions.
GROUPS: dict[str, str | None] = {
    sections.TASK_AND_MODEL: None,
    sections.TRAINING: None,
    sections.OPTIMIZER: None,
    sections.PRECISION: None,
    sections.MEMORY_AND_SPEED: None,
    sections.DEEPSPEED: None,
    sections.LORA: None,
    sections.PREFERENCE: None,
    sections.MOE: None,
    sections.IMAGES: None,
    sections.DATA: None,
    sections.CHECKPOINTS_AND_LOGGING: None,
    sections.DISTRIBUTED: None,
    sections.MEGATRON: MEGATRON_DESCRIPTION,
}
# The --help group of a task's own flags (its TaskSpec.options), and what it says of them.
TASK_OPTIONS = "--task {task} options"
TASK_OPTIONS_NOTE = "read by this task only: another task refuses them (set off their defaults)"
# The group of the options several tasks declare (TaskSpec.options fields of one name).
SHARED_OPTIONS = "options of several tasks"
SHARED_OPTIONS_NOTE = "each task has its own default and choices, given per task; a task that has none refuses them"


def _check_task_options(task_groups: dict[type, str]) -> None:
    """A task's option named as a shared flag is one line, not argparse's conflict deep in the parser."""
    shared = {f.name for section in SECTIONS for f, _ in flag_fields(section)}
    for options, task in task_groups.items():
        for f, _ in flag_fields(options):
            if f.name in shared:
                raise ConfigError(
                    f"task {task!r}: its option {option(f.name)} is a shared flag already; give it another name"
                )


def _with_task_groups(task_groups: dict[type, str]) -> dict[str, str | None]:
    """``GROUPS`` with a group per task that has options of its own, after the shared data flags."""
    groups: dict[str, str | None] = {}
    for title, description in GROUPS.items():
        groups[title] = description
        if title == sections.DATA:
            groups.update({TASK_OPTIONS.format(task=task): TASK_OPTIONS_NOTE for task in task_groups.values()})
            groups[SHARED_OPTIONS] = SHARED_OPTIONS_NOTE
    return groups


def _add_shared_options(group: argparse._ArgumentGroup) -> None:
    """One flag for each option several tasks declare: None until given (each task then reads its own default),
    the union of their choices (each task checks its own: ``resolve``), and each task's help and default."""
    for name, declarations in shared_options().items():
        specs = [(task, f, spec) for task, field in declarations for f, spec in flag_fields(task.options) if f is field]
        task, f, spec = specs[0]
        kwargs = argparse_kwargs(f, spec, typing.get_type_hints(task.options)[name])
        kwargs["default"] = None
        choices = [c for _, _, s in specs for c in s.choices or ()]
        if choices:
            kwargs["choices"] = list(dict.fromkeys(choices))
        by_help: dict[str, list[tuple[str, Any]]] = {}  # one text: the tasks that declare it so, their defaults
        for t, f, s in specs:
            by_help.setdefault(s.help or "", []).append((t.name, f.default))
        kwargs["help"] = "; ".join(f"{_declared_by(tasks)}: {text}" for text, tasks in by_help.items())
        group.add_argument(option(name), *spec.aliases, **kwargs)


def _declared_by(tasks: list[tuple[str, Any]]) -> str:
    """ "grpo, rloo (default 512)", or each task with its own default; no default shown for None."""
    if len({repr(default) for _, default in tasks}) == 1:
        default = tasks[0][1]
        return ", ".join(name for name, _ in tasks) + ("" if default is None else f" (default {default})")
    return ", ".join(name if default is None else f"{name} (default {default})" for name, default in tasks)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line) instead of printing usage and exiting, and that reads every
    negative number as a value: argparse's own pattern knows ``-1`` and ``-.5`` but takes ``-1e-3`` for a flag
    (``--lr -1e-3`` was "expected one argument" instead of the check that names the bad value)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite --help')")


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog="rapidlite",
        description="Train transformer models with Megatron-style flags.",
        epilog="other commands: 'rapidlite env [--json]' reports versions, hardware and usable kernels for a bug "
        "report; 'rapidlite plot DIR' draws DIR/curves.png from a --save directory's metrics.jsonl",
        allow_abbrev=False,
    )
    task_groups = {spec.options: spec.name for spec in registered() if spec.options is not None}
    _check_task_options(task_groups)
    p.add_argument(
        config_file.FLAG,
        default=None,
        metavar="FILE",
        help="flags from a YAML or JSON file (keys are flag names: 'micro-batch-size: 8'); the command line wins",
    )
    by_options = {options: TASK_OPTIONS.format(task=task) for options, task in task_groups.items()}
    shared = frozenset(shared_options())
    groups = add_flags(p, SECTIONS + tuple(task_groups), _with_task_groups(task_groups), by_options, skip=shared)
    _add_shared_options(groups[SHARED_OPTIONS])
    add_megatron_args(groups[sections.MEGATRON])
    if extra_args_provider is not None:
        try:
            returned = extra_args_provider(p)  # the parser, or None (Megatron's providers return it, others do not)
        except argparse.ArgumentError as e:
            raise ConfigError(_conflict_message(p, e)) from None
        p = returned if isinstance(returned, argparse.ArgumentParser) else p
    return p


def _conflict_message(parser: argparse.ArgumentParser, error: argparse.ArgumentError) -> str:
    """The line for a script's flag that rapidlite already has: read rapidlite's, or rename the script's."""
    if "conflicting option string" not in str(error):
        return f"extra_args_provider: {error}"
    taken = str(error).rsplit(":", 1)[-1].strip().split(", ")
    dest = next((a.dest for a in parser._actions for o in taken if o in a.option_strings), None)
    read = f"read it as get_args().{dest}" if dest else "read rapidlite's"
    return (
        f"extra_args_provider adds {', '.join(taken)}, which rapidlite already has: {read} instead of adding it, "
        "or give the script's flag another name"
    )


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_UNSET = _Unset()
# Actions that replace the value (every flag of rapidlite's own): only these can tell given from defaulted.
_SETS_VALUE = (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction)


def parse_known(
    argv: Sequence[str] | None = None, extra_args_provider: ExtraArgsProvider | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse argv once; return the flags and the arguments no flag of the parser took (a user script's own).

    Every flag starts as "not given" and takes its parser default afterwards, so the same pass records in
    ``explicit_flags`` which flags the command line set (a DeepSpeed file supplies only the others). A ``--config``
    file's flags come first in the same pass (``rapidlite.config.files``): given, and overridden by the command line.
    """
    namespace, unknown, unknown_keys = _parse_known(argv, extra_args_provider)
    if unknown_keys and namespace.user_script is None:  # a --user-script's own flags are its engine's to check
        raise ConfigError(unknown_keys[0])
    return namespace, unknown


def _parse_known(
    argv: Sequence[str] | None, extra_args_provider: ExtraArgsProvider | None
) -> tuple[argparse.Namespace, list[str], list[str]]:
    parser = build_parser(extra_args_provider)
    argv, unknown_keys = config_file.expand(sys.argv[1:] if argv is None else argv, parser)
    actions = [a for a in parser._actions if a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS]
    probe = argparse.Namespace(**{a.dest: _UNSET for a in actions})
    for action in actions:
        if not isinstance(action, _SETS_VALUE):
            # append/count/extend (a script's own flags) build on the value in place: they start from the default
            setattr(probe, action.dest, parser.get_default(action.dest))
    namespace, unknown = parser.parse_known_args(argv, probe)
    explicit = frozenset(dest for dest, value in vars(namespace).items() if value is not _UNSET)
    for action in actions:
        if getattr(namespace, action.dest) is _UNSET:
            default = parser.get_default(action.dest)
            if isinstance(default, str) and callable(action.type):
                default = action.type(default)  # as argparse converts a string default
            setattr(namespace, action.dest, default)
    namespace.explicit_flags = explicit
    return namespace, unknown, unknown_keys


def parse(
    argv: Sequence[str] | None = None, extra_args_provider: ExtraArgsProvider | None = None
) -> argparse.Namespace:
    """Parse argv once; an argument no flag takes is a ``ConfigError``."""
    namespace, unknown, unknown_keys = _parse_known(argv, extra_args_provider)
    if unknown_keys:
        raise ConfigError(unknown_keys[0])
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (see 'rapidlite --help')")
    return namespace
