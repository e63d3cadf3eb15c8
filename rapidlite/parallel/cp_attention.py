"""Context-parallel attention: exact attention of a rank's shard of each sequence over the whole sequence.

``ring_attention`` (``--cp-comm-type p2p``): each rank keeps its queries; the key/value blocks circulate round
the ring by send/recv (the next block's transfer overlapped with the current block's attention), each block's
partial output merged with the log-sum-exp (online softmax). The backward circulates them again with their
gradient accumulators, which arrive back at their owner after a full turn. Memory per rank: the local block
plus one block in flight, whatever the group's size.

``ulysses_attention`` (``--cp-comm-type a2a``): an all-to-all turns sequence shards into head shards (every rank
then holds the whole sequence for ``heads / N`` heads), plain SDPA runs, and a second all-to-all turns them back.
It needs the query and key/value heads divisible by ``N``.

Both take the load-balanced split of ``shard_indices`` (rank ``i`` holds chunks ``i`` and ``2N-1-i`` of ``2N``)
and ``segment_ids`` (a document number per token) for packed documents. The block attention is the fused kernel
that returns the log-sum-exp: on CPU ATen's flash attention for CPU, on CUDA the memory-efficient kernel (the
path no machine here runs; ``docs/guides/long-context.md`` says so).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def shard_indices(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global indices of rank ``rank``'s tokens, ascending: chunks ``rank`` and ``2 cp - 1 - rank`` of
    ``2 cp`` equal chunks (``seq_len`` must be divisible by ``2 cp``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size {cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat((first, first + (2 * cp - 1 - 2 * rank) * chunk))


# ----------------------------------------------------------------------------------------------- block kernels


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention ``[b, h, sq, d]`` and its log-sum-exp ``[b, h, sq]`` (fp32; -inf, with a zero
    output, on rows that see no key of the block). ``mask``: bool ``[b, 1, sq, sk]``, True = attend."""
    bias = None if mask is None else _bias(mask, q.dtype)
    if q.device.type == "cuda":
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )
        if lse.shape[-1] != q.shape[2]:
            _CUDA_LSE_PADDED[0] = True
        elif q.shape[2] % 32:
            _CUDA_LSE_PADDED[0] = False
        lse = lse[..., : q.shape[2]]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    if mask is not None:
        blind = ~mask.any(-1)  # [b, 1, sq]
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind[..., None], 0.0)
    return out, lse.float()


def _attend_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients, given the whole attention's output and log-sum-exp (rows and keys
    of the block only)."""
    bias = None if mask is None else _bias(mask, q.dtype)
    lse = lse.masked_fill(lse == float("-inf"), 0.0)  # rows that see nothing anywhere: no gradient either way
    if q.device.type == "cuda":
        kv_heads = k.shape[1]
        k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        if _CUDA_LSE_PADDED[0] is not False:  # the kernel's log-sum-exp padded to a multiple of 32 rows
            lse = torch.nn.functional.pad(lse, (0, -(-q.shape[2] // 32) * 32 - q.shape[2]))
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


# Whether the CUDA memory-efficient kernel pads its log-sum-exp to a multiple of 32 rows (versions differ): what
# its forward returned says, where the rows are not such a multiple; until then, padded.
_CUDA_LSE_PADDED: list[bool | None] = [None]


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask; on CUDA its rows start at multiples of 16 elements, as the memory-efficient kernel
    requires of a bias (allocated wider, then sliced)."""
    *lead, keys = mask.shape
    width = -(-keys // 16) * 16 if mask.device.type == "cuda" else keys
    bias = torch.zeros((*lead, width), dtype=dtype, device=mask.device)[..., :keys]
    return bias.masked_fill_(~mask, float("-inf"))  # in place: the slice keeps the wider rows' strides


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x if h == heads else x.view(b, heads, h // heads, s, d).sum(2)


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys, merged by their log-sum-exps (fp32)."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    safe = merged.masked_fill(merged == float("-inf"), 0.0)
    weight_old = torch.exp(lse - safe)[..., None]
    weight_new = torch.exp(block_lse - safe)[..., None]
    return out * weight_old + block_out * weight_new, merged


# ------------------------------------------------------------------------------------------------------ ring


def _ring_exchange(tensors: list[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """Start sending ``tensors`` to the next rank of ``group`` and receiving the previous rank's; returns the
    receive buffers and the requests to wait on."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _ring_blocks(rank: int, source: int, causal: bool, half: int) -> tuple[slice, slice, bool]:
    """Which query rows and key columns of the local and ``source``'s blocks see each other, and whether the
    pair is causal within: under the load-balanced split, the diagonal block is causal, an earlier rank's keys
    are seen by every query through their first chunk only, a later rank's by the local second chunk only."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _segment_mask(q_segments: torch.Tensor, k_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """True where a query and a key are of one document (and, ``causal``, the key is not later)."""
    mask = (q_segments[:, :, None] == k_segments[:, None, :])[:, None]
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask


def _block_mask(
    segments: torch.Tensor | None, blocks: list[torch.Tensor], rows: slice, cols: slice, causal: bool
) -> torch.Tensor | None:
    """The mask of one ring step's block pair: the local rows' documents against the held block's (its third
    tensor), causal within where the pair is; None without documents."""
    if segments is None:
        return None
    return _segment_mask(segments[:, rows], blocks[2][:, cols], causal)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, group, causal, scale):  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        blocks = [k, v] if segments is None else [k, v, segments]
        out = lse = None
        for step in range(size):
            requests: list[Any] = []
            if step + 1 < size:
                incoming, requests = _ring_exchange(blocks, group)
            source = (rank - step) % size
            rows, cols, block_causal = _ring_blocks(rank, source, causal, half)
            kb, vb = blocks[0][:, :, cols], blocks[1][:, :, cols]
            mask = _block_mask(segments, blocks, rows, cols, block_causal)
            block_out, block_lse = _attend(q[:, :, rows], kb, vb, mask, block_causal and mask is None, scale)
            if rows.start:  # a later rank's keys: only the second chunk's rows took part
                block_out = torch.cat((torch.zeros_like(block_out), block_out), dim=2)
                block_lse = torch.cat((torch.full_like(block_lse, float("-inf")), block_lse), dim=2)
            out, lse = _merge(out, lse, block_out, block_lse)
            _wait(requests)
            if step + 1 < size:
                blocks = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if segments is None else (segments,)))
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):  # type: ignore[override]
        q, k, v, out, lse, *maybe_segments = ctx.saved_tensors
        segments = maybe_segments[0] if maybe_segments else None
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[2] // 2
        grad_out = grad_out.contiguous()
        blocks = [k, v] if segments is None else [k, v, segments]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for step in range(size):
            requests: list[Any] = []
            if step + 1 < size:
                incoming, requests = _ring_exchange(blocks, group)
            source = (rank - step) % size
            rows, cols, block_causal = _ring_blocks(rank, source, causal, half)
            mask = _block_mask(segments, blocks, rows, cols, block_causal)
            gq, gk, gv = _attend_backward(
                grad_out[:, :, rows], q[:, :, rows], blocks[0][:, :, cols].contiguous(),
                blocks[1][:, :, cols].contiguous(), out[:, :, rows], lse[:, :, rows].contiguous(), mask,
                block_causal and mask is None, scale,
            )  # fmt: skip
            dq[:, :, rows] += gq
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv
            # The accumulators travel with the blocks; after the last step one more hop brings each home.
            (dk, dv), grad_requests = _ring_exchange([dk, dv], group)
            _wait(grad_requests)
            _wait(requests)
            if step + 1 < size:
                blocks = incoming
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, by ring. ``q`` ``[b, h, s_local, d]``,
    ``k``/``v`` ``[b, h_kv, s_local, d]`` (``h`` a multiple of ``h_kv``): the rank's load-balanced shard
    (``shard``). ``segment_ids`` ``[b, s_local]``: document numbers; keys of other documents are not seen."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    segments = None if segment_ids is None else segment_ids.contiguous()
    out, _ = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), segments, group, causal, scale)
    return out


# ---------------------------------------------------------------------------------------------------- ulysses


class _SequenceToHeads(torch.autograd.Function):
    """``[b, h, s_local, d]`` → ``[b, h / N, N s_local, d]`` (the ranks' shards one after another); the
    backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [n, b, h/n, s, d]: part i to rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [n, b, h/n, s, d]: part i from rank i
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, hn, ns, d = x.shape
    send = x.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [n, b, h/n, s, d]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # part i: heads of rank i for this rank's tokens
    return received.transpose(0, 1).reshape(b, n * hn, ns // n, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``ring_attention``'s result by all-to-all (Ulysses): heads and key/value heads divisible by the group."""
    n = dist.get_world_size(group)
    local = q.shape[2]
    order = torch.cat([shard_indices(n * local, n, i, q.device) for i in range(n)])
    natural = torch.argsort(order)  # the gathered sequence (rank after rank) into token order
    q, k, v = (_SequenceToHeads.apply(t.contiguous(), group).index_select(2, natural) for t in (q, k, v))
    mask = None
    if segment_ids is not None:
        parts = [torch.empty_like(segment_ids) for _ in range(n)]
        dist.all_gather(parts, segment_ids.contiguous(), group=group)
        segments = torch.cat(parts, dim=1).index_select(1, natural)
        mask = _segment_mask(segments, segments, causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return _HeadsToSequence.apply(out.index_select(2, order), group)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    comm_type: str,
    causal: bool = True,
    segment_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention of the local shard over the group's whole sequence, by ``comm_type`` (``p2p``/``a2a``)."""
    attend = {"p2p": ring_attention, "a2a": ulysses_attention}[comm_type]
    return attend(q, k, v, group, causal=causal, segment_ids=segment_ids, scale=scale)
