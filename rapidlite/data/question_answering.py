"""Extractive question answering data (SQuAD v1/v2 style) for ``--task question_answering``.

The steps, each usable on its own, follow Hugging Face's ``run_qa.py`` example:

* rows: a question, a context and its answers (``{"text": [...], "answer_start": [...]}``, character offsets
  into the context; no answer at all is a SQuAD v2 unanswerable question). :func:`detect_columns` finds the
  columns, :func:`read_answers` accepts the answer layouts people have (a dict column, a list of
  ``{"text", "answer_start"}``, either as JSON text in a csv cell, or ``answer_text``/``answer_start``
  columns), and :func:`check_answers` refuses an answer whose text is not at its offset, naming the row. The
  official SQuAD json file layout (``{"data": [{"paragraphs": [{"context", "qas"}]}]}``) is read as such rows
  by :func:`squad_layout_rows`.
* features: :func:`build_question_answering_data` tokenizes question and context as a pair (question first;
  context first for a tokenizer that pads on the left), cutting long contexts into overlapping windows of
  ``seq_length`` tokens, ``doc_stride`` tokens apart in overlap. Each window is labelled with the token
  positions of the first answer, or with the CLS token when the answer is not (wholly) inside it. Evaluation
  windows also keep which example they came from and each token's character span in the context
  (:class:`FeatureMeta`), so logits can be turned back into text.
* answers: :func:`postprocess_predictions` picks, for every example, the best valid span over all its
  windows from the start and end logits, as ``run_qa``'s ``postprocess_qa_predictions`` does, with the null
  answer for SQuAD v2.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets
    import torch

QUESTION_NAMES: tuple[str, ...] = ("question", "query")
CONTEXT_NAMES: tuple[str, ...] = ("context", "passage", "paragraph")
ANSWERS_NAMES: tuple[str, ...] = ("answers", "answer")
# A csv's single answer as two plain columns (empty text: no answer).
ANSWER_TEXT, ANSWER_START = "answer_text", "answer_start"
MODEL_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
POSITION_KEYS: tuple[str, ...] = ("start_positions", "end_positions")
FEATURE_INDEX = "feature_index"
# rapidlite.data.tabular's order; not imported from it, which reads SQuAD-layout files with this module.
SPLIT_ORDER = ("train", "validation", "test")


# --------------------------------------------------------------------------------------------------
# The official SQuAD file layout
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Columns and answers
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Features: tokenized windows
# --------------------------------------------------------------------------------------------------


@dataclass
class FeatureMeta:
    """An evaluation window: its example (index into the split's examples), each token's character span in
    the context (``[-1, -1]`` for a token outside the context) and its CLS position."""

    example: int
    offsets: np.ndarray
    cls_index: int


@dataclass
class QuestionAnsweringData:
    """Tokenized windows of every split, the evaluation windows' metadata, and a padding collator.

    ``meta[i]`` describes evaluation window ``i`` (the ``feature_index`` of its row) of any evaluation split;
    ``windows_of[split]`` is the range of the split's windows in it, whose ``example`` indexes
    ``examples[split]``."""

    train: datasets.Dataset | None
    validation: datasets.Dataset | None
    test: datasets.Dataset | None
    columns: QAColumns
    seq_length: int
    collate_fn: QACollator
    examples: dict[str, list[QAExample]] = field(default_factory=dict)
    meta: list[FeatureMeta] = field(default_factory=list)
    windows_of: dict[str, range] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    windows: dict[str, int] = field(default_factory=dict)


def _cls_index(input_ids: list[int], tokenizer: Any) -> int:
    for special in (tokenizer.cls_token_id, tokenizer.bos_token_id):
        if special is not None and special in input_ids:
            return input_ids.index(special)
    return 0


def _label_window(
    offsets: list[tuple[int, int]], sequence_ids: list[int | None], context_id: int, start: int, end: int
) -> tuple[int, int] | None:
    """Token positions of the characters ``[start, end)`` in this window, or None when the window's context
    does not hold them whole."""
    tokens = [k for k, s in enumerate(sequence_ids) if s == context_id]
    if not tokens:
        return None
    first, last = tokens[0], tokens[-1]
    if not (offsets[first][0] <= start and offsets[last][1] >= end):
        return None
    begin = first
    while begin <= last and offsets[begin][0] <= start:
        begin += 1
    finish = last
    while finish >= first and offsets[finish][1] >= end:
        finish -= 1
    return begin - 1, finish + 1


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    tokenizer: Any,
    columns: QAColumns,
    answers: list[tuple[list[str], list[int]]],
    seq_length: int,
    doc_stride: int,
    keep_meta: bool,
    split: str,
) -> dict[str, list]:
    pad_on_right = tokenizer.padding_side != "left"
    # run_qa strips the questions' leading whitespace: some questions have a lot of it, which wastes windows.
    questions = ["" if _is_missing(q) else str(q).lstrip() for q in batch[columns.question]]
    contexts = ["" if _is_missing(c) else str(c) for c in batch[columns.context]]
    room = seq_length - tokenizer.num_special_tokens_to_add(pair=True)
    lengths = [len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]]
    for i, length in enumerate(lengths):
        if room - length <= doc_stride:
            raise DataError(
                f"{_row_name(split, indices[i], batch['id'][i] if 'id' in batch else None)}: its question is "
                f"{length} tokens, which leaves {max(room - length, 0)} context tokens per window of --seq-length "
                f"{seq_length}, not more than --doc-stride {doc_stride}; raise --seq-length or lower --doc-stride"
            )
    try:
        encoded = tokenizer(
            questions if pad_on_right else contexts,
            contexts if pad_on_right else questions,
            truncation="only_second" if pad_on_right else "only_first",
            max_length=seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
        )
    except Exception as e:  # the Rust tokenizer's truncation errors: report them as the data's problem
        raise DataError(
            f"{split} data: cannot cut the contexts into windows ({e}); check --seq-length/--doc-stride"
        ) from None
    context_id = 1 if pad_on_right else 0
    sample_mapping = encoded.pop("overflow_to_sample_mapping")
    offset_mapping = encoded.pop("offset_mapping")
    out: dict[str, list] = {k: v for k, v in encoded.items() if k in MODEL_KEYS}
    out["start_positions"], out["end_positions"] = [], []
    if keep_meta:
        out["example"], out["offsets"], out["cls_index"] = [], [], []
    for i, offsets in enumerate(offset_mapping):
        ids = encoded["input_ids"][i]
        sequence_ids = encoded.sequence_ids(i)
        cls_index = _cls_index(ids, tokenizer)
        texts, starts = answers[indices[sample_mapping[i]]]
        span = None
        if texts:
            span = _label_window(offsets, sequence_ids, context_id, starts[0], starts[0] + len(texts[0]))
        start, end = span if span is not None else (cls_index, cls_index)
        out["start_positions"].append(start)
        out["end_positions"].append(end)
        if keep_meta:
            out["example"].append(indices[sample_mapping[i]])
            out["offsets"].append(
                [list(o) if s == context_id else [-1, -1] for o, s in zip(offsets, sequence_ids, strict=True)]
            )
            out["cls_index"].append(cls_index)
    return out


def build_question_answering_data(
    raw: datasets.DatasetDict,
    tokenizer: Any,
    seq_length: int,
    doc_stride: int,
    text_keys: Sequence[str] | None = None,
    label_key: str | None = None,
    version_2_with_negative: bool = False,
    eval_splits: Sequence[str] = ("validation", "test"),
) -> QuestionAnsweringData:
    """Check and tokenize every split of ``raw`` (nothing is cached on disk). ``eval_splits`` keep their
    windows' metadata for post-processing (``feature_index`` in their rows); a test split without answers is
    left out (nothing to score)."""
    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{type(tokenizer).__name__}: question answering maps tokens back to the context with a fast "
            "tokenizer's offsets; use a model directory with a tokenizer.json (a fast tokenizer)"
        )
    seq_length = min(seq_length, tokenizer.model_max_length or seq_length)
    if not 0 < doc_stride < seq_length:
        raise DataError(f"--doc-stride {doc_stride}: must be positive and below --seq-length {seq_length}")
    splits = {name: raw[name] for name in SPLIT_ORDER if name in raw}
    columns = detect_columns(splits["train"].column_names, text_keys, label_key)
    answer_columns = [columns.answers] if columns.answers else [ANSWER_TEXT, ANSWER_START]
    for name, ds in list(splits.items()):
        missing = [c for c in (columns.question, columns.context) if c not in ds.column_names]
        lacks_answers = any(c not in ds.column_names for c in answer_columns)
        if name == "test" and lacks_answers and not missing:
            del splits[name]  # unanswered test questions (a leaderboard's): nothing to score
            continue
        if lacks_answers:
            missing += [c for c in answer_columns if c not in ds.column_names]
        if missing:
            raise DataError(
                f"--data-path: the {name} split lacks column {', '.join(missing)} (it has: "
                f"{', '.join(ds.column_names)}); make the files' columns consistent"
            )
        if len(ds) == 0 and name == "train":
            raise DataError("--data-path: the train split is empty; add training rows")

    collate = QACollator(tokenizer)
    data = QuestionAnsweringData(None, None, None, columns, seq_length, collate)
    for name, ds in splits.items():
        answers = check_answers(name, ds, columns, version_2_with_negative)
        keep_meta = name in eval_splits
        features = ds.map(
            _tokenize_batch,
            batched=True,
            with_indices=True,
            remove_columns=ds.column_names,
            fn_kwargs={
                "tokenizer": tokenizer,
                "columns": columns,
                "answers": answers,
                "seq_length": seq_length,
                "doc_stride": doc_stride,
                "keep_meta": keep_meta,
                "split": name,
            },
            # Nothing may be written next to the user's data or into the cache of a previous tokenizer.
            keep_in_memory=True,
            load_from_cache_file=False,
            desc=f"Tokenizing {name}",
        )
        data.rows[name], data.windows[name] = len(ds), len(features)
        if keep_meta:
            features = _split_off_meta(data, name, ds, columns, answers, features)
        setattr(data, name, features)
    return data


def _split_off_meta(
    data: QuestionAnsweringData,
    name: str,
    ds: datasets.Dataset,
    columns: QAColumns,
    answers: list[tuple[list[str], list[int]]],
    features: datasets.Dataset,
) -> datasets.Dataset:
    """Move an evaluation split's window metadata out of its rows into ``data.meta``; rows keep a
    ``feature_index`` into it."""
    ids = _column(ds, "id") if "id" in ds.column_names else [str(i) for i in range(len(ds))]
    contexts = _column(ds, columns.context)
    data.examples[name] = [
        QAExample(str(ids[i]), "" if _is_missing(contexts[i]) else str(contexts[i]), answers[i][0])
        for i in range(len(ds))
    ]
    first = len(data.meta)
    columns_ = [_column(features, c) for c in ("example", "offsets", "cls_index")]
    for example, offsets, cls_index in zip(*columns_, strict=True):
        data.meta.append(FeatureMeta(example, np.asarray(offsets, dtype=np.int64).reshape(-1, 2), cls_index))
    data.windows_of[name] = range(first, len(data.meta))
    features = features.remove_columns(["example", "offsets", "cls_index"])
    return features.add_column(FEATURE_INDEX, list(range(first, len(data.meta))))


class QACollator:
    """Pads windows to the batch's longest on the tokenizer's padding side; the labelled token positions move
    with left padding. A class (not a closure) so loader workers can pickle it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        import torch

        inputs = [{k: v for k, v in f.items() if k in MODEL_KEYS} for f in features]
        padded = self.tokenizer.pad(inputs, padding="longest", return_tensors="pt")
        batch = {k: torch.as_tensor(v).to(torch.int64) for k, v in padded.items()}
        width = batch["input_ids"].shape[1]
        shift = [width - len(f["input_ids"]) if self.tokenizer.padding_side == "left" else 0 for f in features]
        for key in (*POSITION_KEYS, FEATURE_INDEX):
            if features and key in features[0]:
                values = [f[key] + (s if key in POSITION_KEYS else 0) for f, s in zip(features, shift, strict=True)]
                batch[key] = torch.as_tensor(values, dtype=torch.int64)
        return batch


# --------------------------------------------------------------------------------------------------
# Post-processing: logits to answers
# --------------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    score: float
    start_logit: float
    end_logit: float
    text: str
    null: bool = False


def _window_candidates(
    start_logits: np.ndarray, end_logits: np.ndarray, offsets: np.ndarray, context: str, n_best: int, max_len: int
) -> list[_Candidate]:
    """The valid spans among the window's ``n_best`` best starts and ends (starts outer, ends inner, both by
    falling logit): inside the context, end not before start, at most ``max_len`` tokens."""
    starts = np.argsort(start_logits)[-1 : -n_best - 1 : -1]
    ends = np.argsort(end_logits)[-1 : -n_best - 1 : -1]
    s, e = np.meshgrid(starts, ends, indexing="ij")
    s, e = s.ravel(), e.ravel()
    valid = (offsets[s, 0] >= 0) & (offsets[e, 0] >= 0) & (e >= s) & (e - s + 1 <= max_len)
    return [
        _Candidate(
            float(start_logits[a] + end_logits[b]),
            float(start_logits[a]),
            float(end_logits[b]),
            context[offsets[a, 0] : offsets[b, 1]],
        )
        for a, b in zip(s[valid], e[valid], strict=True)
    ]


def postprocess_predictions(
    examples: Sequence[QAExample],
    meta: Sequence[FeatureMeta],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[list[str], list[float | None]]:
    """The predicted answer text of every example (``""``: no answer) and, under SQuAD v2, its null score
    minus the best span's score (None otherwise).

    ``meta[i]``, ``start_logits[i]``, ``end_logits[i]``: window ``i`` (logits over its own tokens). As in
    ``run_qa``'s ``postprocess_qa_predictions``: an example's candidates are the valid spans among each of its
    windows' ``n_best_size`` best start and end logits, scored by start + end logit; its null score is the
    lowest CLS start + end logit over its windows. v1 answers the best span (or "empty" when no window has
    one); v2 answers "" when the null score exceeds the best span's score by more than
    ``null_score_diff_threshold``, else that span's text."""
    windows: list[list[int]] = [[] for _ in examples]
    for i, feature in enumerate(meta):
        windows[feature.example].append(i)
    texts: list[str] = []
    diffs: list[float | None] = []
    for example, indices in zip(examples, windows, strict=True):
        candidates: list[_Candidate] = []
        null: _Candidate | None = None
        for i in indices:
            starts, ends, feature = start_logits[i], end_logits[i], meta[i]
            c = feature.cls_index
            score = float(starts[c] + ends[c])
            if null is None or score < null.score:
                null = _Candidate(score, float(starts[c]), float(ends[c]), "", null=True)
            candidates += _window_candidates(
                starts, ends, feature.offsets, example.context, n_best_size, max_answer_length
            )
        if version_2_with_negative and null is not None:
            candidates.append(null)
        best = sorted(candidates, key=lambda x: x.score, reverse=True)[:n_best_size]  # stable: ties keep order
        if version_2_with_negative and null is not None and not any(x.null for x in best):
            best.append(null)
        if not best or (len(best) == 1 and best[0].text == ""):
            best.insert(0, _Candidate(0.0, 0.0, 0.0, "empty"))  # run_qa's stand-in when nothing is valid
        if not version_2_with_negative:
            texts.append(best[0].text)
            diffs.append(None)
            continue
        span = next(x for x in best if x.text != "")
        diff = (null.score if null is not None else 0.0) - span.start_logit - span.end_logit
        diffs.append(diff)
        texts.append("" if diff > null_score_diff_threshold else span.text)
    return texts, diffs
