"""``--config FILE``: flags from a YAML or JSON file, and a run's settings written back as such a file.

A config file maps flag names to values::

    task: pretraining
    micro-batch-size: 8          # or micro_batch_size, or --micro-batch-size
    data-path: [corpus_a_text_document, corpus_b_text_document]
    fp16: true                   # a switch: true gives it, false leaves it out
    tf32: false                  # a --x/--no-x pair: false is --no-tf32

``expand`` turns the file into command-line tokens placed *before* the command line's own, so argparse converts
and checks every value as it does a typed flag, the command line wins (a later flag replaces an earlier one), and
a flag from the file counts as given (``explicit_flags``). A list for a flag that takes one value is joined with
commas (``split: [98, 2, 0]`` is ``--split 98,2,0``); null leaves the flag at its default.

``dump`` writes the settings a checkpoint keeps beside its weights (``iter_N/config.yaml``): every flag given or
different from its default, sorted, except those that belong to one launch (``PER_LAUNCH``); ``--config`` with
that file reproduces the run's settings.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapidlite.errors import ConfigError

FLAG = "--config"
FILE_NAME = "config.yaml"

# Flags that describe one launch, not the run: where this node joins the rendezvous, --overwrite, which would
# delete the directory it is replayed into, and --no-progress, a choice of how this terminal shows the run. --load
# and --finetune are kept only when they say where the weights come from (fine-tuning from a checkpoint or a
# Hugging Face model directory), not when a launch resumed.
PER_LAUNCH = frozenset({"config", "overwrite", "node_rank", "master_addr", "master_port", "no_progress"})
# Flags that resolve sets from other flags when they are not given (the pipeline schedule from the virtual stages,
# recomputation from its granularity, torch.compile standing in for ONNX Runtime, --eval-only's unsplit data):
# written only when given, so a flag added on top of a saved file is not contradicted by a value it implied.
DERIVED = frozenset({"pipeline_schedule", "recompute_granularity", "checkpoint_activations", "torch_compile", "split"})


def paths_in(argv: Sequence[str]) -> list[str]:
    """The files of every ``--config FILE`` (or ``--config=FILE``) in ``argv``, in order."""
    found = []
    tokens = iter(argv)
    for token in tokens:
        if token == FLAG:
            path = next(tokens, None)
            if path is None or path.startswith("--"):
                raise ConfigError(f"{FLAG} needs a FILE (.yaml or .json) of flag names and values")
            found.append(path)
        elif token.startswith(FLAG + "="):
            found.append(token[len(FLAG) + 1 :])
    return found


def read(path: str) -> dict[str, Any]:
    """The file's mapping of flag names to values, or a one-line ``ConfigError`` saying what is wrong with it."""
    where = f"{FLAG} {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: {'is a directory' if os.path.isdir(path) else 'file not found'}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if path.lower().endswith(".json"):
        try:
            values = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    else:
        values = _load_yaml(text, where)
    if values is None:  # an empty file or only comments
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of flag names to values, such as 'micro-batch-size: 8'")
    return values


def _load_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:  # a core dependency; only a broken install lacks it
        raise ConfigError(
            f"{where}: reading YAML needs PyYAML (pip install pyyaml); or write the file as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem}{at})") from None


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for opt, action in parser._option_string_actions.items() if opt.startswith("--")}


def _option_for(key: str, options: Mapping[str, argparse.Action]) -> str | None:
    """The flag a key names: with or without leading dashes, with ``-`` or ``_`` between words."""
    name = key.strip().lstrip("-")
    for candidate in (name, name.replace("_", "-"), name.replace("-", "_")):
        if "--" + candidate in options:
            return "--" + candidate
    return None


def _scalar(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {key}: expects a value, not {str(value).lower()} (quote it if it is text)")
    if isinstance(value, dict):
        raise ConfigError(f"{where}: {key}: expects a value or a list of values, not a mapping")
    if isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: {key}: expects a single value, got {value!r}")
    return repr(value) if isinstance(value, float) else str(value)


def _tokens(option: str, action: argparse.Action, value: Any, where: str, key: str) -> list[str]:
    """The command-line tokens that give ``option`` the file's ``value``."""
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: expects true or false, got {value!r}")
        positive = option == action.option_strings[0]
        return [action.option_strings[0] if value == positive else action.option_strings[1]]
    if action.nargs == 0:  # store_true/store_false/store_const: a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: is a switch: expects true or false, got {value!r}")
        return [option] if value else []
    if action.nargs == "?" and action.const is not None and isinstance(value, bool):  # demo: true, or a name
        return [option] if value else []
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: {key}: expects a count (0, 1, 2, ...), got {value!r}")
        return [option] * value
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)) and action.nargs in (None, "?"):
        return [f"{option}={_scalar(v, where, key)}" for v in values]
    if action.nargs in (None, "?"):
        if isinstance(value, (list, tuple)):  # --split 98,2,0 and --pipeline-split 2,2 as lists
            return [f"{option}={','.join(_scalar(v, where, key) for v in values)}"]
        return [f"{option}={_scalar(value, where, key)}"]
    return [option, *(_scalar(v, where, key) for v in values)]


def expand(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``(tokens, unknown)``: the flags of every ``--config`` file in ``argv`` as tokens, followed by ``argv``
    itself, and the one-line errors for keys no flag of ``parser`` has (the caller decides: a ``--user-script``
    run's first parse does not know the script's own flags). A value argparse refuses is a ``ConfigError`` naming
    the file and the flag."""
    paths = paths_in(argv)
    if not paths:
        return list(argv), []
    options = _long_options(parser)
    tokens: list[str] = []
    unknown: list[str] = []
    for path in paths:
        where = f"{FLAG} {path}"
        own: list[str] = []
        for key, value in read(path).items():
            option = _option_for(str(key), options)
            if option is None:
                unknown.append(_unknown_key(where, str(key), options))
                continue
            action = options[option]
            if action.dest in ("help", "config") or isinstance(action, argparse._HelpAction):
                raise ConfigError(f"{where}: {key}: not a setting a config file can hold; remove it")
            own += _tokens(option, action, value, where, str(key))
        _check_values(parser, own, where)
        tokens += own
    return [*tokens, *argv], unknown


def _unknown_key(where: str, key: str, options: Mapping[str, argparse.Action]) -> str:
    name = key.strip().lstrip("-")
    names = [opt[2:] for opt, action in options.items() if action.dest not in ("help", "config")]
    close = difflib.get_close_matches(name.replace("_", "-"), names, n=1) or difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean '{close[0]}' (--{close[0]})?" if close else "see 'rapidlite --help' for the flags"
    return f"{where}: unknown key '{key}': {hint}"


def _check_values(parser: argparse.ArgumentParser, tokens: list[str], where: str) -> None:
    """Parse the file's tokens alone first, so a value argparse refuses is said with the file's name."""
    try:
        parser.parse_known_args(tokens, argparse.Namespace())
    except ConfigError as e:
        if "arguments are required" not in str(e):  # a script's required flag may come from the command line
            raise ConfigError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------------------------ saving
def _plain(value: Any) -> Any:
    """A value YAML and JSON write as themselves: containers as lists and dicts, anything else as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def plain_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every resolved setting (flags and derived values) as plain values, for a tracker's run config."""
    return {k: _plain(v) for k, v in sorted(vars(args).items()) if not k.startswith("_") and k != "explicit_flags"}


def saved_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags ``dump`` writes, by their first long name, with their resolved values: every flag given
    (``explicit_flags``: on the command line or in a config file) and every other one that differs from its
    default (a task's defaults, the global batch the number of processes gave), except ``PER_LAUNCH`` and
    ``DERIVED``."""
    given = args.explicit_flags
    weights_from_load = args.finetune or args.load_is_pretrained_model
    flags: dict[str, Any] = {}
    for action in parser._actions:
        longs = [opt for opt in action.option_strings if opt.startswith("--")]
        dest = action.dest
        if not longs or isinstance(action, argparse._HelpAction) or dest in PER_LAUNCH or not hasattr(args, dest):
            continue
        if dest in ("load", "finetune") and not weights_from_load:
            continue
        value = getattr(args, dest)
        default = parser.get_default(dest)
        if isinstance(default, str) and callable(action.type):
            try:
                default = action.type(default)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                pass
        if given is not None and dest not in given and (value == default or dest in DERIVED):
            continue
        if given is None and value == default:
            continue
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            if value != action.const:
                continue  # a switch left off: nothing to write
            value = True
        flags[longs[0][2:]] = _plain(value)
    return dict(sorted(flags.items()))


def dump(args: argparse.Namespace, parser: argparse.ArgumentParser, header: str = "") -> str:
    """``saved_flags`` as YAML text (``header`` becomes comment lines above it)."""
    import yaml

    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(saved_flags(args, parser), sort_keys=True, default_flow_style=False, width=120)
