"""Multiple-choice data for ``--task multiple_choice``: a context, N candidate endings, the index of the right one.

Layouts (:func:`detect_layout`), each a context (one or two columns) and choices (one list column or one column
per choice):

* SWAG (``run_swag``'s): ``sent1``, ``sent2``, ``ending0`` .. ``ending3``, ``label``;
* HellaSwag: ``ctx_a``, ``ctx_b``, ``endings`` (a list), ``label`` (a digit string; empty in the unlabelled test
  split), or ``ctx`` with ``endings``;
* generic: a context column (``question``, ``context``, ``question_stem``, ``goal``, ``premise``, ``prompt``,
  ``sentence``, ``text``; or ``article`` + ``question`` as RACE has them), a list column of choices (``choices``,
  ``options``, ``endings``; lists of strings, or ``{"text": [...], "label": [...]}`` as CommonsenseQA, ARC and
  OpenBookQA have them) or numbered columns (``ending0..``, ``sol1..``, ``choice1..``, ``option1..``), and a label
  column (``label``, ``labels``, ``answerKey``, ``answer``, ``gold``) holding the 0-based index of the right
  choice, as a number, a digit string, or a letter (``A`` is the first choice, or the choice whose label it is).

``--text-keys CONTEXT [PREFIX]``, ``--choices-key`` and ``--label-key`` name the columns instead. As in
``run_swag``, choice ``i`` of a row is the text pair ``(first context column, "second context column ending_i")``,
tokenized together (longest first truncated at ``seq_length``). Every row has the same number of choices.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line naming the flag
or file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidlite.data.tabular import SPLIT_ORDER
from rapidlite.errors import DataError

if TYPE_CHECKING:
    import datasets
    import torch

# (first, second) context columns, tried in order: the second (if any) starts every choice, as SWAG's sent2 does.
CONTEXT_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("sent1", "sent2"),
    ("ctx_a", "ctx_b"),
    ("article", "question"),
    ("ctx",),
    ("question",),
    ("question_stem",),
    ("context",),
    ("goal",),
    ("premise",),
    ("prompt",),
    ("sentence",),
    ("text",),
)
CHOICE_LISTS: tuple[str, ...] = ("endings", "choices", "options")
NUMBERED_CHOICES: tuple[str, ...] = ("ending", "sol", "choice", "option")
LABEL_NAMES: tuple[str, ...] = ("label", "labels", "answerKey", "answer", "gold")


@dataclass(frozen=True)
class Layout:
    """Which columns hold the context (``context``: one or two), the choices (one list column, or one column
    per choice) and the label."""

    context: tuple[str, ...]
    choices: tuple[str, ...]
    label: str

    @property
    def listed(self) -> bool:
        return len(self.choices) == 1

    def columns(self) -> tuple[str, ...]:
        return (*self.context, *self.choices, self.label)


def _numbered(columns: Sequence[str]) -> tuple[str, ...]:
    """Columns ``<prefix>0, <prefix>1, ...`` (or from 1) of the first known prefix that has two or more."""
    for prefix in NUMBERED_CHOICES:
        numbers = sorted(int(m.group(1)) for c in columns if (m := re.fullmatch(rf"{prefix}(\d+)", c)))
        if len(numbers) >= 2 and numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] <= 1:
            return tuple(f"{prefix}{n}" for n in numbers)
    return ()


def detect_layout(
    columns: Sequence[str],
    text_keys: Sequence[str] | None = None,
    choices_key: Sequence[str] | None = None,
    label_key: str | None = None,
) -> Layout:
    """The layout of data with ``columns``, honouring ``--text-keys``/``--choices-key``/``--label-key``."""
    cols = list(columns)
    available = ", ".join(cols)

    def missing(flag: str, names: Sequence[str]) -> None:
        absent = [n for n in names if n not in cols]
        if absent:
            raise DataError(f"{flag} {' '.join(names)}: no such column {', '.join(absent)} (available: {available})")

    if choices_key:
        missing("--choices-key", choices_key)
        choices = tuple(choices_key)
    else:
        listed = next((c for c in CHOICE_LISTS if c in cols), None)
        choices = (listed,) if listed else _numbered(cols)
        if not choices:
            raise DataError(
                f"--choices-key: no choices found (tried list columns {', '.join(CHOICE_LISTS)} and numbered "
                f"columns {', '.join(p + '0..' for p in NUMBERED_CHOICES)}; available: {available}); name them with "
                "--choices-key"
            )
    if label_key:
        missing("--label-key", [label_key])
        label = label_key
    else:
        found = next((c for c in LABEL_NAMES if c in cols), None)
        if found is None:
            raise DataError(
                f"--label-key: no label column found (tried {', '.join(LABEL_NAMES)}; available: {available}); "
                "name it with --label-key"
            )
        label = found
    if text_keys:
        if len(text_keys) > 2:
            raise DataError(
                f"--text-keys {' '.join(text_keys)}: at most two context columns (the context, and a start every "
                "choice continues)"
            )
        missing("--text-keys", text_keys)
        context = tuple(text_keys)
    else:
        taken = {*choices, label}
        context = next((c for c in CONTEXT_LAYOUTS if all(k in cols and k not in taken for k in c)), ())
        if not context:
            names = ", ".join("+".join(c) for c in CONTEXT_LAYOUTS)
            raise DataError(
                f"--text-keys: no context column found (tried {names}; available: {available}); name it with "
                "--text-keys"
            )
    overlap = set(context) & {*choices, label} or ({label} & set(choices))
    if overlap:
        raise DataError(f"column {', '.join(sorted(overlap))} is named for two roles; give each role its own column")
    return Layout(context, choices, label)


# --------------------------------------------------------------------------------------------------
# Rows: texts and labels
# --------------------------------------------------------------------------------------------------


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (isinstance(value, str) and not value)


def _text(value: Any) -> str:
    return "" if _is_missing(value) else str(value).strip()


def row_choices(row: dict[str, Any], layout: Layout) -> tuple[list[str], list[str] | None]:
    """The row's choice texts, and their own labels when the choices are ``{"text", "label"}`` lists."""
    if not layout.listed:
        return [_text(row[c]) for c in layout.choices], None
    value = row[layout.choices[0]]
    if isinstance(value, dict) and "text" in value:
        names = value.get("label")
        return [_text(v) for v in value["text"]], [str(n) for n in names] if names is not None else None
    if not isinstance(value, (list, tuple)):
        raise DataError(
            f"--choices-key {layout.choices[0]}: holds {type(value).__name__} values, not lists of choices; name "
            "one list column or one column per choice"
        )
    return [_text(v) for v in value], None


def label_index(value: Any, names: list[str] | None, count: int) -> int | None:
    """The 0-based index a label means (None: missing): an integer, a digit string, a choice's own label or a
    letter (A = 0); -1 or any other value is invalid (raises ValueError)."""
    if _is_missing(value):
        return None
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        if not float(value).is_integer():
            raise ValueError(value)
        return int(value)
    text = str(value).strip()
    if names is not None and text in names:
        return names.index(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if len(text) == 1 and "A" <= text.upper() <= "Z":
        return ord(text.upper()) - ord("A")
    raise ValueError(value)


@dataclass
class MultipleChoiceData:
    """Tokenized splits (rows: ``input_ids`` and the tokenizer's other outputs, one list per choice, and
    ``labels``: the right choice, -1 in unlabelled test rows) and the layout they were read with."""

    train: Any
    validation: Any | None
    test: Any | None
    layout: Layout
    num_choices: int
    truncated: int  # choice sequences cut at seq_length


def _texts(ds: datasets.Dataset, layout: Layout, split: str) -> tuple[list[str], list[str], list[int], int]:
    """First and second texts of every choice of every row (flattened), the labels, and the number of choices;
    every inconsistency is one line naming the split and the row."""
    firsts: list[str] = []
    seconds: list[str] = []
    labels: list[int] = []
    count = None
    prefix_column = layout.context[1] if len(layout.context) > 1 else None
    for i, row in enumerate(ds.with_format(None)):
        where = f"{split} row {i + 1}"
        first = _text(row[layout.context[0]])
        prefix = _text(row[prefix_column]) if prefix_column else ""
        if not first and not prefix:
            raise DataError(
                f"--data-path: {where} has an empty context ({'+'.join(layout.context)}); fill it or drop the row"
            )
        choices, names = row_choices(row, layout)
        if count is None:
            count = len(choices)
            if count < 2:
                raise DataError(f"--data-path: {where} has {count} choice(s); a question needs at least two")
        elif len(choices) != count:
            raise DataError(
                f"--data-path: {where} has {len(choices)} choices, earlier rows {count}; every row needs the same "
                "number of choices"
            )
        empty = [j for j, c in enumerate(choices) if not c]
        if empty:
            raise DataError(f"--data-path: {where}: choice {empty[0]} is empty; fill it or drop the row")
        try:
            label = label_index(row[layout.label], names, count)
        except ValueError:
            label = -2
        if label is None:
            if split != "test":
                raise DataError(
                    f"--label-key {layout.label}: {where} has no label; label every {split} row (only test rows "
                    "may be unlabelled)"
                )
            label = -1
        elif not 0 <= label < count:
            raise DataError(
                f"--label-key {layout.label}: {where} has label {row[layout.label]!r}, not a choice (0..{count - 1} "
                f"or A..{chr(ord('A') + count - 1)}); fix the label"
                + ("; labels counting the choices from 1 need 1 subtracted" if label == count else "")
            )
        firsts += [first] * count
        seconds += [f"{prefix} {c}".strip() for c in choices]
        labels.append(label)
    if count is None:
        raise DataError(f"--data-path: the {split} split has no rows")
    return firsts, seconds, labels, count


def build_multiple_choice_data(
    raw: datasets.DatasetDict,
    tokenizer: Any,
    seq_length: int,
    text_keys: Sequence[str] | None = None,
    choices_key: Sequence[str] | None = None,
    label_key: str | None = None,
) -> MultipleChoiceData:
    """Detect the layout, check every row and tokenize every split of ``raw`` (nothing is cached on disk)."""
    import datasets

    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    splits = {name: raw[name] for name in SPLIT_ORDER if name in raw}
    layout = detect_layout(splits["train"].column_names, text_keys, choices_key, label_key)
    out: dict[str, Any] = {"train": None, "validation": None, "test": None}
    num_choices = None
    truncated = 0
    for name, ds in splits.items():
        absent = [
            c for c in layout.columns() if c not in ds.column_names and not (name == "test" and c == layout.label)
        ]
        if absent:
            raise DataError(
                f"--data-path: the {name} split lacks column {', '.join(absent)} that train has (it has: "
                f"{', '.join(ds.column_names)}); make the files' columns consistent"
            )
        if layout.label not in ds.column_names:
            ds = ds.add_column(layout.label, [None] * len(ds))
        firsts, seconds, labels, count = _texts(ds, layout, name)
        if num_choices is not None and count != num_choices:
            raise DataError(
                f"--data-path: the {name} split has {count} choices per row, train {num_choices}; every split needs "
                "the same number"
            )
        num_choices = count
        encoded = tokenizer(firsts, seconds, truncation="longest_first", max_length=seq_length)
        full = tokenizer(firsts, seconds, truncation=False, verbose=False)["input_ids"]
        truncated += sum(len(ids) > seq_length for ids in full)
        columns = {
            key: [list(values[i : i + count]) for i in range(0, len(values), count)] for key, values in encoded.items()
        }
        columns["labels"] = labels
        out[name] = datasets.Dataset.from_dict(columns)
    assert num_choices is not None
    return MultipleChoiceData(out["train"], out["validation"], out["test"], layout, num_choices, truncated)


class MultipleChoiceCollator:
    """Pads the choices of a batch's rows to the longest: ``[batch, choices, length]`` tensors (``input_ids``
    with ``pad_token_id``, everything else with 0) and ``labels`` ``[batch]``. A class, so loader workers can
    pickle it."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        choices = len(rows[0]["input_ids"])
        length = max(len(seq) for r in rows for seq in r["input_ids"])
        batch: dict[str, torch.Tensor] = {}
        for key in rows[0]:
            if key == "labels":
                continue
            fill = self.pad_token_id if key == "input_ids" else 0
            tensor = torch.full((len(rows), choices, length), fill, dtype=torch.int64)
            for i, r in enumerate(rows):
                for j, seq in enumerate(r[key]):
                    tensor[i, j, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
            batch[key] = tensor
        batch["labels"] = torch.tensor([r["labels"] for r in rows], dtype=torch.int64)
        return batch
