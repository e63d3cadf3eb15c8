"""Tabular data from the command line, for any task: ``--data-path`` as a local directory of split files, one
local file, or a dataset hub name, turned into a ``datasets.DatasetDict`` with splits among ``train``,
``validation`` and ``test``. Task-specific preprocessing (columns, labels, tokenization) lives with each task's
data module; this one only finds, reads and splits.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line naming the flag
or file, and which file (or share of one) became which split is logged in one line.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets

EXTENSIONS: tuple[str, ...] = ("csv", "tsv", "json", "jsonl", "parquet")
SPLIT_FILE_STEMS: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("validation", "val", "dev", "valid"),
    "test": ("test",),
}
# Hub datasets name their splits less uniformly than local files (e.g. MNLI's "validation_matched").
_HUB_SPLIT_ALIASES: dict[str, tuple[str, ...]] = {
    # UltraFeedback-binarized keeps its preference pairs in train_prefs/test_prefs.
    "train": ("train", "train_prefs"),
    "validation": ("validation", "dev", "valid", "validation_matched", "test_prefs"),
    "test": ("test", "test_matched"),
}
SPLIT_ORDER = ("train", "validation", "test")
# Keys under which one json object keeps its list of records (``{"version": "1.0", "data": [{...}, ...]}``).
RECORDS_KEYS = ("data", "rows", "records", "examples", "instances", "items")
# A reader of one more file type (``load_raw_datasets(readers=...)``): the file's path -> its rows, or a DataError.
Reader = Callable[[str], "datasets.Dataset"]


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def parse_split(split: str) -> tuple[float, float, float]:
    """Parse a Megatron-style ``--split`` ("969,30,1", "98,2", "0.9,0.1") into 3 normalized weights."""
    parts = [p.strip() for p in str(split).split(",")]
    fix = 'use 1 to 3 comma-separated non-negative numbers, e.g. "969,30,1" or "0.9,0.1"'
    if not 1 <= len(parts) <= 3 or any(not p for p in parts):
        raise DataError(f"--split {split!r}: malformed; {fix}")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: not a number; {fix}") from None
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--split {split!r}: weights must be non-negative and not all zero; {fix}")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def _split_sizes(num_rows: int, weights: Sequence[float]) -> list[int]:
    """Row counts per weight, from rounded cumulative boundaries (as Megatron does)."""
    bounds = [0]
    cumulative = 0.0
    for w in weights:
        cumulative += w
        bounds.append(round(cumulative * num_rows))
    bounds[-1] = num_rows
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    # A split the user asked for must not silently vanish through rounding on small data.
    for i, w in enumerate(weights):
        if w > 0 and sizes[i] == 0:
            donor = max(range(len(sizes)), key=lambda j: sizes[j])
            if sizes[donor] > 1:
                sizes[donor] -= 1
                sizes[i] = 1
    return sizes


def _split_dataset(
    ds: datasets.Dataset, weights: Sequence[float], names: Sequence[str], seed: int, what: str
) -> dict[str, datasets.Dataset]:
    """Seeded shuffle of ``ds``, then cut into ``names`` by ``weights``; zero-weight names are omitted."""
    import numpy as np

    sizes = _split_sizes(len(ds), weights)
    order = np.random.default_rng(seed).permutation(len(ds))
    out: dict[str, datasets.Dataset] = {}
    start = 0
    for name, weight, size in zip(names, weights, sizes, strict=True):
        if weight > 0:
            if size == 0:
                raise DataError(f"{what}: only {len(ds)} rows, too few to carve out a {name} split; add rows")
            out[name] = ds.select(order[start : start + size], keep_in_memory=True)
        start += size
    return out


def _builder_for(path: str) -> tuple[str, dict[str, Any]]:
    ext = path.rsplit(".", 1)[-1].lower()
    if ext == "tsv":
        # TSV files (GLUE and friends) do not quote fields; a stray '"' must not swallow the next lines.
        return "csv", {"delimiter": "\t", "quoting": csv.QUOTE_NONE}
    if ext in ("json", "jsonl"):
        return "json", {}
    return ext, {}


def _load_file(path: str, readers: Mapping[str, Reader] | None = None) -> datasets.Dataset:
    """Load one local data file as a single ``Dataset``; any failure is a DataError naming the file."""
    import datasets

    reader = (readers or {}).get(path.rsplit(".", 1)[-1].lower())
    if reader is not None:
        return reader(path)
    builder, kwargs = _builder_for(path)
    if os.path.getsize(path) == 0:  # the readers fail on it with their own puzzles (pyarrow's StopIteration)
        raise DataError(f"{path}: the file is empty; give it rows")
    try:
        with _quiet_json_reader():
            ds = datasets.load_dataset(builder, data_files={"train": path}, split="train", **kwargs)
    except Exception as e:  # pyarrow, pandas and datasets all raise their own types for bad files
        bad = _bad_json_line(path) if builder == "json" else None
        if bad is not None:
            raise DataError(f"{path}: {bad}; fix or remove it") from None
        if "corresponds to no data" in str(e):  # datasets' words for a reader that produced no row
            held = "a header and no rows" if builder == "csv" else "no rows"
            raise DataError(f"{path}: the file holds {held}; add rows") from None
        raise DataError(f"{path}: cannot be read as {path.rsplit('.', 1)[-1]} ({_short_reason(e, root=True)})") from e
    if builder == "json":
        from rapidlite.data.question_answering_rows import is_squad_layout, squad_layout_rows

        if is_squad_layout(ds):  # the official SQuAD file: one object; its questions are the rows
            return squad_layout_rows(path)
        field = _records_field(ds, path)
        if field is not None:  # {"version": ..., "data": [{...}, ...]}: the records are the rows
            try:
                return datasets.load_dataset(builder, data_files={"train": path}, split="train", field=field)
            except Exception as e:
                raise DataError(
                    f"{path}: cannot read the records under {field!r} ({_short_reason(e, root=True)})"
                ) from e
    return ds


@contextlib.contextmanager
def _quiet_json_reader() -> Iterator[None]:
    """datasets' json reader logs its own line for a bad file before raising; the DataError says it once."""
    reader = logging.getLogger("datasets.packaged_modules.json.json")
    level = reader.level
    reader.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        reader.setLevel(level)


def _bad_json_line(path: str) -> str | None:
    """Where a json or jsonl file stops being JSON (``line N is not valid JSON (why)``), or None when its text is
    valid JSON (what failed was the rows' types)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        if whole.msg != "Extra data":  # one document (or the first line of many) breaks here
            return f"line {whole.lineno} is not valid JSON ({whole.msg}, column {whole.colno})"
    for number, line in enumerate(text.splitlines(), 1):  # JSON lines: one document per line
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
    return None


def _records_field(ds: datasets.Dataset, path: str) -> str | None:
    """The key of a one-object json file whose rows are a list of records under one key (``{"data": [...]}``, as
    ``load_dataset("json", field=...)`` reads it), or None for a file of rows."""
    import datasets

    if len(ds) != 1:
        return None

    def holds_records(feature: Any) -> bool:
        if isinstance(feature, list):  # datasets before 4 describe a list of records as [{...}]
            return len(feature) == 1 and isinstance(feature[0], dict)
        list_type = getattr(datasets, "List", datasets.Sequence)
        return isinstance(feature, list_type) and isinstance(feature.feature, dict)

    # Only the usual names: a one-row file of rows may hold a list of records itself (a question's answers).
    fields = [name for name, feature in ds.features.items() if name in RECORDS_KEYS and holds_records(feature)]
    if len(fields) > 1:
        raise DataError(
            f"{path}: one json object with lists of records under several keys ({', '.join(fields)}); "
            "keep one list of records per file (train.json, validation.json, ...)"
        )
    return fields[0] if fields else None


def _short_reason(e: BaseException, root: bool = False, limit: int = 160) -> str:
    """``Type: message`` of ``e`` on one line; ``root`` follows the chain to the innermost exception."""
    # datasets wraps parser errors in a generic DatasetGenerationError; the root cause says what is wrong.
    seen = {id(e)}
    while root and (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    text = " ".join(str(e).split()) or type(e).__name__
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"


def _find_split_file(directory: str, split: str, extensions: Sequence[str] = EXTENSIONS) -> str | None:
    found = [
        os.path.join(directory, f"{stem}.{ext}")
        for stem in SPLIT_FILE_STEMS[split]
        for ext in extensions
        if os.path.isfile(os.path.join(directory, f"{stem}.{ext}"))
    ]
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise DataError(f"--data-path {directory}: several {split} files ({names}); keep only one")
    return found[0] if found else None


def _looks_like_path(name: str, extensions: Sequence[str] = EXTENSIONS) -> bool:
    # A hub name is "name" or "owner/name"; anything else cannot be on the hub, so skip the hub lookup.
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or name.rsplit(".", 1)[-1].lower() in extensions
    )


def load_raw_datasets(
    data_path: str,
    data_name: str | None = None,
    data_dir: str | None = None,
    split: str = "969,30,1",
    seed: int = 1234,
    readers: Mapping[str, Reader] | None = None,
    eval_only: bool = False,
) -> datasets.DatasetDict:
    """Load ``--data-path`` into a DatasetDict with splits among train/validation/test.

    * Local directory: ``train.*``, ``validation.*`` (or ``val.*``/``dev.*``/``valid.*``) and optional ``test.*``
      with extension csv, tsv, json, jsonl or parquet. ``data_name`` and ``data_dir``, if given, are
      sub-directories to descend into (``--data-path glue --data-name sst2``). Without a validation
      file, validation is carved out of train (seeded shuffle) with the fraction
      ``w_validation / (w_train + w_validation)`` of the ``--split`` weights; the test weight is not
      used because test comes only from a ``test.*`` file.
    * A directory written by ``save_to_disk``: a ``DatasetDict``'s splits by name (as a hub dataset's), or one
      ``Dataset`` cut by ``--split`` as one file is.
    * Local file: shuffled with ``seed`` and cut into train/validation/test by ``--split``; splits with
      zero weight are left out.
    * Anything else is a dataset hub name: ``datasets.load_dataset(data_path, data_name,
      data_dir=data_dir)``; a missing validation split is carved out of train as for a directory.

    ``eval_only`` (``--eval-only``): a directory with a validation file and no ``train.*`` is read, its validation
    rows standing in for train where a task reads the columns and labels from train (nothing is trained).

    ``readers`` reads more file types, by extension (a task's own text format, e.g. CoNLL files); they are
    found and split as the others.

    Which file (or share of one) became which split is logged in one line.
    """
    import datasets

    extensions = (*EXTENSIONS, *(readers or {}))
    if not data_path:
        raise DataError("--data-path: empty; pass a local directory, a data file or a dataset hub name")
    weights = parse_split(split)  # validate early, even if a validation file makes it unused
    path = os.path.expanduser(data_path)

    if os.path.isdir(path):
        for flag, sub in (("--data-name", data_name), ("--data-dir", data_dir)):
            if sub:
                path = os.path.join(path, sub)
                if not os.path.isdir(path):
                    raise DataError(f"{flag} {sub}: {path} is not a directory inside --data-path {data_path}")
        if _is_saved_dataset(path):
            return _log_splits(*_load_saved(path, weights, seed))
        return _log_splits(*_load_local_dir(path, weights, seed, readers, eval_only))

    if os.path.isfile(path):
        if data_name or data_dir:
            flag = "--data-name" if data_name else "--data-dir"
            raise DataError(
                f"{flag}: only applies to a directory or hub dataset, but --data-path {data_path} "
                "is a file; drop the flag"
            )
        ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
        if ext not in extensions:
            raise DataError(
                f"--data-path {data_path}: unsupported file type; use one of {', '.join('.' + e for e in extensions)}"
            )
        ds = _load_file(path, readers)
        if len(ds) == 0:
            raise DataError(f"--data-path {data_path}: the file has no rows")
        parts = _split_dataset(ds, weights, SPLIT_ORDER, seed, f"--data-path {data_path}")
        name = os.path.basename(path)
        sources = {k: f"{w:.0%} of {name} (--split)" for k, w in zip(SPLIT_ORDER, weights, strict=True) if w > 0}
        return _log_splits(datasets.DatasetDict(parts), sources)

    if _looks_like_path(data_path, extensions):
        raise DataError(f"--data-path {data_path}: no such file or directory")
    return _log_splits(*_load_hub(data_path, data_name, data_dir, weights, seed))


def _log_splits(parts: datasets.DatasetDict, sources: dict[str, str]) -> datasets.DatasetDict:
    """Say in one line which file (or share of one) became which split, so nothing is picked silently."""
    import logging

    from rapidlite.observe.logging import LOGGER_NAME

    described = [f"{name} = {sources.get(name, name)} ({len(parts[name])} rows)" for name in parts]
    if "validation" not in parts:
        described.append("no validation split (no validation/val/dev/valid file and --split gives it no weight)")
    logging.getLogger(LOGGER_NAME).info("data: " + "; ".join(described))
    # Which splits --split cut out of the train data (not files of their own): a task may move back rows that
    # cannot be scored there (a class whose only rows the shuffle put outside train).
    parts.carved = tuple(name for name in parts if name != "train" and "(--split" in sources.get(name, ""))
    return parts


def carved_splits(raw: datasets.DatasetDict) -> tuple[str, ...]:
    """The splits of ``load_raw_datasets``' result that ``--split`` carved out of the train data."""
    return getattr(raw, "carved", ())


def _carved_sources(train_name: str, weights: Sequence[float], parts: dict[str, Any]) -> dict[str, str]:
    if "validation" not in parts:
        return {}
    share = weights[1] / (weights[0] + weights[1])
    return {
        "train": f"{1 - share:.0%} of {train_name}",
        "validation": f"{share:.0%} of {train_name} (--split; no validation file)",
    }


def _load_local_dir(
    directory: str,
    weights: Sequence[float],
    seed: int,
    readers: Mapping[str, Reader] | None = None,
    eval_only: bool = False,
) -> tuple[datasets.DatasetDict, dict[str, str]]:
    import datasets

    extensions = (*EXTENSIONS, *(readers or {}))
    files = {name: _find_split_file(directory, name, extensions) for name in SPLIT_ORDER}
    sources = {name: os.path.basename(f) for name, f in files.items() if f is not None}
    if files["train"] is None and eval_only and files["validation"] is not None:
        # Nothing is trained: the validation file is evaluated, and gives the columns and labels train would.
        files["train"] = files["validation"]
        sources["train"] = f"{sources['validation']} (no train file; --eval-only reads its columns from it)"
    if files["train"] is None:
        expected = ", ".join(f"train.{e}" for e in extensions[:-1]) + f" or train.{extensions[-1]}"
        also = " (--eval-only reads a validation file alone)" if eval_only else ""
        raise DataError(f"--data-path {directory}: no train.* file found (expected {expected}){also}")
    parts = {name: _load_file(f, readers) for name, f in files.items() if f is not None}
    if len(parts["train"]) == 0:
        raise DataError(f"{files['train']}: the train file has no rows")
    if "validation" not in parts:
        parts.update(_carve_validation(parts["train"], weights, seed, f"--data-path {directory}"))
        sources.update(_carved_sources(sources["train"], weights, parts))
    return datasets.DatasetDict({k: parts[k] for k in SPLIT_ORDER if k in parts}), sources


def _carve_validation(
    train: datasets.Dataset, weights: Sequence[float], seed: int, what: str
) -> dict[str, datasets.Dataset]:
    w_train, w_valid = weights[0], weights[1]
    if w_valid == 0:
        return {"train": train}
    if w_train == 0:
        raise DataError(
            f"--split: gives train no weight, but validation must be carved out of {what}'s "
            "train split; give train a positive weight"
        )
    return _split_dataset(train, (w_train, w_valid), ("train", "validation"), seed, what)


def _load_hub(
    name: str, data_name: str | None, data_dir: str | None, weights: Sequence[float], seed: int
) -> tuple[datasets.DatasetDict, dict[str, str]]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, data_name, data_dir=data_dir)
    except Exception as e:  # offline, unknown name, bad config: all mean "the hub could not provide it"
        raise DataError(
            f"--data-path {name}: not a local file or directory, and the dataset hub could not provide it "
            f"({_short_reason(e)}); pass a local directory with train/validation files"
        ) from e
    if not isinstance(loaded, datasets.DatasetDict):  # defensive: load_dataset without split= is a dict
        loaded = datasets.DatasetDict({"train": loaded})
    return _named_splits(loaded, f"--data-path {name}", "the hub dataset", "hub split", weights, seed)


def _named_splits(
    loaded: datasets.DatasetDict, what: str, holder: str, source: str, weights: Sequence[float], seed: int
) -> tuple[datasets.DatasetDict, dict[str, str]]:
    """train/validation/test out of a dict of named splits (their usual aliases accepted); a missing validation
    split is carved out of train by ``--split``."""
    import datasets

    parts: dict[str, datasets.Dataset] = {}
    sources: dict[str, str] = {}
    for target, aliases in _HUB_SPLIT_ALIASES.items():
        hit = next((a for a in aliases if a in loaded), None)
        if hit is not None:
            parts[target] = loaded[hit]
            sources[target] = f"{source} {hit}"
    if "train" not in parts:
        raise DataError(
            f"{what}: {holder} has no train split (it has: {', '.join(loaded.keys())}); "
            "name one train, or pass a local directory with train/validation files"
        )
    if "validation" not in parts:
        parts.update(_carve_validation(parts["train"], weights, seed, what))
        sources.update(_carved_sources(f"{source} train", weights, parts))
    return datasets.DatasetDict({k: parts[k] for k in SPLIT_ORDER if k in parts}), sources


def _is_saved_dataset(directory: str) -> bool:
    """Whether ``directory`` was written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in ("dataset_dict.json", "state.json"))


def _load_saved(directory: str, weights: Sequence[float], seed: int) -> tuple[datasets.DatasetDict, dict[str, str]]:
    """A ``save_to_disk`` directory: a DatasetDict's splits by name, or one Dataset split by ``--split`` as one
    file is."""
    import datasets

    what = f"--data-path {directory}"
    try:
        loaded = datasets.load_from_disk(directory)
    except Exception as e:  # a damaged or foreign-version save: datasets raises its own types
        raise DataError(f"{what}: cannot be read as a saved dataset ({_short_reason(e, root=True)})") from e
    if isinstance(loaded, datasets.DatasetDict):
        return _named_splits(loaded, what, "the saved dataset", "saved split", weights, seed)
    if len(loaded) == 0:
        raise DataError(f"{what}: the saved dataset has no rows")
    parts = _split_dataset(loaded, weights, SPLIT_ORDER, seed, what)
    name = os.path.basename(os.path.normpath(directory))
    sources = {k: f"{w:.0%} of saved {name} (--split)" for k, w in zip(SPLIT_ORDER, weights, strict=True) if w > 0}
    return datasets.DatasetDict(parts), sources
