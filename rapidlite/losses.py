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


def unpack_loss(output: Any) -> tuple[torch.Tensor, int | None]:
    """A forward step's result: ``loss`` (mean) or ``(loss_sum, num_items)``; HF outputs give ``.loss``."""
    if isinstance(output, (tuple, list)) and len(output) == 2:
        loss, items = output
        return loss, int(items)
    if isinstance(output, torch.Tensor):
        return output, None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, None
    raise TypeError(
        "run_forward_step must return a scalar loss tensor or a pair (loss_sum, num_items), "
        f"got {type(output).__name__}"
    )


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
