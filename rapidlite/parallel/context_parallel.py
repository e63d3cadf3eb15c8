"""Context parallelism: one sequence split over the ``cp`` ranks, the models' attention computed across them.

**The split.** A sequence of ``S`` tokens is cut into ``2N`` chunks (``N`` = the context-parallel size) and rank
``i`` holds chunks ``i`` and ``2N-1-i``, as Megatron and torchtitan do: under a causal mask every rank then has the
same amount of attention to compute (an early chunk with few keys paired with a late one with many).
``shard_indices`` gives a rank's token indices; everything per token (ids, labels already shifted, position ids,
loss masks, document ids) is cut with them (``shard``, ``shard_batch``, ``shard_causal_batch``), so the loss's
token counts and the labels' shift follow the split by construction.

**The attention** (``rapidlite.parallel.cp_attention``): ring attention (``p2p``) or Ulysses (``a2a``), exact over
the whole sequence. ``apply_context_parallel`` routes a model's attention through it: the built-in GPT's
attention modules, and Hugging Face decoders through transformers' ``AttentionInterface``. **Packed documents**
keep their boundaries across ranks: ``segment_ids`` (a document number per token; from restarting position ids
by transformers' own rule, ``rapidlite.models.padding_free.segments``) restrict attention to keys of the same
document, on top of the causal mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rapidlite.errors import ConfigError
from rapidlite.models.padding_free import segments
from rapidlite.parallel.cp_attention import context_parallel_attention, shard_indices


def shard(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor``'s sequence dimension ``dim``."""
    return tensor.index_select(dim, shard_indices(tensor.shape[dim], cp, rank, tensor.device))


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[i]``: rank ``i``'s), in the original order."""
    cp = len(parts)
    joined = torch.cat(parts, dim)
    order = torch.cat([shard_indices(joined.shape[dim], cp, i, joined.device) for i in range(cp)])
    return joined.index_select(dim, torch.argsort(order))


def shard_batch(batch: dict[str, Any], cp: int, rank: int) -> dict[str, Any]:
    """``batch`` with every per-token tensor (``[b, s]``: ids, labels, masks, positions, document numbers) cut
    to rank ``rank``'s shard; other values as they are."""
    length = batch["input_ids"].shape[1]
    return {
        key: shard(value, cp, rank) if torch.is_tensor(value) and value.ndim == 2 and value.shape[1] == length
        else value
        for key, value in batch.items()
    }  # fmt: skip


def shard_causal_batch(
    batch: dict[str, torch.Tensor], cp: int, rank: int, pad_token_id: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A right-padded causal-LM batch (``input_ids``, unshifted ``labels``, and an ``attention_mask`` or, packed,
    restarting ``position_ids``) as rank ``rank``'s model inputs and targets: padded to a multiple of ``2 cp``,
    the labels shifted on the whole sequence (token t scores label t+1), global position ids, and a packed
    batch's samples numbered (``cp_segment_ids``) so attention stays inside each on every rank."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    pad = -length % (2 * cp)
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1 + pad), value=-100)
    packed = "position_ids" in batch
    if packed:  # padding tokens restart at 0: each a sample of its own, as the collator pads them
        positions = torch.nn.functional.pad(batch["position_ids"], (0, pad), value=0)
    else:
        positions = torch.arange(length + pad, device=ids.device).expand(rows, length + pad)
    inputs = {"input_ids": torch.nn.functional.pad(ids, (0, pad), value=pad_token_id), "position_ids": positions}
    if packed:
        inputs["cp_segment_ids"] = segments(positions)
    return {k: shard(v, cp, rank) for k, v in inputs.items()}, shard(targets, cp, rank)


def split_output_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    group: Any,
    chunked: bool,
    stats: bool = False,
    temperature: float = 1.0,
) -> Any:
    """``output_logps(model, inputs, labels, shift=True[, stats, temperature])`` of right-padded (or packed) rows,
    computed on this rank's shard of each and gathered whole ``[rows, length]``: position t scores label t+1. The
    gather's backward sums every rank's gradient of its shard, so a loss every rank of ``group`` computes alike
    from the whole log-probabilities (a preference pair's sums) trains as one process once the replicas'
    averaging (over dp x cp) divides it. ``stats`` (entropy, mean logit: no gradient) are gathered the same way.
    Rows whose ``position_ids`` restart at 0 (packed rows, or left padding: each padding token a document of its
    own) keep attention inside each document."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    from rapidlite.models.head import output_logps

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    batch = {"input_ids": inputs["input_ids"], "labels": labels}
    if "position_ids" in inputs:
        batch["position_ids"] = inputs["position_ids"]
    local, targets = shard_causal_batch(batch, cp, rank, pad_token_id=0)  # padding is never a target
    out = output_logps(
        model,
        {**local, "use_cache": False},
        targets,
        shift=False,
        chunked=chunked,
        stats=stats,
        temperature=temperature,
    )
    per_token, found = out if stats else (out, None)
    gathered_rows = all_gather_tensor_autograd(per_token.contiguous(), gather_dim=0, group=group)  # [cp * rows, .]
    whole = unshard(list(gathered_rows.chunk(cp)))[:, : labels.shape[1]]
    if not stats:
        return whole
    gathered = []
    for values in found:
        parts = [torch.empty_like(values) for _ in range(cp)]
        dist.all_gather(parts, values.contiguous(), group=group)
        gathered.append(unshard(parts)[:, : labels.shape[1]])
    return whole, tuple(gathered)


# ------------------------------------------------------------------------------------------------- the models

HF_ATTENTION = "rapidlite_context_parallel"


@dataclass(frozen=True)
class ContextParallel:
    """The attention of one context-parallel group, as the models call it: ``cp(q, k, v, causal, segment_ids,
    scale)`` on the rank's shard (SDPA's layout, ``[b, heads, s_local, d]``). ``previous_attention``: a Hugging
    Face model's attention implementation before (``whole_sequences`` puts it back for a while)."""

    group: Any
    comm_type: str
    previous_attention: str | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        segment_ids: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.group, self.comm_type, causal, segment_ids, scale)


def apply_context_parallel(model: torch.nn.Module, group: Any, comm_type: str) -> ContextParallel:
    """Route ``model``'s attention through context parallelism over ``group``: the built-in GPT's attention
    modules and a Hugging Face decoder's (through transformers' ``AttentionInterface``) call ``ContextParallel``
    on their shard. A model whose attention neither takes is refused with one line naming it."""
    hf = getattr(model, "config", None) is not None and hasattr(model, "set_attn_implementation")
    cp = ContextParallel(group, comm_type, getattr(model.config, "_attn_implementation", None) if hf else None)
    targets = [m for m in model.modules() if hasattr(m, "context_parallel")]  # the built-in GPT's attention
    if hf:
        targets = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling")]
    if not targets:
        name = type(model).__name__
        raise ConfigError(
            f"--context-parallel-size: {name}'s attention cannot be split over ranks; context parallelism serves "
            "the built-in GPT and Hugging Face decoders whose attention goes through transformers' "
            "AttentionInterface (LLaMA, Mistral, Qwen2, Qwen3)"
        )
    if comm_type == "a2a":
        config = getattr(model, "config", None)
        heads = getattr(targets[0], "num_heads", None) or config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % cp.size or kv_heads % cp.size:
            counts = f"{heads} attention heads" + (f" and {kv_heads} key/value heads" if kv_heads != heads else "")
            raise ConfigError(
                f"--context-parallel-size {cp.size} --cp-comm-type a2a: {counts} are not all divisible by "
                f"{cp.size}; use --cp-comm-type p2p (ring attention takes any head count)"
            )
    for module in targets:
        module.context_parallel = cp
    if hf:
        from transformers import AttentionInterface

        AttentionInterface.register(HF_ATTENTION, hf_attention)
        model.set_attn_implementation(HF_ATTENTION)  # no mask is built for it: the shards' mask is implicit
    return cp


@contextlib.contextmanager
def whole_sequences(model: torch.nn.Module) -> Iterator[None]:
    """Around forwards of whole sequences that every rank of the group runs alike (sampling a rollout): the model's
    attention as it was before ``apply_context_parallel``; nothing to do for a model it was not applied to."""
    targets = [m for m in model.modules() if getattr(m, "context_parallel", None) is not None]
    if not targets:
        yield
        return
    cp = targets[0].context_parallel
    for module in targets:
        module.context_parallel = None
    if cp.previous_attention is not None:
        model.set_attn_implementation(cp.previous_attention)
    try:
        yield
    finally:
        for module in targets:
            module.context_parallel = cp
        if cp.previous_attention is not None:
            model.set_attn_implementation(HF_ATTENTION)


def hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over ``module.context_parallel``: output ``[b, s_local, heads, d]``.
    ``cp_segment_ids`` (passed down from the model's forward): packed documents' numbers."""
    cp: ContextParallel = module.context_parallel
    window = kwargs.get("sliding_window")
    if window is not None and window < query.shape[2] * cp.size:
        raise ConfigError(
            f"--context-parallel-size: {type(module).__name__} uses sliding-window attention ({window} tokens) "
            f"over a {query.shape[2] * cp.size}-token sequence, which context parallelism does not compute; use "
            f"--seq-length {window} or less, or a model without a sliding window"
        )
    if kwargs.get("softcap") is not None:
        raise ConfigError(
            f"--context-parallel-size: {type(module).__name__} soft-caps its attention scores, which context "
            "parallelism does not compute; use a model without attention soft-capping"
        )
    if dropout:
        raise ConfigError("--context-parallel-size needs --attention-dropout 0 (attention dropout is not split)")
    out = cp(query, key, value, bool(module.is_causal), kwargs.get("cp_segment_ids"), scaling)
    return out.transpose(1, 2).contiguous(), None
