"""Task metrics, computed as the community computes them (GLUE's accuracy, F1 and correlations as torchmetrics and
scipy compute them; seqeval's rules for tagging; SQuAD's official scoring), on predictions gathered from every
rank. They are written out here, a few lines each and tested equal to those libraries, because importing
torchmetrics costs every evaluating process about 2.5 s of CPU (its package imports its audio, text and plotting
modules, scipy.signal, transformers and matplotlib); only seq2seq's BLEU and ROUGE still import it."""

from __future__ import annotations

import re
import string
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch


def classification_metrics(logits_argmax: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (of the positive class for two labels; for more, the macro average over the classes that
    occur in either the labels or the predictions), as torchmetrics' ``multiclass_accuracy`` (micro),
    ``binary_f1_score`` and ``multiclass_f1_score(average="macro")`` compute them (tested equal). A zero
    denominator scores 0. No rows: NaN."""
    preds, target = logits_argmax.cpu().long(), labels.cpu().long()
    if target.numel() == 0:
        return {"accuracy": float("nan"), "f1": float("nan")}
    accuracy = float((preds == target).double().mean())
    classes = torch.arange(max(num_labels, 2))
    predicted, actual = preds[:, None] == classes, target[:, None] == classes  # [rows, classes]
    tp = (predicted & actual).sum(0).double()
    fp, fn = (predicted & ~actual).sum(0).double(), (~predicted & actual).sum(0).double()
    denominator = 2 * tp + fp + fn
    f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))
    if num_labels == 2:
        return {"accuracy": accuracy, "f1": float(f1[1])}
    occurring = denominator > 0
    return {"accuracy": accuracy, "f1": float(f1[occurring].mean())}


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of ``x``, tied values sharing the mean of their ranks (scipy's ``rankdata``)."""
    _, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # the 0-based rank of each distinct value's first occurrence
    return (first + (counts + 1) / 2).double()[inverse]


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    return float((dx * dy).sum() / ((dx * dx).sum().sqrt() * (dy * dy).sum().sqrt()))


def regression_metrics(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Pearson and Spearman correlation (run_glue's STS-B metrics; tested equal to scipy's and torchmetrics')
    and ``loss``, the mean squared error the model trains on. A constant side has no correlation: NaN."""
    if scores.numel() == 0:
        return {"pearson": float("nan"), "spearmanr": float("nan"), "loss": float("nan")}
    preds, target = scores.double().cpu(), labels.double().cpu()
    correlated = preds.numel() > 1 and bool(preds.std() > 0) and bool(target.std() > 0)
    return {
        "pearson": _pearson(preds, target) if correlated else float("nan"),
        "spearmanr": _pearson(_average_ranks(preds), _average_ranks(target)) if correlated else float("nan"),
        "loss": float(((preds - target) ** 2).mean()),
    }


def multiple_choice_accuracy(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of questions whose highest-scored choice is the labelled one (run_swag's accuracy)."""
    if labels.numel() == 0:
        return float("nan")
    return float((preds.cpu().long() == labels.cpu().long()).double().mean())


# ------------------------------------------------------------------------------------------------ tagging
# Entity-level scores as seqeval computes them by default (conlleval-compatible chunking, what run_ner and the
# `evaluate` seqeval metric report), written out here so scoring a tagger does not pull scikit-learn and scipy.
# A tag is 'O' or PREFIX-TYPE: its first character is the prefix (B, I, E, S), the rest after '-' the type.
ENTITY_PREFIXES = ("B-", "I-", "E-", "S-")


def _split_tag(tag: str) -> tuple[str, str]:
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _chunk_ends(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Whether an entity ended between the previous word and this one (seqeval's ``end_of_chunk``)."""
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _chunk_starts(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Whether an entity starts at this word (seqeval's ``start_of_chunk``): an I- or E- after O starts one,
    as does any change of type."""
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities of one sentence's tags as ``(type, first word, last word)``, by seqeval's default rules:
    ``entities(["B-PER", "I-PER", "O", "I-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3)]``."""
    found = []
    prev_tag, prev_type, begin = "O", "", 0
    for i, tag_string in enumerate([*tags, "O"]):
        tag, type_ = _split_tag(tag_string)
        if _chunk_ends(prev_tag, tag, prev_type, type_):
            found.append((prev_type, begin, i - 1))
        if _chunk_starts(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return found


def is_entity_tagset(names: Sequence[str]) -> bool:
    """Whether tags ``names`` mark entities (every one 'O' or B-/I-/E-/S- and a type: IOB1, IOB2, IOBES), so
    entity scores mean something; POS tags and bare class names do not."""
    return any(n != "O" for n in names) and all(n == "O" or (len(n) > 2 and n[:2] in ENTITY_PREFIXES) for n in names)


def _prf(tp: int, pred: int, true: int) -> tuple[float, float, float]:
    # A zero denominator scores 0, as seqeval's default (zero_division="warn") does.
    precision = tp / pred if pred else 0.0
    recall = tp / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def tagging_metrics(
    true: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], entity: bool = True
) -> dict[str, Any]:
    """Scores of predicted word tags against the true ones, sentence by sentence: ``accuracy`` (of word tags)
    and, with ``entity``, entity-level micro ``precision``/``recall``/``f1`` and per entity type
    ``TYPE_precision``/``TYPE_recall``/``TYPE_f1``/``TYPE_number`` (true entities) for every type that occurs in
    either: the numbers of seqeval's ``accuracy_score``, ``precision_score``/``recall_score``/``f1_score`` and
    ``classification_report`` (the names of run_ner's results)."""
    if len(true) != len(pred) or any(len(t) != len(p) for t, p in zip(true, pred, strict=True)):
        raise ValueError("true and predicted tags differ in shape")
    words = sum(len(t) for t in true)
    correct = sum(a == b for t, p in zip(true, pred, strict=True) for a, b in zip(t, p, strict=True))
    accuracy = correct / words if words else 0.0
    if not entity:
        return {"accuracy": accuracy}
    true_by_type: dict[str, set] = defaultdict(set)
    pred_by_type: dict[str, set] = defaultdict(set)
    for index, (t, p) in enumerate(zip(true, pred, strict=True)):
        for type_, first, last in entities(t):
            true_by_type[type_].add((index, first, last))
        for type_, first, last in entities(p):
            pred_by_type[type_].add((index, first, last))
    counts = {
        type_: (len(true_by_type[type_] & pred_by_type[type_]), len(pred_by_type[type_]), len(true_by_type[type_]))
        for type_ in sorted(true_by_type.keys() | pred_by_type.keys())
    }
    tp, predicted, actual = (sum(c[i] for c in counts.values()) for i in range(3))
    precision, recall, f1 = _prf(tp, predicted, actual)
    out: dict[str, Any] = {"precision": precision, "recall": recall, "f1": f1, "accuracy": accuracy}
    for type_, (tp_t, pred_t, true_t) in counts.items():
        p_t, r_t, f_t = _prf(tp_t, pred_t, true_t)
        out.update({f"{type_}_precision": p_t, f"{type_}_recall": r_t, f"{type_}_f1": f_t, f"{type_}_number": true_t})
    return out


# ------------------------------------------------------------------------------------------------ SQuAD
# The official evaluation scripts' scoring (evaluate-v1.1.py, evaluate-v2.0.py), which Hugging Face's
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


class MeanMetrics:
    """Means by name accumulated over batches, micro-batches and ranks: ``add`` a sum and its count (tensors
    stay on their device, so a step adds no host sync); ``reduce`` sums every name's sum and count over the
    ranks in one reduction (names in sorted order, the same on every rank) and gives the means."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.differences: dict[str, tuple[str, str]] = {}  # kept across clear(): a name and what it is

    def difference(self, name: str, a: str, b: str) -> None:
        """Report ``name`` as the mean of ``a`` minus the mean of ``b`` (when both have items)."""
        self.differences[name] = (a, b)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        total = torch.as_tensor(total).detach().double().sum()
        count = torch.as_tensor(count).detach().double().sum()
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.counts[name] = self.counts[name] + count if name in self.counts else count

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """Each element of ``values`` is one item of the mean."""
        self.add(name, values.sum(), values.numel())

    def __bool__(self) -> bool:
        return bool(self.sums)

    def vector(self) -> torch.Tensor:
        """Sums then counts, names sorted, on the CPU in float64: what ``means`` reads back after a reduction."""
        names = sorted(self.sums)
        return torch.stack([self.sums[n].cpu() for n in names] + [self.counts[n].cpu() for n in names])

    def means(self, reduced: torch.Tensor) -> dict[str, float]:
        names = sorted(self.sums)
        sums, counts = reduced[: len(names)].tolist(), reduced[len(names) :].tolist()
        out = {n: s / c for n, s, c in zip(names, sums, counts, strict=True) if c > 0}
        for name, (a, b) in self.differences.items():
            if a in out and b in out:
                out[name] = out[a] - out[b]
        return out

    def reduce(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The means over every rank (a collective: every rank calls it with the same names), then cleared."""
        if not self.sums:
            return {}
        out = self.means(all_reduce_sum(self.vector()))
        self.clear()
        return out

    def clear(self) -> None:
        self.sums.clear()
        self.counts.clear()
