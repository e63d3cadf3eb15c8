"""Building blocks of tensor-parallel plans (Megatron's layout on DTensor), for the model families' plans.

Within a transformer block the q/k/v projections and the MLP's up/gate projections are split column-wise
(each rank computes its heads and its slice of the MLP), the attention output and MLP down projections
row-wise (one all-reduce per sub-layer). Each sub-layer's input enters as one replicated DTensor
(``PrepareModuleInput``), so the projections that read it add their input gradients as partial sums and
all-reduce the sum once: two all-reduces a block forward and two backward. The word embedding is split
along the vocabulary and the output layer column-wise along the vocabulary: the logits stay sharded and
the cross-entropy is computed on the shards (``loss_parallel``), so the full ``[batch, seq, vocab]``
logits never exist on one rank.
``--sequence-parallel`` also splits the norms, dropout and residual stream along the sequence between the
parallel regions (all-gather before attention/MLP, reduce-scatter after), as in Megatron.

``declared_plan`` is the plan of any Hugging Face model whose config declares a column/row-wise one
(``base_model_tp_plan``: LLaMA, Mistral, Qwen2, ...). The families' own plans live in
``rapidlite/models/families/``; ``rapidlite.parallel.tensor_parallel`` applies the one the model's spec names.
This module is at the models layer: it imports nothing from ``rapidlite.parallel``.

Dropout inside the parallel regions (attention probabilities of a rank's heads) draws from each rank's
RNG, which is seeded alike: the masks differ from a one-process run's, so bit-for-bit equality with one
process holds with dropout 0 (what the tests use); the training is statistically the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError


def stack_blocks(layers: nn.Module) -> list[nn.Module]:
    """The blocks of a layer stack, whole (``ModuleList``) or pruned to a pipeline stage's (``ModuleDict`` keyed by
    the global index)."""
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def check_divisible(sizes: Iterable[tuple[str, int]], tp: int, of: str | None = None) -> None:
    """Refuse, in one line naming the flag (and the model ``of``), a size that does not split over ``tp`` ranks."""
    for flag, value in sizes:
        if value % tp:
            model = f" of {of}" if of else ""
            raise ConfigError(f"{flag} {value}{model} is not divisible by --tensor-model-parallel-size {tp}")


def shard_vocabulary(
    embedding: nn.Module | None, output: nn.Module | None, tp_mesh: Any, sequence_parallel: bool
) -> None:
    """The word embedding split along the vocabulary (its output whole on every rank: the shards' lookups are
    summed) and the output layer column-wise along the vocabulary, its logits left sharded for
    ``loss_parallel``; a tied weight stays one DTensor. Either may be None (a pipeline stage without it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tied = output is not None and embedding is not None and output.weight is embedding.weight
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if output is not None:
        residual = Shard(1) if sequence_parallel else Replicate()
        parallelize_module(
            output, tp_mesh, ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        )
    if tied:  # both shards are rows of the vocabulary: the same DTensor serves as both
        output.weight = embedding.weight


def conv1d_parallel(module: nn.Module, tp_mesh: Any, colwise: bool, sequence_parallel: bool = False) -> None:
    """GPT-2's ``Conv1D`` (``x @ weight + bias`` with ``weight`` ``[in, out]``, the transpose of ``nn.Linear``):
    column-wise splits ``weight`` along ``out`` (and the bias), row-wise along ``in`` with the partial sums
    all-reduced. Inputs and outputs cross the module as plain local tensors, as PyTorch's styles do."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    def partition(name: str, mod: nn.Module, mesh: Any) -> None:
        for key, placement in (("weight", Shard(1) if colwise else Shard(0)), ("bias", Shard(0) if colwise else None)):
            param = getattr(mod, key, None)
            if param is not None:
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement or Replicate()])))

    def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate() if colwise else Shard(-1)], run_check=False)
        return (x, *args[1:])

    def outputs(mod: nn.Module, out: Any, mesh: Any) -> torch.Tensor:
        if colwise:
            return out.to_local()
        # Row-wise partial sums: all-reduced, or reduce-scattered along the sequence with sequence parallelism.
        return out.redistribute(placements=[Shard(1) if sequence_parallel else Replicate()]).to_local()

    distribute_module(module, tp_mesh, partition, inputs, outputs)


def regroup_qkv(attention: nn.Module, tp_mesh: Any) -> None:
    """GPT-2 fuses q, k and v in one ``c_attn`` whose columns are ``[q | k | v]``. Split column-wise, a rank
    holds a contiguous third-and-a-bit of those, not its heads' q, k and v; the weight keeps the original
    layout (so checkpoints load anywhere), and after the projection the ranks all-gather the output and
    each keeps its heads' ``[q_r | k_r | v_r]`` (the backward reduce-scatters). The attention then runs on
    ``heads / tp`` heads per rank."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    hidden = attention.split_size  # q, k and v are each this wide in c_attn's output
    width = hidden // tp
    group = tp_mesh.get_group()

    def regroup(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        whole = all_gather_tensor_autograd(out.contiguous(), gather_dim=out.dim() - 1, group=group)
        parts = whole.split(hidden, dim=-1)
        return torch.cat([part[..., rank * width : (rank + 1) * width] for part in parts], dim=-1)

    attention.c_attn.register_forward_hook(regroup)
    attention.split_size = width


def split_sequence(tp_mesh: Any) -> Any:
    """A forward pre-hook keeping this rank's sequence shard of a whole (replicated) first argument; the
    backward all-gathers the shards' gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (x.redistribute(placements=[Shard(1)]).to_local(), *args[1:])

    return hook


# ------------------------------------------------------------------------------ a plan a config declares
def declared_plan(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard a Hugging Face model by the column/row-wise plan its config declares (``base_model_tp_plan``:
    LLaMA, Mistral, Qwen2 and the like), plus a vocabulary-parallel embedding and output layer."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config, name = getattr(model, "config", None), type(model).__name__
    declared = getattr(config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not hasattr(model, "get_input_embeddings") or not declared or any(s not in styles for s in declared.values()):
        raise ConfigError(
            f"--tensor-model-parallel-size: there is no tensor-parallel plan for {name}: its model family declares "
            "none and its config no column/row-wise plan (base_model_tp_plan, as LLaMA, Mistral and Qwen2 have)"
        )
    tp = tp_mesh.size()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    if sequence_parallel and not _llama_like(base):
        raise ConfigError(
            f"--sequence-parallel: {name}'s blocks are not LLaMA-style (input_layernorm, self_attn, "
            "post_attention_layernorm, mlp); drop it"
        )
    heads = config.num_attention_heads
    sizes = (
        ("--num-attention-heads", heads),
        ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
        ("--ffn-hidden-size", config.intermediate_size),
        ("the vocabulary size", config.vocab_size),
    )
    check_divisible(sizes, tp, of=name)
    plan: dict[str, Any] = {pattern: styles[style]() for pattern, style in declared.items()}
    if sequence_parallel:
        plan.update(_llama_sequence_parallel_plan(base, declared))
    elif _llama_like(base):
        plan.update(_shared_inputs_plan(Replicate()))
    parallelize_module(base, tp_mesh, plan)
    shard_vocabulary(model.get_input_embeddings(), model.get_output_embeddings(), tp_mesh, sequence_parallel)


def _llama_like(base: nn.Module) -> bool:
    layers = getattr(base, "layers", None)
    blocks = stack_blocks(layers) if layers is not None else []
    names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    return bool(blocks) and all(hasattr(b, n) for b in blocks for n in names) and hasattr(base, "norm")


def _shared_inputs_plan(residual: Any) -> dict[str, Any]:
    """A LLaMA-style block's attention and MLP inputs, arriving as ``residual`` (whole, or sequence shards), as one
    replicated DTensor each, so the column-wise q, k and v (gate and up) projections share it: their input
    gradients add up as partial sums and are all-reduced (reduce-scattered) once, as Megatron's are, not once per
    projection."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return {
        "layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": residual}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "layers.*.mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
    }


def _llama_sequence_parallel_plan(base: nn.Module, declared: dict[str, str]) -> dict[str, Any]:
    """Sequence parallelism for LLaMA-style decoders (as torchtitan lays out its LLaMA): the residual stream
    is split along the sequence from the first block on (the embedding, rotary angles and causal mask are
    computed whole, so positions stay right), norms run on sequence shards, attention and MLP all-gather
    their input and reduce-scatter their output, and the output layer all-gathers the final norm's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {
        "layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "layers.*.input_layernorm": SequenceParallel(),
        "layers.*.post_attention_layernorm": SequenceParallel(),
        **_shared_inputs_plan(Shard(1)),
        "norm": SequenceParallel(),
    }
    for pattern, style in declared.items():
        if style == "rowwise":  # the attention output and MLP down projections reduce-scatter
            plan[pattern] = RowwiseParallel(output_layouts=Shard(1))
    # A pipeline stage: only the first holds block 0 (later stages receive sequence shards), only the last
    # the final norm.
    layers = base.layers
    if not ("0" in layers if isinstance(layers, nn.ModuleDict) else len(layers) > 0):
        del plan["layers.0"]
    if base.norm is None:
        del plan["norm"]
    return plan
