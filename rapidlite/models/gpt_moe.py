"""The built-in GPT's mixture-of-experts MLP (``--num-experts``), Megatron's design in Mixtral's layout.

    router    logits = x W_r^T [tokens, experts]; each token's top-k experts by softmax probability (plus the
              expert bias, for the choice only, with --moe-router-enable-expert-bias); their probabilities,
              renormalised over the k, weigh the experts' outputs
    experts   SwiGLU (``gate_up_proj`` [E, 2f, h], gate rows first) or GELU (``up_proj`` [E, f, h]) MLPs, and
              ``down_proj`` [E, h, f]: transformers 5's 3-D expert tensors, so the model exports as Mixtral
    shared    optionally a dense MLP every token goes through as well (--moe-shared-expert-intermediate-size)

Softmax over the top-k logits (Megatron's default) equals renormalising the top-k of the full softmax
(Mixtral's): the export computes the same. The router returns ``(logits, weights, chosen experts)`` as
transformers' routers do, so ``rapidlite.models.moe.RouterLoss`` adds the load-balancing loss and counts the
load for this model as for the Hugging Face families.

With ``--moe-expert-capacity-factor C`` each expert takes at most ``ceil(C x tokens x k / experts)`` of a training
forward's (token, choice) pairs, Megatron's capacity: the pairs over it are dropped (``--moe-token-drop-policy``:
those of lowest routing probability, or the latest in the batch), their experts' outputs left out and the others'
weights kept as they were, so a token that lost every choice passes through the residual alone. Without it
(Megatron's default) no token is dropped. Evaluation, generation and the export are dropless: a capacity bounds a
training step's work, and the exported model computes what evaluation does.

The tokens are sorted by expert and each expert's rows multiplied together: with ``--moe-grouped-gemm`` all
experts in one ``torch._grouped_mm`` where it runs (a device and dtype where a probe of it works, and sizes
whose rows are 16-byte aligned), else one matmul per expert. The two are the same arithmetic.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidlite.observe.logging import LOGGER_NAME


class Router(nn.Module):
    """``weight`` [experts, hidden]; ``expert_bias`` [experts] (a buffer: moved by the trainer, not by
    gradients) when the load is balanced without a loss."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_bias: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32) if expert_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden] → logits [tokens, experts], weights [tokens, k] (fp32), chosen [tokens, k]."""
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        probs = logits.float().softmax(-1)
        scores = probs if self.expert_bias is None else probs + self.expert_bias
        chosen = scores.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        return logits, weights / weights.sum(-1, keepdim=True), chosen


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device type and dtype (a small probe,
    once per process). The probe is the first forward's, which may be under ``no_grad`` (evaluation) or inside
    activation checkpointing: it runs with gradients on and its saved tensors apart, or the checkpoint would count
    them in the forward and not in the recomputation."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    apart = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        with torch.inference_mode(False), torch.enable_grad(), apart:
            x = torch.randn(8, 16, device=device_type, dtype=dtype, requires_grad=True)
            w = torch.randn(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
            torch._grouped_mm(x, w, offs=offsets).backward(torch.ones(8, 16, device=device_type, dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an expert-parallel weight (a DTensor), else the weight."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _aligned(*tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm``'s rule: every row of every operand starts on a 16-byte boundary."""
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


class Experts(nn.Module):
    """``num_experts`` MLPs in 3-D tensors (see the module docstring). ``forward(rows, counts)``: ``rows``
    sorted by expert, ``counts[e]`` of them for expert ``e``. Under expert parallelism the tensors hold this
    rank's experts (DTensor shards) and ``dispatch`` (``parallel.expert_parallel.Dispatch``) sends the rows to
    their experts' ranks and back."""

    dispatch: Any = None

    def __init__(self, hidden: int, ffn: int, experts: int, swiglu: bool, grouped: bool) -> None:
        super().__init__()
        self.swiglu, self.grouped, self.num_experts = swiglu, grouped, experts
        inner = 2 * ffn if swiglu else ffn
        if swiglu:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, inner, hidden))
        else:
            self.up_proj = nn.Parameter(torch.empty(experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, ffn))
        self._said = False

    @property
    def first(self) -> nn.Parameter:
        return self.gate_up_proj if self.swiglu else self.up_proj

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.dispatch is not None:
            return self.dispatch(rows, counts, self._local)
        return self._local(rows, counts)

    def _local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's experts (all of them without expert parallelism), grouped by expert."""
        first, down = (_local_tensor(w) for w in (self.first, self.down_proj))
        if (self.grouped or rows.device.type == "meta") and self._grouped_runs(rows, first, down):
            offsets = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(rows, first.transpose(1, 2), offs=offsets)
            return torch._grouped_mm(self._activation(h), down.transpose(1, 2), offs=offsets)
        out = []
        for e, part in enumerate(rows.split(counts.tolist())):
            out.append(F.linear(self._activation(F.linear(part, first[e])), down[e]))
        return torch.cat(out) if out else rows.new_empty(0, down.shape[1])

    def _grouped_runs(self, rows: torch.Tensor, first: torch.Tensor, down: torch.Tensor) -> bool:
        if rows.device.type == "meta":  # the planner's forward: the sizes are the loop's, and no count is read
            return True
        runs = grouped_mm_runs(rows.device.type, rows.dtype)
        if runs and _aligned(rows, first, down):
            return True
        if not self._said:
            self._said = True
            why = f"does not run for {rows.dtype} on {rows.device.type}" if not runs else "needs 16-byte rows"
            logging.getLogger(LOGGER_NAME).warning(
                f"--moe-grouped-gemm: torch._grouped_mm {why}; the experts run one matmul each"
            )
        return False


class SharedExpert(nn.Module):
    """The dense MLP every token goes through beside the routed experts (SwiGLU or GELU, no biases)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False) if swiglu else None
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def within_capacity(chosen: torch.Tensor, weights: torch.Tensor, experts: int, factor: float, policy: str):
    """Which (token, choice) pairs of ``chosen`` [tokens, k] each expert takes, at most
    ``ceil(factor x tokens x k / experts)`` of them: those of highest routing weight (``probs``) or the earliest
    tokens (``position``), ties to the earlier token. A bool [tokens, k]."""
    flat = chosen.reshape(-1)
    capacity = math.ceil(factor * flat.numel() / experts)
    if policy == "probs":
        by_score = weights.reshape(-1).argsort(descending=True, stable=True)
    else:
        by_score = torch.arange(flat.numel(), device=flat.device)
    order = by_score[flat[by_score].argsort(stable=True)]  # grouped by expert, best first within each
    counts = torch.bincount(flat, minlength=experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(chosen)


class MoELayer(nn.Module):
    """A block's MLP as a mixture of experts: ``router``, ``experts`` and optionally ``shared_experts``.
    ``dropped``: the share of (token, choice) pairs the last training forward dropped (with a capacity)."""

    def __init__(self, config) -> None:
        super().__init__()
        h, experts = config.hidden_size, config.num_experts
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy = config.moe_token_drop_policy
        self.dropped: torch.Tensor | None = None
        self.router = Router(h, experts, config.moe_router_topk, config.moe_router_enable_expert_bias)
        self.experts = Experts(h, config.moe_ffn_hidden_size, experts, config.swiglu, config.moe_grouped_gemm)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(h, config.moe_shared_expert_intermediate_size, config.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, chosen = self.router(x)
        k = chosen.shape[-1]
        order = chosen.reshape(-1).argsort(stable=True)  # the (token, choice) pairs grouped by expert
        flat_chosen = chosen.reshape(-1)  # counted by scatter_add, which the planner's meta forward runs too
        # A capacity drops pairs in training; the planner's meta forward plans the dropless (larger) case.
        if self.capacity_factor is not None and self.training and x.device.type != "meta":
            keep = within_capacity(chosen, weights, self.experts.num_experts, self.capacity_factor, self.drop_policy)
            self.dropped = 1 - keep.float().mean()
            order = order[keep.reshape(-1)[order]]
            flat_chosen = flat_chosen[keep.reshape(-1)]
        counts = flat_chosen.new_zeros(self.experts.num_experts).scatter_add_(
            0, flat_chosen, torch.ones_like(flat_chosen)
        )
        token = order // k
        out = self.experts(flat[token], counts) * weights.reshape(-1)[order, None].to(x.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)

    @torch.no_grad()
    def reset_parameters(self, std: float, residual_std: float) -> None:
        """Megatron's init: normal(0, std) router and input projections, std / sqrt(2L) output projections."""
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
        nn.init.normal_(self.experts.first, mean=0.0, std=std)
        nn.init.normal_(self.experts.down_proj, mean=0.0, std=residual_std)
        if self.shared_experts is not None:
            nn.init.normal_(self.shared_experts.down_proj.weight, mean=0.0, std=residual_std)
