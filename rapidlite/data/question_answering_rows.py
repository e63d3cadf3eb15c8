"""The rows of extractive question answering data (SQuAD v1/v2 style): the question, the context and the answers.

A question, a context and its answers (``{"text": [...], "answer_start": [...]}``, character offsets
into the context; no answer at all is a SQuAD v2 unanswerable question). :func:`detect_columns` finds the
columns, :func:`read_answers` accepts the answer layouts people have (a dict column, a list of
``{"text", "answer_start"}``, either as JSON text in a csv cell, or ``answer_text``/``answer_start``
columns), and :func:`check_answers` refuses an answer whose text is not at its offset, naming the row. The
official SQuAD json file layout (``{"data": [{"paragraphs": [{"context", "qas"}]}]}``) is read as such rows
by :func:`squad_layout_rows`.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets

QUESTION_NAMES: tuple[str, ...] = ("question", "query")
CONTEXT_NAMES: tuple[str, ...] = ("context", "passage", "paragraph")
ANSWERS_NAMES: tuple[str, ...] = ("answers", "answer")
# A csv's single answer as two plain columns (empty text: no answer).
ANSWER_TEXT, ANSWER_START = "answer_text", "answer_start"
# rapidlite.data.tabular's order; not imported from it, which reads SQuAD-layout files with this module.
SPLIT_ORDER = ("train", "validation", "test")


def is_squad_layout(dataset: datasets.Dataset) -> bool:
    """Whether a json file read by ``datasets`` is one SQuAD-layout object (``{"version", "data": [...]}``)."""
    columns = set(dataset.column_names)
    if not ("data" in columns and columns <= {"data", "version"} and len(dataset) == 1):
        return False
    articles = getattr(dataset.features["data"], "feature", None)  # a list of {"title", "paragraphs"}
    return isinstance(articles, dict) and "paragraphs" in articles


def squad_layout_rows(path: str) -> datasets.Dataset:
    """The questions of a SQuAD-layout json file as rows ``id, title, context, question, answers`` (the
    Hugging Face ``squad``/``squad_v2`` columns; an unanswerable v2 question has empty answer lists)."""
    import datasets

    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    rows: dict[str, list] = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    try:
        for article in document["data"]:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    answers = qa.get("answers") or []
                    rows["id"].append(str(qa.get("id", len(rows["id"]))))
                    rows["title"].append(str(article.get("title", "")))
                    rows["context"].append(paragraph["context"])
                    rows["question"].append(qa["question"])
                    rows["answers"].append(
                        {
                            "text": [a["text"] for a in answers],
                            "answer_start": [int(a["answer_start"]) for a in answers],
                        }
                    )
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(
            f'{path}: a SQuAD-layout file ({{"data": [{{"paragraphs": [{{"context", "qas"}}]}}]}}) whose '
            f"entries lack {e} or have it malformed; fix the file"
        ) from None
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "title": datasets.Value("string"),
            "context": datasets.Value("string"),
            "question": datasets.Value("string"),
            "answers": {
                "text": datasets.Sequence(datasets.Value("string")),
                "answer_start": datasets.Sequence(datasets.Value("int64")),
            },
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)


@dataclass(frozen=True)
class QAColumns:
    """Which columns hold the question, the context and the answers. ``answers`` is one column, or None when a
    csv gives ``answer_text``/``answer_start`` columns."""

    question: str
    context: str
    answers: str | None

    def describe(self) -> str:
        answers = self.answers or f"{ANSWER_TEXT}+{ANSWER_START}"
        return f"question {self.question}, context {self.context}, answers {answers}"


def detect_columns(
    columns: Sequence[str], text_keys: Sequence[str] | None = None, label_key: str | None = None
) -> QAColumns:
    """The question, context and answers columns among ``columns``: named by ``--text-keys QUESTION CONTEXT``
    and ``--label-key ANSWERS``, else found by the usual names."""
    available = ", ".join(columns)
    if text_keys:
        if len(text_keys) != 2:
            raise DataError(
                f"--text-keys {' '.join(text_keys)}: question answering takes two columns, the question's then "
                "the context's (e.g. --text-keys question context)"
            )
        missing = [k for k in text_keys if k not in columns]
        if missing:
            raise DataError(f"--text-keys: no column {', '.join(missing)} (available: {available})")
        question, context = text_keys
    else:
        question = next((c for c in QUESTION_NAMES if c in columns), None)
        context = next((c for c in CONTEXT_NAMES if c in columns), None)
        if question is None or context is None:
            what = "question" if question is None else "context"
            names = QUESTION_NAMES if question is None else CONTEXT_NAMES
            raise DataError(
                f"--text-keys: no {what} column found (tried {', '.join(names)}; available: {available}); name the "
                "question and context columns with --text-keys QUESTION CONTEXT"
            )
    if label_key is not None:
        if label_key not in columns:
            raise DataError(f"--label-key {label_key}: no such column (available: {available})")
        return QAColumns(question, context, label_key)
    answers = next((c for c in ANSWERS_NAMES if c in columns), None)
    if answers is None and not {ANSWER_TEXT, ANSWER_START} <= set(columns):
        raise DataError(
            f"--label-key: no answers column found (tried {', '.join(ANSWERS_NAMES)}, or {ANSWER_TEXT} with "
            f"{ANSWER_START}; available: {available}); name it with --label-key"
        )
    return QAColumns(question, context, answers)


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _as_list(value: Any) -> list:
    if _is_missing(value):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        return list(value.tolist())
    return [value]


def read_answers(value: Any) -> tuple[list[str], list[int]]:
    """``(texts, starts)`` of one row's answers: a dict ``{"text": [...], "answer_start": [...]}`` (or with
    scalars), a list of ``{"text", "answer_start"}`` dicts, or either as JSON text (a csv cell). Raises
    ``ValueError`` saying what is wrong."""
    if isinstance(value, str):
        if not value.strip():
            return [], []
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(
                'is text that is not JSON; write {"text": ["..."], "answer_start": [N]} in the cell'
            ) from None
    if _is_missing(value):
        return [], []
    if isinstance(value, dict):
        texts, starts = _as_list(value.get("text")), _as_list(value.get("answer_start"))
        if "text" not in value or "answer_start" not in value:
            raise ValueError("needs both text and answer_start")
    elif isinstance(value, (list, tuple)) and all(isinstance(a, dict) for a in value):
        if any("text" not in a or "answer_start" not in a for a in value):
            raise ValueError("has an answer without text or answer_start")
        texts, starts = [a["text"] for a in value], [a["answer_start"] for a in value]
    else:
        raise ValueError(f'is {value!r}, not {{"text": [...], "answer_start": [...]}}')
    if len(texts) != len(starts):
        raise ValueError(f"has {len(texts)} texts but {len(starts)} answer_start values")
    try:
        starts = [int(s) for s in starts]
    except (TypeError, ValueError):
        raise ValueError(f"answer_start {starts!r} is not a list of character offsets") from None
    return [str(t) for t in texts], starts


def _column(ds: datasets.Dataset, name: str) -> list:
    # A plain list: indexing the column object row by row is slow. Not ds.data: after select() that is still
    # the whole underlying table.
    return list(ds.with_format(None)[name])


def _row_answers(row: dict[str, Any], columns: QAColumns) -> tuple[list[str], list[int]]:
    if columns.answers is not None:
        return read_answers(row[columns.answers])
    text, start = row[ANSWER_TEXT], row[ANSWER_START]
    if _is_missing(text) or str(text) == "":
        return [], []
    if _is_missing(start):
        raise ValueError(f"{ANSWER_TEXT} {text!r} has no {ANSWER_START}")
    try:
        return [str(text)], [int(start)]
    except (TypeError, ValueError):
        raise ValueError(f"{ANSWER_START} {start!r} is not a character offset") from None


@dataclass
class QAExample:
    """One question of an evaluation split: what post-processing and the metric need."""

    id: str
    context: str
    answers: list[str]


def _row_name(split: str, index: int, row_id: Any) -> str:
    return f"{split} row {index}" + (f" (id {row_id})" if row_id is not None else "")


def check_answers(
    split: str, ds: datasets.Dataset, columns: QAColumns, version_2_with_negative: bool
) -> list[tuple[list[str], list[int]]]:
    """Every row's ``(texts, starts)``, after checking that each answer's text is in the context at its
    ``answer_start`` and that rows without an answer come with ``--version-2-with-negative``."""
    ids = _column(ds, "id") if "id" in ds.column_names else [None] * len(ds)
    contexts = _column(ds, columns.context)
    answer_columns = [columns.answers] if columns.answers else [ANSWER_TEXT, ANSWER_START]
    values = {c: _column(ds, c) for c in answer_columns}
    out = []
    for i in range(len(ds)):
        where = _row_name(split, i, ids[i])
        try:
            texts, starts = _row_answers({c: values[c][i] for c in answer_columns}, columns)
        except ValueError as e:
            raise DataError(f"{where}: the answers ({columns.describe().split('answers ')[1]}) {e}") from None
        context = "" if _is_missing(contexts[i]) else str(contexts[i])
        for text, start in zip(texts, starts, strict=True):
            if not text or start < 0 or context[start : start + len(text)] != text:
                found = context[max(start, 0) : max(start, 0) + len(text)]
                raise DataError(
                    f"{where}: answer {text!r} is not in the context at answer_start {start} (the context has "
                    f"{found!r} there); fix the answer's text or its answer_start"
                )
        if not texts and not version_2_with_negative:
            raise DataError(
                f"{where}: has no answer; questions without answers are SQuAD v2 data: pass "
                "--version-2-with-negative (or drop the row)"
            )
        out.append((texts, starts))
    return out
