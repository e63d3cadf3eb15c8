"""Task metrics, computed as the community computes them (torchmetrics; SQuAD's official scoring), on predictions
gathered from every rank."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch


def classification_metrics(logits_argmax: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (positive class for two labels, macro average for more), from torchmetrics."""
    # Imported here: torchmetrics takes seconds to import (scipy), which tasks without classification skip.
    from torchmetrics.functional.classification import binary_f1_score, multiclass_accuracy, multiclass_f1_score

    preds, target = logits_argmax.cpu(), labels.cpu()
    if num_labels == 2:
        f1 = binary_f1_score(preds, target)
    else:
        f1 = multiclass_f1_score(preds, target, num_classes=num_labels, average="macro")
    accuracy = multiclass_accuracy(preds, target, num_classes=max(num_labels, 2), average="micro")
    return {"accuracy": float(accuracy), "f1": float(f1)}


# SQuAD: the official evaluation scripts' scoring (evaluate-v1.1.py, evaluate-v2.0.py), which Hugging Face's
# squad and squad_v2 metrics wrap. torchmetrics' SQuAD differs from v1.1 where an answer normalises to nothing
# ("The"): it scores F1 1 for two empty answers as v2.0 does, v1.1 scores 0.


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _exact(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _f1(prediction: str, gold: str, empty_agrees: bool) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if empty_agrees and (not pred or not ref):  # v2.0: a no-answer scores 1 against a no-answer, else 0
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_v1_metrics(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """``exact_match`` and ``f1`` (0-100) of predicted answer texts against each question's gold answers, the
    best over them, as SQuAD v1.1's official script computes them."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} questions")
    if not references:
        return {"exact_match": 0.0, "f1": 0.0}
    exact = sum(max(_exact(p, g) for g in golds) for p, golds in zip(predictions, references, strict=True))
    f1 = sum(max(_f1(p, g, False) for g in golds) for p, golds in zip(predictions, references, strict=True))
    return {"exact_match": 100.0 * exact / len(references), "f1": 100.0 * f1 / len(references)}


def squad_v2_metrics(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """SQuAD v2.0's official scores (0-100) of predicted texts (``""``: no answer) against each question's gold
    answers (none: unanswerable): ``exact``, ``f1`` and ``total`` over all questions, and the same over the
    answerable (``HasAns_*``) and the unanswerable (``NoAns_*``) ones where there are any. Gold answers that
    normalise to nothing are dropped, and a question left with none is answered correctly by "" only."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} questions")
    exact, f1, has_answer = [], [], []
    for prediction, golds in zip(predictions, references, strict=True):
        kept = [g for g in golds if normalize_answer(g)] or [""]
        exact.append(max(_exact(prediction, g) for g in kept))
        f1.append(max(_f1(prediction, g, True) for g in kept))
        has_answer.append(bool(golds))
    out: dict[str, float] = {}
    for prefix, keep in (("", None), ("HasAns_", True), ("NoAns_", False)):
        chosen = [i for i in range(len(references)) if keep is None or has_answer[i] == keep]
        if keep is not None and not chosen:
            continue
        total = len(chosen)
        out[f"{prefix}exact"] = 100.0 * sum(exact[i] for i in chosen) / total if total else 0.0
        out[f"{prefix}f1"] = 100.0 * sum(f1[i] for i in chosen) / total if total else 0.0
        out[f"{prefix}total"] = total
    return out
