"""Expert parallelism (``--expert-model-parallel-size N``): each mixture-of-experts layer's experts split over N
of the data-parallel ranks, the tokens sent to their experts' ranks and back by all-to-all. The built-in GPT's
experts (``--num-experts``) and transformers' families' (all but GPT-OSS: ``MoELayout.gated_experts``) split.

The data-parallel ranks form a mesh ``("edp", "ep")`` (``DistributedContext.expert_mesh``): each row of N ``ep``
ranks holds one copy of every layer's experts, ``num_experts / N`` on each, and the ``edp`` ranks hold the same
experts (their data parallelism). Everything else stays data-parallel over all the ranks.

- **Weights.** Each expert tensor becomes a DTensor sharded on its expert dimension over ``ep`` (torchtitan's
  layout): DCP saves it by expert, so a checkpoint resumes on another expert-parallel size or on one process,
  and the export gathers the whole tensor.
- **Tokens.** A layer sorts its (token, choice) rows by expert (``gpt_moe.MoELayer``, or for a transformers
  model the experts module's forward, replaced by ``_routed_forward``); ``dispatch`` sends each
  rank its experts' rows (the counts first, then the rows: one ``all_to_all_single`` each), the received rows
  are regrouped by local expert and computed, and their outputs go back the same way. Both all-to-alls are
  differentiable, so the backward pass returns the gradients to the tokens' ranks.
- **Gradients.** An expert's gradient on its rank holds the contributions of every token of its ``ep`` row.
  Summed over ``edp`` and divided by the data-parallel size, it is the average over all the ranks' tokens that
  the other parameters get: FSDP2 over ``edp`` with its divide factor set to the data-parallel size (ZeRO-2/3),
  or, under DDP (which leaves the experts out), one all-reduce in the optimizer step.
- **Gradient norm and clipping** group the experts' DTensor gradients apart (``optim.optimizer``): their norm
  is made whole over ``ep``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.models.spec import moe_layout, spec_of


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Each routed block's experts module, in order."""
    layout = moe_layout(model)
    if layout is None:
        return []
    found = []
    for block in spec_of(model).blocks(model) or []:
        experts = getattr(getattr(block, "mlp", None), layout.experts, None)
        if isinstance(experts, nn.Module):
            found.append(experts)
    return found


class Dispatch:
    """The all-to-all round trip of one layer's rows (see the module docstring); ``local`` computes the rows of
    this rank's experts, ``local(rows, counts)`` with rows grouped by local expert."""

    def __init__(self, group: Any, ep: int, local_experts: int) -> None:
        self.group, self.ep, self.local_experts = group, ep, local_experts

    def __call__(
        self, rows: torch.Tensor, counts: torch.Tensor, local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        per_rank = counts.view(self.ep, self.local_experts)  # to each rank: its experts' row counts
        received = torch.empty_like(per_rank)
        dist.all_to_all_single(received, per_rank, group=self.group)  # [source rank, local expert]
        send = per_rank.sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows.contiguous(), recv, send, group=self.group)
        # Grouped by source rank, then by expert: regrouped by expert (each expert's rows in source order).
        expert_of_row = torch.arange(self.local_experts, device=rows.device).repeat(self.ep)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
        order = expert_of_row.argsort(stable=True)
        out = local(arrived[order], received.sum(0))
        back = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all_single_autograd(back, send, recv, group=self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
    """Split every experts module of ``model`` over ``ep_mesh`` in place; returns those modules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    modules = expert_modules(model)
    if not modules:
        raise ConfigError(
            f"--expert-model-parallel-size {ep}: {type(model).__name__} has no experts to split (not a mixture of "
            "experts); drop the flag"
        )
    layout = moe_layout(model)
    for experts in modules:
        if type(experts).__module__.startswith("peft."):
            raise ConfigError(
                f"--expert-model-parallel-size {ep} with LoRA on the experts: not built; leave them out "
                "(--lora-target-modules with the attention and MLP layers only)"
            )
        built_in = hasattr(experts, "dispatch")
        if not built_in and not layout.gated_experts:
            raise ConfigError(
                f"--expert-model-parallel-size {ep}: the {spec_of(model).family} family's experts (biased, clamped) "
                "are not split yet; drop the flag"
            )
        if experts.num_experts % ep:
            raise ConfigError(
                f"--expert-model-parallel-size {ep} does not divide the {experts.num_experts} experts of each layer"
            )
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]), param.requires_grad)
            experts.register_parameter(name, sharded)
        dispatch = Dispatch(ep_mesh.get_group(), ep, experts.num_experts // ep)
        if built_in:
            experts.dispatch = dispatch
        else:  # transformers' (hidden_states, top_k_index, top_k_weights) forward, routed through the dispatch
            experts.forward = _routed_forward(experts, dispatch)
    return modules


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _routed_forward(experts: nn.Module, dispatch: Dispatch) -> Callable:
    """A transformers experts module's forward under expert parallelism: its (token, choice) rows sorted by
    expert, sent through ``dispatch`` to this rank's gated experts (``MoELayout.gated_experts``), weighted by
    the router and summed per token, as the module's own forward sums them. A choice of index ``num_experts``
    or more (a token no expert takes) adds nothing, as there."""
    import torch.nn.functional as F

    def local(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
        out = []
        for e, part in enumerate(rows.split(counts.tolist())):
            gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
            out.append(F.linear(experts.act_fn(gate) * up, down[e]))
        return torch.cat(out)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k, flat = top_k_index.shape[-1], top_k_index.reshape(-1)
        kept = (flat < experts.num_experts).nonzero().squeeze(-1)
        order = kept[flat[kept].argsort(stable=True)]
        chosen = flat[order]
        counts = chosen.new_zeros(experts.num_experts).scatter_add_(0, chosen, torch.ones_like(chosen))
        token = order // k
        out = dispatch(hidden_states[token], counts, local)
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))

    return forward


def shard_experts(modules: list[nn.Module], edp_mesh: Any, fsdp_kwargs: dict[str, Any]) -> None:
    """ZeRO-2/3: each experts module of ``modules`` sharded by FSDP2 over ``edp`` (before the blocks, which then
    leave it out); FSDP averages its gradients there (``expert_gradient_averager`` does the rest).
    ``fsdp_kwargs``: the blocks'."""
    from torch.distributed.fsdp import fully_shard

    for experts in modules:
        fully_shard(experts, **{**fsdp_kwargs, "mesh": edp_mesh})


def expert_gradient_averager(modules: list[nn.Module], edp_group: Any, ep: int, dp: int) -> Callable:
    """The rest of the expert gradients' average, once per step: under DDP (which leaves them out) summed over
    ``edp_group`` and divided by the data-parallel size ``dp``; under FSDP2 (``edp_group`` None), which averaged
    them over ``edp`` already, divided by ``ep``. (FSDP2's own divide factor would do it in its reduce-scatter,
    with a reduce op gloo does not have.) ``modules``: the experts modules, whose parameters FSDP2 replaces."""

    def average(step_params: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for param in (p for m in modules for p in m.parameters()):
            if param.grad is None:
                continue
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            if edp_group is None:
                grad.div_(ep)
                continue
            if dist.get_world_size(edp_group) > 1:
                dist.all_reduce(grad, group=edp_group)
            grad.div_(dp)

    return average
