"""The plan's mixture-of-experts terms (``rapidlite.planning.memory``): the counts the step-time model and
``--search`` read, what FSDP2 gathers of an expert-parallel expert, and the dispatch buffers."""

from __future__ import annotations

import torch

from rapidlite.config.settings import Sections


def _bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def gathered_bytes(p: torch.Tensor, dp: int) -> int:
    """The bytes FSDP2 gathers of ``p``: over the data-parallel ranks, or for an expert-parallel expert tensor
    (on the ``("edp", "ep")`` mesh) over ``edp`` only."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    over = p.device_mesh.size(names.index("edp")) if "edp" in names else dp
    return _bytes(p) * over


def dispatch_bytes(settings: Sections, module: torch.nn.Module, width: int) -> int:
    """Expert parallelism's dispatch buffers at the peak: one routed layer's (token, choice) rows sent and
    received, ``2 x micro-batch x sequence x top-k x hidden`` of ``width`` bytes (0 without it)."""
    from rapidlite.models.spec import moe_layout

    layout = moe_layout(module)
    if settings.topology.ep <= 1 or layout is None:
        return 0
    config = module.config
    hidden = config.hidden_size
    seq = settings.batching.seq_length or getattr(config, "seq_length", None) or settings.data.seq_length or 0
    return 2 * settings.batching.micro_batch_size * seq * layout.top_k(config) * hidden * width


def expert_counts(model: torch.nn.Module) -> dict[str, int]:
    """``Plan``'s mixture-of-experts counts of a whole (meta) model; none for a dense one."""
    from rapidlite.models.spec import moe_layout
    from rapidlite.parallel.expert_parallel import expert_modules

    layout, modules = moe_layout(model), expert_modules(model)
    if layout is None or not modules:
        return {}
    params = sum(p.numel() for m in modules for p in m.parameters())
    return {"moe_layers": len(modules), "moe_top_k": layout.top_k(model.config), "expert_params": params}


def rank_counts(
    module: torch.nn.Module, params: list, trainable: int, stepped: list[int], whole: int, ep: int
) -> dict[str, int]:
    """``RankPlan``'s element counts: what the rank computes with (FSDP2's shards are local here, ``whole``
    of them make a weight; an expert's over ``edp`` only), trains and steps, and of those its own experts."""
    from rapidlite.parallel.expert_parallel import expert_modules

    def _elems(p: torch.Tensor) -> int:
        return (p.to_local() if hasattr(p, "to_local") else p).numel()

    experts = {id(p) for m in expert_modules(module) for p in m.parameters()} if ep > 1 else set()
    edp_whole = max(whole // ep, 1) if experts else whole
    own = [p for p in params if id(p) in experts]
    shared = sum(_elems(p) for p in params) - sum(_elems(p) for p in own)
    trainable_own = sum(_elems(p) for p in own if p.requires_grad)
    return {
        "compute_params": shared * whole + sum(_elems(p) for p in own) * edp_whole,
        "trainable_params": (trainable - trainable_own) * whole + trainable_own * edp_whole,
        "stepped_params": sum(stepped),
        "expert_params": sum(_elems(p) for p in own) * edp_whole,
        "trainable_expert_params": trainable_own * edp_whole,
    }
