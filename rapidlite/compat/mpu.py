"""Megatron's ``mpu`` accessors for user scripts: ``from rapidlite import mpu`` where Megatron code has
``from megatron import mpu``.

Ranks, sizes and process groups of the running engine's topology (pipeline x data x tensor parallel, the
layout of ``rapidlite.config.topology.Topology``), and ``broadcast_data``, which hands every rank of a
tensor-parallel group the batch of its first rank. Like ``get_args()`` these read the engine created last
(``RapidliteEngine()``); library code takes its topology explicitly and never calls them. Without a process
group (one process) every rank is 0, every size 1 and every group None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rapidlite.compat.global_vars import get_distributed_context

_MAX_DIMS = 8


def _ctx() -> Any:
    return get_distributed_context()


def _group(name: str, size: int) -> Any:
    ctx = _ctx()
    if ctx.mesh is None:
        return None
    if name == "dp":
        return ctx.dp_group
    return ctx.mesh.get_group(name) if size > 1 else None


# ---------------------------------------------------------------- data parallel
def get_data_parallel_rank() -> int:
    return _ctx().dp_rank


def get_data_parallel_world_size() -> int:
    return _ctx().dp_size


def get_data_parallel_group() -> Any:
    return _group("dp", _ctx().dp_size)


# ---------------------------------------------------------------- tensor parallel
def get_tensor_model_parallel_rank() -> int:
    ctx = _ctx()
    return ctx.rank % ctx.topology.tp


def get_tensor_model_parallel_world_size() -> int:
    return _ctx().topology.tp


def get_tensor_model_parallel_group() -> Any:
    return _group("tp", _ctx().topology.tp)


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    ctx = _ctx()
    return ctx.rank - ctx.rank % ctx.topology.tp


# Megatron's older names for the tensor-parallel group.
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank


# ---------------------------------------------------------------- pipeline parallel
def get_pipeline_model_parallel_rank() -> int:
    return _ctx().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _ctx().topology.pp


def get_pipeline_model_parallel_group() -> Any:
    return _group("pp", _ctx().topology.pp)


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# ---------------------------------------------------------------- data
def _as_tensor(key: str, value: Any, datatype: torch.dtype) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.is_floating_point() and not datatype.is_floating_point:
        raise TypeError(f"broadcast_data: {key} holds {tensor.dtype} values, which {datatype} would truncate")
    if tensor.ndim > _MAX_DIMS:
        raise ValueError(f"broadcast_data: {key} has {tensor.ndim} dimensions; at most {_MAX_DIMS} are supported")
    return tensor.to(datatype)


def broadcast_data(keys: Sequence[str], data: Mapping[str, Any] | None, datatype: torch.dtype) -> dict[str, Any]:
    """Megatron's ``mpu.broadcast_data``: ``{key: tensor}`` on this rank's device, of ``datatype``, with the
    values of the first rank of the tensor-parallel group (which must pass ``data``; the others may pass
    None). Without tensor parallelism each rank's own ``data`` is converted."""
    ctx = _ctx()
    tp = ctx.topology.tp
    first = ctx.rank % tp == 0
    if first or tp == 1 or ctx.mesh is None:
        if data is None:
            raise ValueError("broadcast_data: the first rank of a tensor-parallel group must pass the data")
        missing = [k for k in keys if k not in data]
        if missing:
            raise KeyError(f"broadcast_data: the data has no {', '.join(missing)} (it has: {', '.join(data)})")
        tensors = [_as_tensor(k, data[k], datatype) for k in keys]
        if tp == 1 or ctx.mesh is None:
            return {k: t.to(ctx.device) for k, t in zip(keys, tensors, strict=True)}
    group, src = get_tensor_model_parallel_group(), get_tensor_model_parallel_src_rank()
    # Shapes first (one row per key: ndim, then the sizes), then every value in one flat tensor.
    header = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64, device=ctx.device)
    if first:
        for row, tensor in zip(header, tensors, strict=True):
            row[0] = tensor.ndim
            row[1 : 1 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    shapes = [tuple(row[1 : 1 + row[0]]) for row in header.tolist()]
    total = sum(int(torch.Size(shape).numel()) for shape in shapes)
    if first:
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(ctx.device)
    else:
        flat = torch.empty(total, dtype=datatype, device=ctx.device)
    dist.broadcast(flat, src, group=group)
    out, offset = {}, 0
    for key, shape in zip(keys, shapes, strict=True):
        n = int(torch.Size(shape).numel())
        out[key] = flat[offset : offset + n].view(shape)
        offset += n
    return out
