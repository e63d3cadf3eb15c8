"""A mixture-of-experts model's router in training: its load-balancing loss, its z-loss, and the load it puts on
each expert.

``router_loss(model, settings)`` hooks every router of a model whose family declares a ``MoELayout``: each
training forward (gradients on, the model in training mode: sampling, evaluation and a frozen reference add
nothing, nor does activation checkpointing's recomputation) leaves its router logits there. After the forward,
the strategy adds ``penalty(items)`` to the micro-batch's loss before its backward, so the router loss reaches
the gradients on every layout and task.

- **Load-balancing loss** (``moe_aux_loss``), as transformers computes its ``aux_loss`` for these families: over
  the tokens of every routed layer together (padding left out by the attention mask), the number of experts
  times the sum over experts of (the share of top-k choices it got) x (its mean routing probability).
  transformers adds it only where labels reach the model, which rapidlite's chunked loss never passes; here it is
  added on every path and logged apart from the language-model loss.
- **z-loss** (``moe_z_loss``, ST-MoE): the mean squared log-sum-exp of the router logits, over the same tokens.
- Each micro-batch's penalty is ``coefficient x loss``, times the micro-batch's item count where the forward
  step returns ``(loss_sum, num_items)``: the gradients then hold the router loss averaged over the global batch
  as the language-model loss is (by micro-batch for a mean loss, by item for a summed one), whatever the
  accumulation and the data-parallel size. The logged values are averaged the same way.
- **The built-in GPT** (``MoELayout.per_layer``) takes Megatron's losses instead: each routed layer's
  load-balancing loss (the expert count over the top-k, times the sum over experts of the share of tokens that
  chose it and its mean probability; per sequence and averaged for ``--moe-router-load-balancing-type
  seq_aux_loss``; none for ``none``) and its z-loss, summed over the layers. With
  ``--moe-router-enable-expert-bias`` its routers' bias is moved after every optimizer step
  (``update_expert_bias``) towards the experts that got fewer tokens.
- **Pipeline parallelism** (the built-in GPT): each stage's routers' losses travel with its activations to the
  last stage, which adds them to the micro-batch's loss weighted as above (``stage_losses``,
  ``carried_penalty``); each stage counts its own layers' loads, and the metrics are summed over the stages
  (``report``). The expert bias moves by the load summed over the ranks that hold the same router
  (``load_group``: the data- and context-parallel ones of the stage).
- **Load**: per routed layer, the tokens each expert received (the router's own choice), as
  ``moe/layer_{i}/load_max_over_mean`` (1 is perfectly even; the expert count means one expert got every
  token) and their mean over layers, ``moe/load_max_over_mean``.
- **Dropped tokens**: with the built-in GPT's ``--moe-expert-capacity-factor``, the share of each routed layer's
  (token, choice) pairs over their expert's capacity, as ``moe/layer_{i}/dropped_tokens`` and their mean,
  ``moe/dropped_tokens``. The Hugging Face families drop no token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rapidlite.config.moe import MoEConfig
from rapidlite.errors import ConfigError
from rapidlite.models.spec import MoELayout, moe_layout, spec_of


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(block index, router)`` of each routed block, in order."""
    layout = moe_layout(model)
    blocks = spec_of(model).blocks(model) or []
    found = []
    for index, block in enumerate(blocks):
        router = getattr(getattr(block, "mlp", None), layout.router, None) if layout is not None else None
        if isinstance(router, nn.Module):
            found.append((index, router))
    return found


def config_of(model: nn.Module) -> Any:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.config


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``aux_loss`` of the router logits ``[tokens, experts]`` of each layer: the expert count
    times the sum over experts of the share of the top-k choices it got and its mean routing probability, over
    the tokens of every layer together (``mask``: 1 for the tokens that count, flat)."""
    experts = logits[0].shape[-1]
    chosen = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    probs = torch.zeros_like(chosen)
    tokens = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    for layer in logits:
        p = layer.float().softmax(-1)
        picks = torch.nn.functional.one_hot(p.topk(top_k, dim=-1).indices, experts).sum(1).float()  # [tokens, E]
        weight = mask if mask is not None else torch.ones_like(p[:, 0])
        chosen = chosen + (picks * weight[:, None]).sum(0)
        probs = probs + (p * weight[:, None]).sum(0)
        tokens = tokens + weight.sum()
    return experts * ((chosen / tokens) * (probs / tokens)).sum()


def layer_balancing_loss(logits: torch.Tensor, chosen: torch.Tensor, sequences: int) -> torch.Tensor:
    """Megatron's load-balancing loss of one layer (``switch_load_balancing_loss_func``; per sequence, then
    averaged, for ``seq_aux_loss``: give ``sequences``, 1 for the layer's tokens together): the expert count
    over the top-k, times the sum over experts of the share of tokens that chose it and its mean probability.
    ``chosen``: the experts the router picked (with an expert bias, not the probabilities' own top-k)."""
    experts, k = logits.shape[-1], chosen.shape[-1]
    p = logits.float().softmax(-1).view(sequences, -1, experts)
    picks = torch.nn.functional.one_hot(chosen, experts).sum(-2).float().view(sequences, -1, experts)
    return (experts / k) * (picks.mean(1) * p.mean(1)).sum(-1).mean()


def z_loss(logits: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over layers and tokens of the squared log-sum-exp of the router logits."""
    total, count = 0.0, 0.0
    for layer in logits:
        z = layer.float().logsumexp(-1) ** 2
        weight = mask if mask is not None else torch.ones_like(z)
        total, count = total + (z * weight).sum(), count + weight.sum()
    return total / count


class RouterLoss:
    """The hooks on a model's routers and what they kept of the current forward (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        found: list[tuple[int, nn.Module]],
        layout: MoELayout,
        aux_coeff: float,
        z_coeff: float,
        bias_rate: float = 0.0,
    ) -> None:
        config = config_of(model)
        self.top_k, self.aux_coeff, self.z_coeff = layout.top_k(config), aux_coeff, z_coeff
        self.per_layer, self.balancing = layout.per_layer, layout.balancing(config)
        self.layers = [index for index, _ in found]
        self._layer_of = {id(router): index for index, router in found}
        # The built-in GPT's MoE layers (the routers' parents) say what a capacity dropped (``dropped``).
        parents = {id(child): module for module in model.modules() for child in module.children()}
        self._moe_layers = {index: parents.get(id(router)) for index, router in found}
        # Routers balanced by their bias (the built-in GPT's --moe-router-enable-expert-bias): moved after a step.
        self._biased = [(i, r) for i, r in found if getattr(r, "expert_bias", None) is not None]
        self.bias_rate = bias_rate
        # The ranks whose tokens one router's load sums (data- and context-parallel: None, every rank), and under
        # pipeline parallelism the stages whose metrics make the model's (``report``).
        self.load_group: Any = None
        self.pp_group: Any = None
        self._step_load: dict[int, torch.Tensor] = {}
        # Under pipeline parallelism, what each (stage, micro-batch) kept and the router loss of each micro-batch,
        # committed after the schedule (``commit``).
        self._pending: dict[Any, tuple[dict, dict]] = {}
        self._pending_losses: dict[int, tuple[torch.Tensor, float]] = {}
        self._sink: tuple[dict, dict] | None = None
        self._logits: list[torch.Tensor] = []
        self._kept: list[int] = []  # the block index of each router output kept
        self._chosen: list[torch.Tensor] = []
        self._sequences: list[int] = []
        self._mask: torch.Tensor | None = None
        self._sums: dict[str, tuple[torch.Tensor, float]] = {}
        self._handles = [router.register_forward_hook(self._keep) for _, router in found]
        self._handles.append(model.register_forward_pre_hook(self._keep_mask, with_kwargs=True))

    @property
    def biased(self) -> bool:
        return bool(self._biased)

    @staticmethod
    def _training(module: nn.Module) -> bool:
        """A training forward: gradients on, in training mode, and not activation checkpointing's recomputation
        inside the backward pass (its router logits were counted in the forward)."""
        return module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _keep_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._training(module):
            self._mask = kwargs.get("attention_mask")

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._training(module):
            self._logits.append(output[0])
            self._kept.append(self._layer_of[id(module)])
            self._chosen.append(output[2].detach())
            self._sequences.append(args[0].shape[0] if args[0].dim() == 3 else 1)  # [batch, seq, hidden]

    def _flat_mask(self) -> torch.Tensor | None:
        """The attention mask as one weight per token, where it is a ``[batch, sequence]`` mask of the routed
        tokens (a packed batch has none: every token counts)."""
        mask, tokens = self._mask, self._logits[0].shape[0]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.numel() != tokens:
            return None
        return mask.reshape(-1).to(self._logits[0].device, torch.float32)

    def _losses(self, mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(load-balancing loss, z-loss) of the forward kept: transformers' or Megatron's (``per_layer``)."""
        aux = z = None
        if not self.per_layer:
            aux = load_balancing_loss(self._logits, self.top_k, mask)
            z = z_loss(self._logits, mask) if self.z_coeff else None
            return aux, z
        if self.balancing != "none":
            per_sequence = self.balancing == "seq_aux_loss"
            layers = zip(self._logits, self._chosen, self._sequences, strict=True)
            aux = sum(layer_balancing_loss(lg, ch, n if per_sequence else 1) for lg, ch, n in layers)
        if self.z_coeff:
            z = sum(z_loss([layer], None) for layer in self._logits)
        return aux, z

    def penalty(self, items: int | None) -> torch.Tensor | None:
        """The router loss of the forward just run, to add to its loss (``items``: the micro-batch's item count
        when its loss is a sum, else None); None when no router ran in training."""
        if not self._logits:
            return None
        mask, weight = self._flat_mask(), float(items) if items is not None else 1.0
        aux, z = self._losses(mask)
        total = torch.zeros((), device=self._logits[0].device)
        if aux is not None:
            total = total + self.aux_coeff * aux
            self._add("moe_aux_loss", aux.detach() * weight, weight)
        if z is not None:
            total = total + self.z_coeff * z
            self._add("moe_z_loss", z.detach() * weight, weight)
        self._count_load(mask)
        return total * weight

    def _count_load(self, mask: torch.Tensor | None) -> None:
        """Each routed layer's load (and what a capacity dropped) in the metrics and the step's load; the forward's
        router outputs are then let go."""
        experts = self._logits[0].shape[-1]
        for layer, chosen in zip(self._kept, self._chosen, strict=True):
            picks = chosen if mask is None else chosen[mask.bool()]
            load = torch.bincount(picks.reshape(-1), minlength=experts).float()
            balance = load.max() / load.mean().clamp_min(1e-9)
            self._add(f"moe/layer_{layer}/load_max_over_mean", balance, 1.0)
            self._add("moe/load_max_over_mean", balance, 1.0)  # the mean over layers (and micro-batches)
            if any(i == layer for i, _ in self._biased):
                loads = self._sink[1] if self._sink is not None else self._step_load
                loads[layer] = loads.get(layer, 0) + load
            module = self._moe_layers[layer]
            if getattr(module, "dropped", None) is not None:
                self._add(f"moe/layer_{layer}/dropped_tokens", module.dropped, 1.0)
                self._add("moe/dropped_tokens", module.dropped, 1.0)
                module.dropped = None
        self._logits, self._chosen, self._sequences, self._mask, self._kept = [], [], [], None, []

    # ------------------------------------------------------------------ pipeline parallelism
    def stage_losses(self, key: Any) -> torch.Tensor | None:
        """After a pipeline stage's forward: ``[load-balancing loss, z-loss]`` of its routers (the built-in GPT's
        are sums over layers; 0 where off), which the stages carry to the last one (``carried_penalty``); None
        when no router ran in training. Its loads count once per ``key`` (stage, micro-batch), the key's last
        forward, at ``commit``: torch's pipelining runs a stage once more on the first micro-batch to learn its
        shapes."""
        if not self._logits:
            return None
        aux, z = self._losses(None)
        zero = torch.zeros((), device=self._logits[0].device)
        self._sink = ({}, {})
        try:
            self._count_load(None)
        finally:
            self._pending[key], self._sink = self._sink, None
        return torch.stack([aux if aux is not None else zero, z if z is not None else zero]).float()

    def carried_penalty(self, carried: torch.Tensor, items: int | None, index: int) -> torch.Tensor:
        """On the last stage: the router loss of every stage (``carried``, from ``stage_losses``) to add to
        micro-batch ``index``'s loss, weighted as that loss (``items``: its item count for a summed loss). Logged
        at ``commit``, once per micro-batch."""
        weight = float(items) if items is not None else 1.0
        self._pending_losses[index] = (carried.detach(), weight)
        return (self.aux_coeff * carried[0] + self.z_coeff * carried[1]) * weight

    def commit(self) -> None:
        """After a pipeline schedule's training run: what each (stage, micro-batch) kept joins the step's metrics
        and load."""
        for sums, loads in self._pending.values():
            for name, (total, count) in sums.items():
                self._add(name, total, count)
            for layer, load in loads.items():
                self._step_load[layer] = self._step_load.get(layer, 0) + load
        for carried, weight in self._pending_losses.values():
            if not self.per_layer or self.balancing != "none":
                self._add("moe_aux_loss", carried[0] * weight, weight)
            if self.z_coeff:
                self._add("moe_z_loss", carried[1] * weight, weight)
        self._pending.clear()
        self._pending_losses.clear()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After an optimizer step, with ``--moe-router-enable-expert-bias``: each router's bias moves by the
        rate towards the experts that got fewer tokens than the mean over the step (summed over the ranks that
        hold the same router, ``load_group``, so each moves its bias the same), as DeepSeek-V3 and Megatron do.
        Under pipeline parallelism each stage moves its own routers'."""
        kept, self._step_load = self._step_load, {}
        biased = [(i, router) for i, router in self._biased if i in kept]
        if not biased:
            return
        import torch.distributed as dist

        load = torch.stack([kept[i] for i, _ in biased])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.load_group) > 1:
            dist.all_reduce(load, group=self.load_group)
        step = self.bias_rate * torch.sign(load.mean(-1, keepdim=True) - load)
        for (_, router), delta in zip(biased, step, strict=True):
            router.expert_bias.add_(delta.to(router.expert_bias.device))

    def _add(self, name: str, value: torch.Tensor, count: float) -> None:
        sums = self._sink[0] if self._sink is not None else self._sums
        old, n = sums.get(name, (0.0, 0.0))
        sums[name] = (old + value.detach().double(), n + count)

    def report(self, add: Callable[[str, Any, float], None]) -> None:
        """Hand the values kept since the last report to ``add(name, sum, count)`` (the step metrics). Under
        pipeline parallelism each stage kept its own layers': they are summed over the stages first (a
        collective of the pipeline's ranks), so every rank reports the whole model's."""
        sums, self._sums = self._sums, {}
        if self.pp_group is not None:
            sums = _over_stages(sums, self.pp_group)
        for name, (total, count) in sums.items():
            add(name, total, count)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _over_stages(sums: dict[str, tuple[Any, float]], group: Any) -> dict[str, tuple[torch.Tensor, float]]:
    """``name: (sum, count)`` summed over the pipeline's stages, each of which kept its own layers' names."""
    import torch.distributed as dist

    names: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, sorted(sums), group=group)
    union = sorted({name for part in names for name in part})
    values = torch.zeros(2, len(union), dtype=torch.float64)
    for j, name in enumerate(union):
        if name in sums:
            total, count = sums[name]
            values[0, j], values[1, j] = float(total), float(count)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    values = values.to(device)
    dist.all_reduce(values, group=group)
    values = values.cpu()
    return {name: (values[0, j], float(values[1, j])) for j, name in enumerate(union)}


def router_loss(model: nn.Module, settings: MoEConfig, given: Callable[[str], bool], logger: Any) -> RouterLoss | None:
    """The router loss of ``model`` (its routers frozen under ``--freeze-router``), or None for a dense model;
    a dense model given a ``--moe-*`` flag is one line. ``given(dest)``: whether the command line set a flag."""
    found = routers(model)
    if not found:
        # A flag that does something (a weight of 0 or no --freeze-router does nothing on any model).
        named = [f.name for f in dataclasses.fields(MoEConfig) if given(f.name) and getattr(settings, f.name)]
        if named:
            model_name = type(config_of(model)).__name__.removesuffix("Config") or "the model"
            raise ConfigError(
                f"--{named[0].replace('_', '-')}: {model_name} is not a "
                "mixture of experts (no router in its blocks): drop the flag"
            )
        return None
    layout, config = moe_layout(model), config_of(model)
    top_k, experts = layout.top_k(config), layout.num_experts(config)
    coeff = settings.moe_aux_loss_coeff if settings.moe_aux_loss_coeff is not None else layout.aux_coeff(config)
    if settings.freeze_router:
        for _, router in found:
            router.requires_grad_(False)
    hooks = RouterLoss(model, found, layout, coeff, settings.moe_z_loss_coeff, settings.moe_router_bias_update_rate)
    if logger is not None:
        source = "--moe-aux-loss-coeff" if settings.moe_aux_loss_coeff is not None else "the default"
        if settings.moe_aux_loss_coeff is None and getattr(config, "router_aux_loss_coef", None) is not None:
            source = "the model config's"
        balance = f"load-balancing loss x{coeff:g} ({source})"
        if layout.per_layer:
            balance = "no load-balancing loss" if hooks.balancing == "none" else f"{hooks.balancing} x{coeff:g}"
        if hooks.biased:
            balance += f" | expert bias, rate {hooks.bias_rate:g}"
        logger.info(
            f"mixture of experts: {experts} experts, top {top_k}, routed in {len(found)} of "
            f"{len(spec_of(model).blocks(model) or [])} blocks | {balance} | "
            f"z-loss {f'x{settings.moe_z_loss_coeff:g}' if settings.moe_z_loss_coeff else 'off'} | router "
            f"{'frozen' if not any(p.requires_grad for _, r in found for p in r.parameters()) else 'trained'}"
        )
    return hooks
