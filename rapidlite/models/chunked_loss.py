"""A linear output layer and its cross-entropy, a chunk of tokens at a time: the ``[tokens x vocab]`` logits and
their gradient never exist whole.

``token_logps(hidden, weight, bias, targets)`` is ``log_softmax(hidden @ weight.T + bias)[target]`` per token
(0 where the target is ``IGNORE``). Only rows with a target are projected (a masked-LM batch projects its 15%,
a fine-tuning batch its response tokens), ``chunk`` of them at a time, the logits made fp32 as the plain path
makes them. Two ways through the backward pass:

- ``sum_only=True`` (a cross-entropy summed over tokens, whose gradient is one number): the gradients of
  ``hidden``, ``weight`` and ``bias`` are computed in the forward pass, chunk by chunk, as Liger's fused linear
  cross-entropy does, and the backward only scales them. No extra FLOPs; the result is the sum alone;
- otherwise (per-token log-probabilities that a loss combines, DPO's): the forward keeps each token's
  log-sum-exp, and the backward recomputes each chunk's logits (one more head matmul).

With ``group`` the weight and bias are this rank's vocabulary shard (tensor parallelism; its first row is
``vocab_offset``): the maximum, the exponent sums and the target logits are all-reduced
over ``group``, and so is the gradient of ``hidden``.

A sum on a GPU with ``liger-kernel`` installed goes through Liger's Triton kernel instead (``gpu_kernel``).

``token_stats`` gives, without gradient and the same chunk at a time, each scored token's entropy of the
next-token distribution and its mean logit (KTO's metrics), all-reduced over ``group`` as the log-probabilities.

Numbers: fp32 results equal the plain ``F.cross_entropy(hidden @ weight.T + bias)`` within 1e-6 relative.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist

IGNORE = -100
# The fewest tokens a chunk holds: each chunk reads the whole weight three times (logits, d hidden, d weight),
# so short chunks are bound by memory traffic. Measured on a CPU (1023 tokens, hidden 512, vocabulary 128k,
# forward and backward against the whole logits' 3.1 s): 32 rows 5.9 s, 128 rows 3.5 s, 256 rows 3.1 s.
# Tags on the tensors _Planned saves for --dry-run's count (rapidlite.planning.activations).
PASSING = "_rapidlite_passing"
FORWARD_GRAD = "_rapidlite_forward_grad"
MIN_CHUNK_ROWS = 256
# --dry-run's profile scores this share of the rows (``planned_share``): its meta targets carry no values to count.
_PLANNED_SHARE: ContextVar[float] = ContextVar("planned_share", default=1.0)


@contextlib.contextmanager
def planned_share(share: float) -> Iterator[None]:
    """Within it, a meta profile's loss scores ``share`` of its rows, as the run's targets will (a masked LM's
    ``--mlm-probability``); 1 outside."""
    token = _PLANNED_SHARE.set(share)
    try:
        yield
    finally:
        _PLANNED_SHARE.reset(token)


def chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits as many elements as the whole hidden input (Liger's rule), but at
    least ``MIN_CHUNK_ROWS`` tokens, and at most all ``rows``."""
    return max(min(rows, max(-(-rows * hidden // vocab), MIN_CHUNK_ROWS)), 1)


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk: int | None = None,
    group: Any = None,
    vocab_offset: int = 0,
    vocab: int | None = None,
    sum_only: bool = False,
) -> torch.Tensor:
    """Per-token log-probabilities of ``targets`` (``[...]``, any shape) under ``hidden @ weight.T + bias``
    (``hidden``: ``[..., H]``), 0 at ``IGNORE``; with ``sum_only`` their sum (a 0-d tensor) instead. With
    ``group``, ``weight`` holds rows ``vocab_offset...`` of a ``vocab``-row output layer split over it."""
    shape = targets.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows for {targets.shape[0]} targets")
    if hidden.device.type == "meta":  # --dry-run's profile: what the real path keeps, for the rows it scores
        n = hidden.shape[0]
        scored = max(1, min(n, math.ceil(n * _PLANNED_SHARE.get())))
        chunk = chunk or chunk_rows(scored, hidden.shape[1], vocab or weight.shape[0])
        out = _Planned.apply(hidden[:scored], weight, chunk, sum_only)
        return out if sum_only else torch.nn.functional.pad(out, (0, n - scored)).reshape(shape)
    rows = (targets != IGNORE).nonzero().squeeze(1)
    picked_targets = targets.index_select(0, rows)
    vocab = vocab or weight.shape[0]
    if rows.numel() and not 0 <= int(picked_targets.min()) <= int(picked_targets.max()) < vocab:
        raise IndexError(f"a target id is outside the {vocab}-token vocabulary of the output layer")
    chunk = chunk or chunk_rows(rows.numel(), hidden.shape[1], vocab)
    picked = hidden.index_select(0, rows)  # differentiable: the ignored rows get a zero gradient
    kernel = gpu_kernel(picked) if sum_only and group is None else None
    if kernel is not None:
        return -kernel(weight, picked, picked_targets, bias)
    if sum_only:
        return _LogpSum.apply(picked, weight, bias, picked_targets - vocab_offset, chunk, group)
    logps = _TokenLogps.apply(picked, weight, bias, picked_targets - vocab_offset, chunk, group)
    out = logps.new_zeros(targets.shape[0]).index_copy(0, rows, logps)
    return out.reshape(shape)


@torch.no_grad()
def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk: int | None = None,
    group: Any = None,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, mean_logit)``, each shaped like ``targets``: at each token with a target (0 elsewhere), the
    entropy of ``softmax(hidden @ weight.T + bias)`` and the mean of those logits over the vocabulary, in fp32
    (no gradient). With ``group``, ``weight`` is this rank's shard of a ``vocab``-row output layer."""
    shape = targets.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = (targets.reshape(-1) != IGNORE).nonzero().squeeze(1)
    vocab = vocab or weight.shape[0]
    picked = hidden.index_select(0, rows)
    chunk = chunk or chunk_rows(rows.numel(), hidden.shape[1], vocab)
    entropy = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
    mean = torch.empty_like(entropy)
    for s in _chunks(rows.numel(), chunk):
        z = _logits(picked[s], weight, bias)
        total = z.sum(dim=1)
        if group is None:
            logp = z.log_softmax(dim=1)  # as the whole logits' path computes it (logits_stats)
        else:
            top = z.max(dim=1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            shifted = z.sub_(top.unsqueeze(1))
            sums = shifted.exp().sum(dim=1)
            dist.all_reduce(sums, group=group)
            logp = shifted.sub_(sums.log().unsqueeze(1))  # this shard's log-softmax, in place of its logits
        both = torch.stack([-(logp.exp() * logp).sum(dim=1), total])
        if group is not None:
            dist.all_reduce(both, group=group)
        entropy[s], mean[s] = both[0], both[1] / vocab
    n = targets.numel()
    out = [hidden.new_zeros(n, dtype=torch.float32).index_copy_(0, rows, v).reshape(shape) for v in (entropy, mean)]
    return out[0], out[1]


def gpu_kernel(hidden: torch.Tensor) -> Any:
    """A fused kernel for the summed loss where ``hidden`` is on a GPU and one is installed (``installed_kernel``;
    Triton kernels: CUDA only), else None (the PyTorch path here)."""
    return installed_kernel() if hidden.device.type == "cuda" else None


def installed_kernel() -> Any:
    """``(weight, hidden, targets, bias) -> summed cross-entropy``: Liger's fused linear cross-entropy, else Cut
    Cross-Entropy in its exact variant (``cce_exact``: no filtering of small gradients, fp32 accumulation, so
    the numbers are the plain path's); None when neither is installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None

    def cut_cross_entropy(weight, hidden, targets, bias):
        return linear_cross_entropy(
            hidden, weight, targets, bias=bias, ignore_index=IGNORE, reduction="sum", impl="cce_exact"
        )

    return cut_cross_entropy


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in the weight's precision, made fp32 (as ``logits.float()`` does)."""
    z = h @ weight.t()
    if bias is not None:
        z.add_(bias)
    return z.float()


def _lse_and_target(
    z: torch.Tensor, local_targets: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log-sum-exp over the whole vocabulary, the target's logit, the sum of exponents)`` of one chunk's
    (local) fp32 logits, which become ``exp(z - max)`` in place: no second chunk-sized buffer."""
    inside = (local_targets >= 0) & (local_targets < z.shape[1])
    target = z.gather(1, local_targets.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1) * inside
    top = z.max(dim=1).values
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = z.sub_(top.unsqueeze(1)).exp_().sum(dim=1)
    if group is not None:
        both = torch.stack([sums, target])
        dist.all_reduce(both, group=group)
        sums, target = both[0], both[1]
    return top + sums.log(), target, sums


def _grad_logits(
    exps: torch.Tensor, local_targets: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor | None = None
) -> torch.Tensor:
    """``scale * d logp / d z`` for one chunk, ``scale * (onehot - exps / sums)`` (``sums`` None: ``exps`` is the
    softmax), in place of ``exps`` and in one pass over it."""
    factor = -scale if sums is None else -scale / sums
    grad = exps.mul_(factor.unsqueeze(1))
    inside = (local_targets >= 0) & (local_targets < grad.shape[1])
    rows = inside.nonzero().squeeze(1)
    grad[rows, local_targets[rows]] += scale[rows]
    return grad


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield slice(start, min(start + chunk, n))


def _backward_chunk(h: torch.Tensor, weight: torch.Tensor, grad_z: torch.Tensor, grads: tuple, s: slice) -> None:
    """Add one chunk's part to the gradients of hidden (its rows ``s``), weight and bias. As in the plain path,
    the fp32 logit gradient is cast to the weight's precision for the two matmuls (the weight's gradient
    accumulates over chunks in that precision, as Liger's does)."""
    grad_h, grad_w, grad_b = grads
    g = grad_z.to(weight.dtype)
    if grad_h is not None:
        grad_h[s] = g @ weight
    if grad_w is not None and s.start == 0:  # the first chunk writes it: no zeroing pass over the vocabulary
        torch.mm(g.t(), h, out=grad_w)
    elif grad_w is not None:
        grad_w.addmm_(g.t(), h)
    if grad_b is not None:
        grad_b.add_(grad_z.sum(0))


def _new_grads(needs: tuple, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    need_h, need_w, need_b = needs[:3]
    new_w = torch.empty_like if h.shape[0] else torch.zeros_like  # written by the first chunk (_backward_chunk)
    return (
        torch.empty_like(h) if need_h else None,
        new_w(weight) if need_w else None,
        torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None,
    )


def _finish_grads(grads: tuple, bias: torch.Tensor | None, group: Any) -> tuple:
    grad_h, grad_w, grad_b = grads
    if grad_h is not None and group is not None:
        dist.all_reduce(grad_h, group=group)  # each vocabulary shard's part of d hidden
    return grad_h, grad_w, grad_b.to(bias.dtype) if grad_b is not None else None


class _TokenLogps(torch.autograd.Function):
    """Per-token log-probabilities; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, weight, bias, local, chunk, group):
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse_all = torch.empty_like(out)
        for s in _chunks(h.shape[0], chunk):
            lse, target, _ = _lse_and_target(_logits(h[s], weight, bias), local[s], group)
            out[s], lse_all[s] = target - lse, lse
        ctx.save_for_backward(h, weight, bias, local, lse_all)
        ctx.chunk, ctx.group = chunk, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, bias, local, lse_all = ctx.saved_tensors
        grads = _new_grads(ctx.needs_input_grad, h, weight, bias)
        for s in _chunks(h.shape[0], ctx.chunk):
            softmax = _logits(h[s], weight, bias).sub_(lse_all[s].unsqueeze(1)).exp_()
            grad_z = _grad_logits(softmax, local[s], grad_out[s].float())
            _backward_chunk(h[s], weight, grad_z, grads, s)
        return (*_finish_grads(grads, bias, ctx.group), None, None, None)


class _LogpSum(torch.autograd.Function):
    """The sum of the log-probabilities; its gradients are computed in the forward pass (no recomputation)."""

    @staticmethod
    def forward(ctx, h, weight, bias, local, chunk, group):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grads = _new_grads(ctx.needs_input_grad, h, weight, bias) if any(ctx.needs_input_grad[:3]) else None
        one = torch.ones(1, dtype=torch.float32, device=h.device)
        for s in _chunks(h.shape[0], chunk):
            z = _logits(h[s], weight, bias)
            lse, target, sums = _lse_and_target(z, local[s], group)
            total += (target - lse).sum()
            if grads is not None:
                grad_z = _grad_logits(z, local[s], one.expand(z.shape[0]), sums)
                _backward_chunk(h[s], weight, grad_z, grads, s)
        if grads is not None:
            ctx.grads = _finish_grads(grads, bias, group)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = [g.mul_(grad_total.to(g.dtype)) if g is not None else None for g in ctx.grads]
        del ctx.grads
        return (*grads, None, None, None)


class _Planned(torch.autograd.Function):
    """On meta tensors, for ``--dry-run``'s count of what autograd keeps: the tensors either path holds from
    its forward to its backward (the scored hidden rows, and the gradient of hidden or each row's
    log-sum-exp). Two more are saved tagged for the count (``PASSING``, ``FORWARD_GRAD``): one chunk's logits,
    the largest buffer the forward passes through, and, for the summed path, the weight's gradient it makes in
    its forward (the parameter's gradient, there before the backward pass)."""

    @staticmethod
    def forward(ctx, h, weight, chunk, sum_only):
        passing = h.new_empty(chunk, weight.shape[0], dtype=torch.float32)
        setattr(passing, PASSING, True)
        kept = [h.clone(), passing]
        kept.append(torch.empty_like(h) if sum_only else h.new_empty(h.shape[0], dtype=torch.float32))
        if sum_only and weight.requires_grad:
            grad = weight.new_empty(weight.shape, dtype=torch.float32)
            setattr(grad, FORWARD_GRAD, True)
            kept.append(grad)
        ctx.save_for_backward(*kept)
        ctx.shapes = h.shape, weight.shape
        return h.new_empty(() if sum_only else h.shape[:1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        (h_shape, w_shape) = ctx.shapes
        return grad.new_empty(h_shape), grad.new_empty(w_shape), None, None
