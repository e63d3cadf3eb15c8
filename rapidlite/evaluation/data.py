"""Evaluation data: jsonl rows and the task their fields name, checked before any model is loaded.

A multiple-choice row is ``{"context": str, "endings": [str, ...], "label": int}`` (HellaSwag's layout; a
label given as a digit string, as the Hugging Face HellaSwag rows have it, is read as its integer), with
``images`` for a vision-language model. A perplexity row is ``{"text": str}``, or a chat with images in any
layout ``--task causal_lm`` reads (its assistant turns are scored). A reward row is a preference pair,
``{"prompt", "chosen", "rejected"}`` (text or conversations; the prompt may be left inside both, as ``--task
reward_model`` reads them), scored by a reward model. Every row must carry the fields of the file's task.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from rapidlite.data.vision import has_images, row_images, vision_sample
from rapidlite.errors import DataError

MULTIPLE_CHOICE = "multiple_choice"
PERPLEXITY = "perplexity"
REWARD = "reward"
TASK_FIELDS: dict[str, tuple[str, ...]] = {
    MULTIPLE_CHOICE: ("context", "endings", "label"),
    PERPLEXITY: ("text",),
    REWARD: ("chosen", "rejected"),
}


@dataclass(frozen=True)
class MultipleChoiceItem:
    """A context, its candidate endings and the index of the right one."""

    context: str
    endings: tuple[str, ...]
    label: int
    images: tuple = ()  # the context's images (paths relative to the data file, URLs, base64): a vision model's row


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a jsonl file (blank lines skipped); a row that is not a JSON object is a ``DataError``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise DataError(f"--data {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--data {path}: cannot read it ({e})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"--data {path}: line {number} is not JSON ({e.msg}); give one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"--data {path}: line {number} is not a JSON object; give one object per line")
        rows.append(row)
    if not rows:
        raise DataError(f"--data {path}: no rows; give one JSON object per line")
    return rows


def _missing_fields_error(path: str, row: dict, number: int, task: str | None) -> DataError:
    has = ", ".join(sorted(row)) or "none"
    if task is None:
        needed = " or ".join(f"{'/'.join(fields)} ({name})" for name, fields in TASK_FIELDS.items())
    else:
        needed = f"{'/'.join(TASK_FIELDS[task])} ({task})"
    return DataError(f"--data {path}: row {number} has the fields {has}; evaluation needs {needed}")


def detect_task(path: str | os.PathLike, rows: list[dict], task: str | None = None) -> str:
    """The task the rows are for: ``task`` when given (the rows must have its fields), else the one whose
    fields the first row carries. Every row must carry them."""
    path = os.fspath(path)
    if (
        task in (None, PERPLEXITY)
        and has_images(rows[0])
        and not all(f in rows[0] for f in TASK_FIELDS[MULTIPLE_CHOICE])
    ):
        return PERPLEXITY  # chats with images: their assistant turns are scored (rapidlite.evaluation.vision)
    if task is None:
        task = next((name for name, fields in TASK_FIELDS.items() if all(f in rows[0] for f in fields)), None)
        if task is None:
            raise _missing_fields_error(path, rows[0], 1, None)
    for number, row in enumerate(rows, 1):
        if not all(f in row for f in TASK_FIELDS[task]):
            raise _missing_fields_error(path, row, number, task)
    return task


def _label(path: str, number: int, value: object, choices: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < choices:
        raise DataError(
            f"--data {path}: row {number} has label {value!r}; give the index of the right ending (0 to {choices - 1})"
        )
    return value


def multiple_choice_items(path: str | os.PathLike, rows: list[dict]) -> list[MultipleChoiceItem]:
    """The rows as ``MultipleChoiceItem``s, each checked: a string context, two or more string endings, a label
    indexing them."""
    path = os.fspath(path)
    items = []
    for number, row in enumerate(rows, 1):
        context, endings = row["context"], row["endings"]
        if not isinstance(context, str):
            raise DataError(f"--data {path}: row {number}: context must be a string")
        if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) and e for e in endings)):
            raise DataError(f"--data {path}: row {number}: endings must be a list of two or more non-empty strings")
        label = _label(path, number, row["label"], len(endings))
        items.append(MultipleChoiceItem(context, tuple(endings), label, tuple(row_images(row))))
    return items


def text_rows(path: str | os.PathLike, rows: list[dict]) -> list[str]:
    """The ``text`` of each row, checked to be a string."""
    path = os.fspath(path)
    for number, row in enumerate(rows, 1):
        if not isinstance(row["text"], str):
            raise DataError(f"--data {path}: row {number}: text must be a string")
    return [row["text"] for row in rows]


def preference_rows(path: str | os.PathLike, rows: list[dict]) -> list[dict]:
    """The rows, each checked to be a preference pair of one kind (``rapidlite.data.preference.read_pair``)."""
    from rapidlite.data.preference import read_pair

    path = os.fspath(path)
    for number, row in enumerate(rows, 1):
        try:
            read_pair(row)
        except DataError as e:
            raise DataError(f"--data {path}: row {number}: {e}") from None
    return rows


def load_eval_data(path: str | os.PathLike, task: str | None = None) -> tuple[str, list]:
    """``(task, items)`` from a jsonl file: ``MultipleChoiceItem``s, texts or preference rows, by ``task`` or by the
    fields."""
    rows = read_jsonl(path)
    task = detect_task(path, rows, task)
    if task == MULTIPLE_CHOICE:
        return task, multiple_choice_items(path, rows)
    if task == PERPLEXITY and has_images(rows[0]):
        return task, image_chats(path, rows)
    return task, preference_rows(path, rows) if task == REWARD else text_rows(path, rows)


def image_chats(path: str | os.PathLike, rows: list[dict]) -> list:
    """Chats with images (any layout ``--task causal_lm`` reads) as ``VisionSample``s, each checked."""
    samples = []
    for number, row in enumerate(rows, 1):
        try:
            samples.append(vision_sample(row, number))
        except DataError as e:
            raise DataError(f"--data {os.fspath(path)}: {e}") from None
    return samples
