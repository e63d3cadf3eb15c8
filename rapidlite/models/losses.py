"""What a forward step returns and the loss contexts tensor parallelism needs: below models, parallelism and
the trainer, so each of them can use these without importing another.

``unpack_loss`` reads a forward step's result (a mean loss, or ``(loss_sum, num_items)``). ``maybe_loss_parallel``
computes a cross-entropy on vocabulary-sharded logits (DTensors) with PyTorch's ``loss_parallel``;
``loss_parallel_context`` is that context, re-entrant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rapidlite.errors import RapidliteError


class ForwardStepError(RapidliteError):
    """A forward step returned something that is neither a loss nor ``(loss_sum, num_items)``."""


def unpack_loss(output: Any) -> tuple[torch.Tensor, int | None]:
    """A forward step's result: ``loss`` (mean) or ``(loss_sum, num_items)``; HF outputs and dicts give their
    ``loss``, and Megatron's ``(loss, {"lm loss": ...})`` its loss. Anything else is a ``ForwardStepError``."""
    if isinstance(output, (tuple, list)):
        if len(output) == 2 and not isinstance(output[1], dict):
            loss, items = output
            return _as_loss(loss, "the first element of the pair"), _as_count(items)
        if len(output) == 2:
            return _as_loss(output[0], "the first element of the pair"), None
        raise ForwardStepError(
            f"run_forward_step returned a {type(output).__name__} of {len(output)} elements: return the loss alone "
            "(e.g. model(**batch).loss, or the first element of a model called with return_dict=False), or a pair "
            "(loss_sum, num_items)"
        )
    if isinstance(output, torch.Tensor):
        return output, None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, None
    got = type(output).__name__
    if loss is None and (isinstance(output, dict) or hasattr(output, "loss")):
        got = f"{got} without a loss (were labels passed to the model?)"
    raise ForwardStepError(
        f"run_forward_step must return a scalar loss tensor or a pair (loss_sum, num_items), got {got}"
    )


def _as_loss(loss: Any, where: str) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):
        return loss
    raise ForwardStepError(
        f"run_forward_step returned a pair whose loss ({where}) is a {type(loss).__name__}, not a tensor: return "
        "the loss tensor (a mean), or (loss_sum, num_items)"
    )


def _as_count(items: Any) -> int:
    """The ``num_items`` of ``(loss_sum, num_items)``: a count, as an int or a one-element tensor."""
    if isinstance(items, torch.Tensor) and items.numel() != 1:
        raise ForwardStepError(
            f"run_forward_step returned a pair whose second element is a tensor of shape {list(items.shape)}, "
            "not a count: return the loss alone (e.g. outputs.loss, not (loss, logits)), or (loss_sum, num_items) "
            "with num_items the number of items the loss sums over"
        )
    try:
        count = float(items)
    except (TypeError, ValueError):
        raise ForwardStepError(
            f"run_forward_step returned a pair whose second element is a {type(items).__name__}, not a count: "
            "return the loss alone, or (loss_sum, num_items) with num_items the number of items the loss sums over"
        ) from None
    if count != count or count < 0 or count != int(count):
        raise ForwardStepError(
            f"run_forward_step returned num_items={count:g}: (loss_sum, num_items) needs a whole, non-negative "
            "number of items (e.g. (labels != -100).sum())"
        )
    return int(count)


_loss_parallel_depth = 0


@contextlib.contextmanager
def loss_parallel_context() -> Iterator[None]:
    """``loss_parallel``, re-entrant: PyTorch's switches the parallel cross-entropy off on any exit, so a
    nested use (the forward's inside a pipeline step's backward) would leave the backward without it."""
    global _loss_parallel_depth
    if _loss_parallel_depth:
        _loss_parallel_depth += 1
        try:
            yield
        finally:
            _loss_parallel_depth -= 1
        return
    from torch.distributed.tensor.parallel import loss_parallel

    _loss_parallel_depth = 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_depth = 0


@contextlib.contextmanager
def maybe_loss_parallel(logits: torch.Tensor) -> Iterator[None]:
    """``loss_parallel`` when the logits are vocabulary-sharded DTensors (forward and backward need it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        with loss_parallel_context():
            yield
    else:
        yield
