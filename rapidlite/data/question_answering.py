"""Extractive question answering data (SQuAD v1/v2 style) for ``--task question_answering``.

The steps, each usable on its own, follow Hugging Face's ``run_qa.py`` example:

* rows (``rapidlite.data.question_answering_rows``): a question, a context and its answers, read from the
  layouts people have and checked against the context.
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rapidlite.data.question_answering_rows import (
    ANSWER_START,
    ANSWER_TEXT,
    SPLIT_ORDER,
    QAColumns,
    QAExample,
    _column,
    _is_missing,
    _row_name,
    check_answers,
    detect_columns,
)
from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets
    import torch

MODEL_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
POSITION_KEYS: tuple[str, ...] = ("start_positions", "end_positions")
FEATURE_INDEX = "feature_index"


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
