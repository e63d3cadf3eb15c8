"""A flag is declared once: a typed dataclass field whose metadata says how the command line spells it.

``flag(default, help, ...)`` declares a field of a settings section (``rapidlite.config.sections``) that is also
a command-line flag; ``derived(...)`` declares one that ``resolve`` computes. The field's name is the flag's
destination (``micro_batch_size`` is ``--micro-batch-size``), its annotation the flag's type: ``bool`` is a
switch, ``bool | None`` (or ``negatable=True``) a ``--x/--no-x`` pair, ``list[T]`` takes one or more values,
``int``/``float`` convert. argparse, ``--help``, ``--config FILE.yaml`` and the flags reference are all built from
these declarations (``add_flags``), so a flag's type, default and help have one home.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlagSpec:
    """How a settings field is spelled on the command line (see ``flag``)."""

    help: str | Callable[[], str] | None = None  # a callable: worked out when the parser is built
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    negatable: bool = False
    group: str | None = None
    const: Any = None  # the flag may stand without a value, which then is this


def flag(
    default: Any,
    help: str | Callable[[], str] | None = None,  # noqa: A002 - argparse's name
    *,
    aliases: tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,  # noqa: A002 - argparse's name
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    negatable: bool = False,
    group: str | None = None,
    const: Any = None,
) -> Any:
    """A settings field that is a flag. ``type``: a converter where the annotation's is not enough (a
    comma-separated list); ``group``: its ``--help`` group when not its section's."""
    spec = FlagSpec(help, aliases, type, choices, metavar, negatable, group, const)
    return dataclasses.field(default=default, metadata={"flag": spec})


def derived(default: Any = None, doc: str = "") -> Any:
    """A settings field no flag sets: ``resolve`` derives it from the flags (the data-parallel size, ...)."""
    return dataclasses.field(default=default, metadata={"derived": doc})


def flag_fields(section: type) -> Iterator[tuple[dataclasses.Field, FlagSpec]]:
    """The fields of ``section`` that are flags, in declaration order."""
    for f in dataclasses.fields(section):
        if "flag" in f.metadata:
            yield f, f.metadata["flag"]


def option(name: str) -> str:
    """``micro_batch_size`` -> ``--micro-batch-size``."""
    return "--" + name.replace("_", "-")


def _parts(annotation: Any) -> tuple[Any, bool]:
    """The type of a field's annotation without ``| None``, and whether ``None`` was allowed."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def argparse_kwargs(f: dataclasses.Field, spec: FlagSpec, annotation: Any) -> dict[str, Any]:
    """``add_argument``'s keywords for one declared field."""
    kind, optional = _parts(annotation)
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
    if kind is bool:
        if spec.negatable or optional or f.default is True:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_true"
    else:
        if typing.get_origin(kind) is list and spec.type is None:
            kwargs["nargs"] = "+"
            kind = typing.get_args(kind)[0]
        converter = spec.type or (kind if kind in (int, float) else None)
        if converter is not None:
            kwargs["type"] = converter
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        if spec.const is not None:
            kwargs["nargs"], kwargs["const"] = "?", spec.const
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar
    if spec.help is not None:
        kwargs["help"] = spec.help() if callable(spec.help) else spec.help
    return kwargs


def add_flags(
    parser: argparse.ArgumentParser,
    sections: tuple[type, ...],
    groups: dict[str, str | None],
    group_of: dict[type, str] | None = None,
    skip: frozenset[str] = frozenset(),
) -> dict[str, argparse._ArgumentGroup]:
    """Add every flag the ``sections`` declare to ``parser``, in the ``--help`` groups ``groups`` (title ->
    description, in their order); returns the groups by title, for flags declared elsewhere (compatibility).
    A section's group is ``group_of[section]`` where given (a task's options), else its ``GROUP``. The names in
    ``skip`` are left to the caller (the options several tasks share)."""
    made = {title: parser.add_argument_group(title, description) for title, description in groups.items()}
    group_of = group_of or {}
    declared = [
        (spec.group or group_of.get(section) or section.GROUP, f, spec, typing.get_type_hints(section)[f.name])
        for section in sections
        for f, spec in flag_fields(section)
        if f.name not in skip
    ]
    order = list(groups)
    # Group by group (a stable sort keeps each section's order), so the usage line reads as --help does.
    for title, f, spec, annotation in sorted(declared, key=lambda row: order.index(row[0])):
        made[title].add_argument(option(f.name), *spec.aliases, **argparse_kwargs(f, spec, annotation))
    return made


def derived_defaults(sections: tuple[type, ...]) -> dict[str, Any]:
    """The derived fields at their defaults: where ``resolve`` starts from before it derives them."""
    return {f.name: f.default for section in sections for f in dataclasses.fields(section) if "derived" in f.metadata}
