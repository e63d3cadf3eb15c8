"""Task metrics, computed as the community computes them (torchmetrics), on predictions gathered from every rank."""

from __future__ import annotations

import torch
from torchmetrics.functional.classification import binary_f1_score, multiclass_accuracy, multiclass_f1_score


def classification_metrics(logits_argmax: torch.Tensor, labels: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Accuracy and F1 (positive class for two labels, macro average for more), from torchmetrics."""
    preds, target = logits_argmax.cpu(), labels.cpu()
    if num_labels == 2:
        f1 = binary_f1_score(preds, target)
    else:
        f1 = multiclass_f1_score(preds, target, num_classes=num_labels, average="macro")
    accuracy = multiclass_accuracy(preds, target, num_classes=max(num_labels, 2), average="micro")
    return {"accuracy": float(accuracy), "f1": float(f1)}


def multiple_choice_accuracy(preds: torch.Tensor, labels: torch.Tensor, num_choices: int) -> float:
    """The share of questions whose highest-scored choice is the labelled one (torchmetrics' micro accuracy)."""
    if labels.numel() == 0:
        return float("nan")
    accuracy = multiclass_accuracy(preds.cpu(), labels.cpu(), num_classes=max(num_choices, 2), average="micro")
    return float(accuracy)
