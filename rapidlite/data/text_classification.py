"""Data loading for ``--task sequence_classification``.

Three steps, each usable on its own:

* :func:`rapidlite.data.tabular.load_raw_datasets` (re-exported here) turns ``--data-path`` (a local directory,
  a local file or a dataset hub name) into a ``datasets.DatasetDict`` with splits among ``train``, ``validation``
  and ``test``;
* :func:`detect_columns` finds the text column(s) and the label column;
* :func:`build_text_classification_data` maps labels to ids, tokenizes and returns a
  :class:`TextClassificationData` with a padding ``collate_fn``.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line naming
the flag or file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapidlite.data.tabular import SPLIT_ORDER, carved_splits, load_raw_datasets, parse_split  # noqa: F401
from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets
    import torch

TEXT_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("question", "sentence"),
    ("question", "passage"),
    ("premise", "hypothesis"),
    ("sentence",),
    ("text",),
    ("review",),
    ("content",),
    ("document",),
)
LABEL_NAMES: tuple[str, ...] = ("label", "labels", "class", "target", "category", "sentiment")
_STRING_DTYPES = ("string", "large_string")


# --------------------------------------------------------------------------------------------------
# Column detection
# --------------------------------------------------------------------------------------------------


def _is_string_feature(feature: Any) -> bool:
    # datasets 5 infers CSV/JSON text as "large_string", not "string".
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in _STRING_DTYPES


def detect_columns(
    dataset: datasets.Dataset, text_keys: list[str] | None = None, label_key: str | None = None
) -> tuple[tuple[str, ...], str]:
    """Return ``(text_columns, label_column)`` of ``dataset``, honouring ``--text-keys``/``--label-key``."""
    columns = list(dataset.column_names)
    available = ", ".join(columns)

    if label_key is not None:
        if label_key not in columns:
            raise DataError(f"--label-key {label_key}: no such column (available: {available})")
        label = label_key
    else:
        found = next((c for c in LABEL_NAMES if c in columns), None)
        if found is None:
            raise DataError(
                f"--label-key: no label column found (tried {', '.join(LABEL_NAMES)}; "
                f"available: {available}); name the label column with --label-key"
            )
        label = found

    if text_keys:
        keys = tuple(text_keys)
        missing = [k for k in keys if k not in columns]
        if missing:
            raise DataError(
                f"--text-keys {','.join(keys)}: no such column {', '.join(missing)} (available: {available})"
            )
        if len(keys) > 2:
            raise DataError(f"--text-keys {','.join(keys)}: at most two text columns (a sentence pair) are supported")
        if label in keys:
            raise DataError(
                f"--text-keys {','.join(keys)}: includes the label column {label}; "
                "pick other text columns or another --label-key"
            )
        return keys, label

    for layout in TEXT_LAYOUTS:
        if all(c in columns for c in layout) and label not in layout:
            return layout, label
    strings = tuple(c for c in columns if c != label and _is_string_feature(dataset.features[c]))
    if not strings:
        raise DataError(
            f"--text-keys: no text column found (available: {available}); name one or two text columns with --text-keys"
        )
    return strings[:2], label


# --------------------------------------------------------------------------------------------------
# Labels, tokenization, batching
# --------------------------------------------------------------------------------------------------


@dataclass
class TextClassificationData:
    """Tokenized splits plus what the model and metrics need to know about the labels."""

    train: datasets.Dataset
    validation: datasets.Dataset | None
    test: datasets.Dataset | None
    num_labels: int
    id2label: dict[int, str]
    text_keys: tuple[str, ...]
    label_key: str
    collate_fn: Callable[[list[dict]], dict[str, torch.Tensor]]
    # Rows dropped per split for a missing or negative label: ``{"train": (dropped, rows)}``.
    dropped: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Whether the ids are a model head's (``label_order``) rather than the sorted labels'.
    follows_head: bool = False
    # Float scores (STS-B style): one output, labels are floats, NaN where unlabelled.
    regression: bool = False
    # Rows moved back to train from a split --split carved out of it, per split: their label had no train rows.
    moved: dict[str, int] = field(default_factory=dict)


class PadCollator:
    """Pads a list of tokenized rows to the longest one; a class (not a closure) so workers can pickle it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        import torch

        # Labels are not a tokenizer input; padding them is not the tokenizer's business.
        labels = [f["labels"] for f in features] if features and "labels" in features[0] else None
        inputs = [{k: v for k, v in f.items() if k != "labels"} for f in features]
        padded = self.tokenizer.pad(inputs, padding="longest", return_tensors="pt")
        batch = {k: torch.as_tensor(v).to(torch.int64) for k, v in padded.items()}
        if labels is not None:
            values = torch.as_tensor(labels)
            # Regression scores train a float head (MSE); class ids index logits.
            batch["labels"] = values.float() if values.is_floating_point() else values.to(torch.int64)
        return batch


def _column_values(ds: datasets.Dataset, column: str) -> list[Any]:
    # Not ds.data: after select() that is still the whole underlying table, in its original order.
    return list(ds.with_format(None)[column])


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


@dataclass
class _LabelPlan:
    """How raw label values become ids; plain data so ``datasets.map`` workers can pickle it."""

    to_id: dict[Any, int] | None  # None: labels are already ids (a ClassLabel); int keys: integer labels
    num_labels: int
    id2label: dict[int, str]
    remap: list[int] | None = None  # these ids -> the ids of a model head with the same label names
    regression: bool = False  # float scores, passed through (NaN where missing)

    def convert(self, value: Any) -> int | float:
        if self.regression:
            return math.nan if _is_missing(value) else float(value)
        if _is_missing(value):
            return -1
        if self.to_id is None:
            label = int(value)
        elif isinstance(next(iter(self.to_id)), int):
            number = int(float(value))
            label = -1 if number < 0 else self.to_id[number]
        else:
            label = self.to_id[str(value)]
        return self.remap[label] if self.remap is not None and label >= 0 else label

    def labelled(self, label: float) -> bool:
        """Whether a converted label is scored: not NaN for a score, not negative for a class."""
        return not math.isnan(label) if self.regression else label >= 0

    def follow_head(self, head: list[str] | None) -> bool:
        """Take the ids of a model head whose names include all these labels (case aside, as run_glue matches them),
        so a fine-tuned classifier is evaluated or trained further with its own head, also on data holding only
        some of its classes; whether it did."""
        names = [self.id2label[i] for i in range(self.num_labels)]
        if self.regression or head is None or names == head or len({n.lower() for n in head}) != len(head):
            return False
        head_id = {n.lower(): i for i, n in enumerate(head)}
        if any(n.lower() not in head_id for n in names):
            return False
        self.remap = [head_id[n.lower()] for n in names]
        self.id2label = dict(enumerate(head))
        self.num_labels = len(head)
        return True


def _class_id(value: Any, split: str, label: str) -> int | None:
    """``value`` as an integer class id (None if missing); the train dtype decided labels are ids."""
    if _is_missing(value):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not number.is_integer():
        raise DataError(
            f"--label-key {label}: {split} label {value!r} is not an integer class id like the train "
            "labels (whole numbers, read as classes; scores with fractions in train are a regression); make the "
            "labels of all splits consistent"
        )
    return int(number)


def _check_known(values: dict[str, list], known: Any, label: str, shown: list[str]) -> None:
    """A validation or test label the train split lacks is one line: the model could never learn to predict it."""
    for name in ("validation", "test"):
        for v in values.get(name, []):
            if v is not None and v not in known:
                raise DataError(
                    f"--label-key {label}: {name} label {v!r} does not occur in train "
                    f"(train labels: {', '.join(shown[:20])}); fix the {name} file, or where --split carves {name} "
                    "out of one file, give that label more rows or drop it"
                )


def _at_least_two(classes: list[str], label: str) -> None:
    if len(classes) < 2:
        raise DataError(
            f"--label-key {label}: the train split has only one class ({', '.join(classes)}); classification needs "
            "at least two, add rows of another class"
        )


def _plan_labels(splits: dict[str, datasets.Dataset], label: str, scores: bool = False) -> _LabelPlan:
    """Decide the label mapping from the train values and check every split against it.

    A ClassLabel keeps its ids and names. Other integer labels are mapped, as run_glue maps them, to the sorted
    distinct non-negative train values (1..5 stars become ids 0..4 named "1".."5"; ids 0..N-1 stay as they
    are), and strings to their sorted distinct train values; negative integers (GLUE's unlabelled test rows)
    and missing labels are unlabelled. ``scores``: numbers are scores even when whole (a regression head's data).
    """
    from datasets import ClassLabel

    feature = splits["train"].features[label]
    values = {name: _column_values(ds, label) for name, ds in splits.items() if label in ds.column_names}
    train_values = [v for v in values["train"] if not _is_missing(v)]
    dtype = getattr(feature, "dtype", None)

    if scores and not isinstance(feature, ClassLabel) and isinstance(dtype, str) and dtype.startswith(("int", "float")):
        return _plan_regression(values, label)
    if isinstance(feature, ClassLabel) or (isinstance(dtype, str) and dtype.startswith(("int", "uint"))):
        mode = "int"
    elif isinstance(dtype, str) and dtype.startswith("float"):
        if any(not float(v).is_integer() for v in train_values):
            return _plan_regression(values, label)
        mode = "int"  # whole numbers stored as floats (a csv column with empty cells): class ids
    else:  # strings, bools and anything else: classes are the sorted distinct train values
        mode = "str"

    if mode == "str":
        classes = sorted({str(v) for v in train_values})
        if not classes:
            raise DataError(f"--label-key {label}: the train split has no labels")
        to_id = {c: i for i, c in enumerate(classes)}
        shown = {n: [None if _is_missing(v) else str(v) for v in vals] for n, vals in values.items()}
        _check_known(shown, to_id, label, classes)
        return _LabelPlan(to_id, len(classes), dict(enumerate(classes)))

    ids = {name: [_class_id(v, name, label) for v in vals] for name, vals in values.items()}
    # Negatives (GLUE test sets use -1) mean "unlabelled": dropped from train/validation, not scored in test.
    labelled = {name: [None if v is None or v < 0 else v for v in vals] for name, vals in ids.items()}
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        num_labels = max(
            [len(names)] + [v + 1 for n in ("train", "validation") for v in labelled.get(n, []) if v is not None]
        )
        for v in labelled.get("test", []):
            if v is not None and v >= num_labels:
                raise DataError(
                    f"--label-key {label}: test label {v} is not one of the {num_labels} classes "
                    f"(ids 0..{num_labels - 1}); fix the test file"
                )
        return _LabelPlan(None, num_labels, {i: names[i] if i < len(names) else str(i) for i in range(num_labels)})
    classes_int = sorted({v for v in labelled["train"] if v is not None})
    if not classes_int:
        raise DataError(f"--label-key {label}: the train split has no non-negative labels")
    _check_known(labelled, set(classes_int), label, [str(c) for c in classes_int])
    return _LabelPlan(
        {c: i for i, c in enumerate(classes_int)}, len(classes_int), dict(enumerate(map(str, classes_int)))
    )


def _plan_regression(values: dict[str, list], label: str) -> _LabelPlan:
    """Float scores (STS-B's 0-5 similarity, ratings): a one-output head trained with MSE, as run_glue does."""
    for name, vals in values.items():
        for v in vals:
            if not _is_missing(v) and (isinstance(v, (bool, str)) or not math.isfinite(float(v))):
                raise DataError(
                    f"--label-key {label}: {name} label {v!r} is not a number like the train scores; "
                    "make the labels of all splits numbers"
                )
    return _LabelPlan(None, 1, {0: label}, regression=True)


def _unlabelled(value: Any) -> bool:
    """Missing, or a negative integer id (GLUE's unlabelled rows)."""
    return _is_missing(value) or (isinstance(value, int) and not isinstance(value, bool) and value < 0)


def _return_unseen_to_train(splits: dict[str, datasets.Dataset], label: str, carved: tuple[str, ...]) -> dict[str, int]:
    """Move the rows of a carved split (``--split`` cut it out of the train data) whose label has no train rows
    back to train: a one-row class that the shuffle put in validation could never be learnt, and the user has no
    validation file to fix. Splits from files of their own are left as they are (an unseen label there is one
    line). Returns the rows moved per split."""
    import datasets

    moved: dict[str, int] = {}
    dtype = getattr(splits["train"].features[label], "dtype", None)
    if isinstance(dtype, str) and dtype.startswith("float"):
        return moved  # scores (or ids stored as floats): no classes to complete
    for name in carved:
        if name not in splits or label not in splits[name].column_names:
            continue
        train_labels = {str(v) for v in _column_values(splits["train"], label) if not _is_missing(v)}
        values = _column_values(splits[name], label)
        unseen = [i for i, v in enumerate(values) if not _unlabelled(v) and str(v) not in train_labels]
        if not unseen or len(unseen) == len(values):
            continue  # nothing to move, or nothing would be left to score
        keep = sorted(set(range(len(values))) - set(unseen))
        back = splits[name].select(unseen, keep_in_memory=True)
        splits["train"] = datasets.concatenate_datasets([splits["train"], back])
        splits[name] = splits[name].select(keep, keep_in_memory=True)
        moved[name] = len(unseen)
    return moved


def _tokenize_batch(
    batch: dict[str, list],
    tokenizer: Any,
    text_keys: tuple[str, ...],
    label_key: str | None,
    plan: _LabelPlan,
    seq_length: int,
) -> dict[str, list]:
    # Empty cells arrive as None and numbers-as-text as ints; the tokenizer wants strings.
    texts = [["" if v is None else str(v) for v in batch[k]] for k in text_keys]
    encoded = tokenizer(texts[0], texts[1] if len(texts) > 1 else None, truncation=True, max_length=seq_length)
    out = dict(encoded)
    n = len(texts[0])
    unlabelled = math.nan if plan.regression else -1
    out["labels"] = [plan.convert(v) for v in batch[label_key]] if label_key else [unlabelled] * n
    return out


def build_text_classification_data(
    raw: datasets.DatasetDict,
    tokenizer: Any,
    seq_length: int,
    text_keys: list[str] | None = None,
    label_key: str | None = None,
    num_proc: int | None = None,
    label_order: list[str] | None = None,
    scores: bool = False,
) -> TextClassificationData:
    """Detect columns, map labels to ids and tokenize every split of ``raw`` (nothing is cached on disk).

    Rows with a negative or missing label are dropped from train/validation; test rows are kept with
    label -1 (also when the test split has no label column at all). ``label_order``: the label names of a model's
    head; when they include the data's labels, the head's ids and size are kept. ``scores``: numeric labels are
    regression scores even when they are whole numbers (the model's head is a regression one).
    """
    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    if seq_length < 2:
        raise DataError(f"--seq-length {seq_length}: too short; use at least 2 (room for [CLS] and [SEP])")
    splits = {name: raw[name] for name in SPLIT_ORDER if name in raw}
    keys, label = detect_columns(splits["train"], text_keys, label_key)
    for name, ds in splits.items():
        missing = [k for k in keys if k not in ds.column_names]
        if name != "test" and label not in ds.column_names:
            missing.append(label)
        if missing:
            raise DataError(
                f"--data-path: the {name} split lacks column {', '.join(missing)} that train has "
                f"(it has: {', '.join(ds.column_names)}); make the files' columns consistent"
            )
    if len(splits["train"]) == 0:
        raise DataError("--data-path: the train split is empty; add training rows")
    moved = {} if scores else _return_unseen_to_train(splits, label, carved_splits(raw))

    plan = _plan_labels(splits, label, scores)
    follows_head = plan.follow_head(label_order)
    if not plan.regression:
        _at_least_two(list(plan.id2label.values()), label)
    out: dict[str, datasets.Dataset | None] = {"train": None, "validation": None, "test": None}
    dropped: dict[str, tuple[int, int]] = {}
    for name, ds in splits.items():
        has_label = label in ds.column_names
        if name != "test":
            labels = [plan.convert(v) for v in _column_values(ds, label)]
            keep = [i for i, y in enumerate(labels) if plan.labelled(y)]
            if not keep:
                raise DataError(
                    f"--data-path: the {name} split has no labelled rows (labels missing or "
                    "negative); add labels or use another file"
                )
            if len(keep) < len(ds):
                dropped[name] = (len(ds) - len(keep), len(ds))
                ds = ds.select(keep, keep_in_memory=True)
        out[name] = ds.map(
            _tokenize_batch,
            batched=True,
            remove_columns=ds.column_names,
            fn_kwargs={
                "tokenizer": tokenizer,
                "text_keys": keys,
                "label_key": label if has_label else None,
                "plan": plan,
                "seq_length": seq_length,
            },
            num_proc=num_proc,
            # Nothing may be written next to the user's data or into the cache of a previous tokenizer.
            keep_in_memory=True,
            load_from_cache_file=False,
            desc=f"Tokenizing {name}",
        )

    assert out["train"] is not None
    return TextClassificationData(
        train=out["train"],
        validation=out["validation"],
        test=out["test"],
        num_labels=plan.num_labels,
        id2label=plan.id2label,
        text_keys=keys,
        label_key=label,
        collate_fn=PadCollator(tokenizer),
        dropped=dropped,
        follows_head=follows_head,
        regression=plan.regression,
        moved=moved,
    )
