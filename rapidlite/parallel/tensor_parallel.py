"""Tensor parallelism (``--tensor-model-parallel-size``) on DTensor, Megatron's layout.

Within each transformer block the q/k/v projections and the MLP's up/gate projections are split
column-wise (each rank computes its heads and its slice of the MLP), the attention output and MLP down
projections row-wise (one all-reduce per sub-layer). The word embedding is split along the vocabulary
and the output layer column-wise along the vocabulary: the logits stay sharded and the cross-entropy is
computed on the shards (``loss_parallel``), so the full ``[batch, seq, vocab]`` logits never exist on one
rank. ``--sequence-parallel`` also splits the norms, dropout and residual stream along the sequence
between the parallel regions (all-gather before attention/MLP, reduce-scatter after), as in Megatron.

The built-in GPT's plan is here; Hugging Face models that declare a column/row-wise plan in their config
(``base_model_tp_plan``: LLaMA, Mistral, Qwen2, ...) are split by it, with the same vocabulary-parallel
embedding and output. Other families (GPT-2's fused ``Conv1D`` attention, BERT) are refused with one line.

Dropout inside the parallel regions (attention probabilities of a rank's heads) draws from each rank's
RNG, which is seeded alike: the masks differ from a one-process run's, so bit-for-bit equality with one
process holds with dropout 0 (what the tests use); the training is statistically the same.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rapidlite.errors import ConfigError
from rapidlite.losses import loss_parallel_context, maybe_loss_parallel  # noqa: F401 (re-exported)
from rapidlite.models.spec import spec_of


def _check_divisible(model: torch.nn.Module, tp: int) -> None:
    c = model.config
    for flag, value in (
        ("--num-attention-heads", c.num_attention_heads),
        ("--hidden-size", c.hidden_size),
        ("--ffn-hidden-size", c.ffn_hidden_size),
    ):
        if value % tp:
            raise ConfigError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}")
    if c.padded_vocab_size % tp:
        raise ConfigError(
            f"the padded vocabulary ({c.padded_vocab_size}) is not divisible by --tensor-model-parallel-size {tp}: "
            f"set --make-vocab-size-divisible-by to a multiple of {tp}"
        )


def gpt_plan(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard the built-in GPT over ``tp_mesh`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    _check_divisible(model, tp_mesh.size())
    if sequence_parallel and any(
        hasattr(m, "normalized_shape") and not isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))
        for m in model.modules()
    ):
        raise ConfigError(
            "--sequence-parallel: the built-in GPT was built on CUDA with NVIDIA Apex's FusedLayerNorm, which "
            "cannot run on sequence shards; build the model on the CPU (rapidlite moves it to the GPU)"
        )
    residual = Shard(1) if sequence_parallel else Replicate()
    # A pipeline stage holds only some of these (see parallel.pipeline): each part is split if present.
    root: dict[str, Any] = {}
    if model.embedding is not None:
        # The embedding's output is whole on every rank (the vocabulary shards are summed), then split along
        # the sequence with sequence parallelism: position embeddings and dropout see the whole sequence.
        root["embedding.word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sequence_parallel and hasattr(model.embedding, "dropout"):
            root["embedding"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if model.output is not None:
        root["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        if sequence_parallel:
            root["final_norm"] = SequenceParallel()
    if root:
        parallelize_module(model, tp_mesh, root)
    blocks = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
    for block in blocks:
        plan: dict[str, Any] = {
            "attention.q_proj": ColwiseParallel(),
            "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.out_proj": RowwiseParallel(output_layouts=residual),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=residual),
        }
        if block.mlp.gate_proj is not None:
            plan["mlp.gate_proj"] = ColwiseParallel()
        if sequence_parallel:
            plan["input_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            )
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
    if model.tied and model.output is not None and model.embedding is not None:
        # Both shards are rows of the vocabulary: the same DTensor serves as both.
        model.output.weight = model.embedding.word_embeddings.weight


def hf_plan(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard a Hugging Face causal LM by the column/row-wise plan its config declares
    (``base_model_tp_plan``: LLaMA, Mistral, Qwen2 and the like), plus a vocabulary-parallel embedding and
    output layer as for the built-in GPT."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    name, config, tp = type(model).__name__, model.config, tp_mesh.size()
    declared = getattr(config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not declared or any(style not in styles for style in declared.values()):
        raise ConfigError(
            f"--tensor-model-parallel-size: there is no tensor-parallel plan for {name} yet; the built-in GPT "
            "and Hugging Face models with a column/row-wise plan (LLaMA, Mistral, Qwen2, ...) have one"
        )
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    if sequence_parallel and not _llama_like(base):
        raise ConfigError(
            f"--sequence-parallel: {name}'s blocks are not LLaMA-style (input_layernorm, self_attn, "
            "post_attention_layernorm, mlp); drop it"
        )
    heads = config.num_attention_heads
    for flag, value in (
        ("--num-attention-heads", heads),
        ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
        ("--ffn-hidden-size", config.intermediate_size),
        ("the vocabulary size", config.vocab_size),
    ):
        if value % tp:
            raise ConfigError(f"{flag} {value} of {name} is not divisible by --tensor-model-parallel-size {tp}")
    plan: dict[str, Any] = {pattern: styles[style]() for pattern, style in declared.items()}
    residual = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        plan.update(_llama_sequence_parallel_plan(base, declared))
    parallelize_module(base, tp_mesh, plan)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and embedding is not None and output.weight is embedding.weight
    # A pipeline stage may hold neither (see parallel.pipeline).
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if output is not None:
        parallelize_module(
            output, tp_mesh, ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        )
    if tied:
        output.weight = embedding.weight


def _conv1d_parallel(module: torch.nn.Module, tp_mesh: Any, colwise: bool, sequence_parallel: bool = False) -> None:
    """GPT-2's ``Conv1D`` (``x @ weight + bias`` with ``weight`` ``[in, out]``, the transpose of ``nn.Linear``):
    column-wise splits ``weight`` along ``out`` (and the bias), row-wise along ``in`` with the partial sums
    all-reduced. Inputs and outputs cross the module as plain local tensors, as PyTorch's styles do."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

    def partition(name: str, mod: torch.nn.Module, mesh: Any) -> None:
        for key, placement in (("weight", Shard(1) if colwise else Shard(0)), ("bias", Shard(0) if colwise else None)):
            param = getattr(mod, key, None)
            if param is not None:
                mod.register_parameter(
                    key, torch.nn.Parameter(distribute_tensor(param, mesh, [placement or Replicate()]))
                )

    def inputs(mod: torch.nn.Module, args: tuple, mesh: Any) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate() if colwise else Shard(-1)], run_check=False)
        return (x, *args[1:])

    def outputs(mod: torch.nn.Module, out: Any, mesh: Any) -> torch.Tensor:
        if colwise:
            return out.to_local()
        # Row-wise partial sums: all-reduced, or reduce-scattered along the sequence with sequence parallelism.
        return out.redistribute(placements=[Shard(1) if sequence_parallel else Replicate()]).to_local()

    distribute_module(module, tp_mesh, partition, inputs, outputs)


def _regroup_qkv(attention: torch.nn.Module, tp_mesh: Any) -> None:
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

    def regroup(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        whole = all_gather_tensor_autograd(out.contiguous(), gather_dim=out.dim() - 1, group=group)
        parts = whole.split(hidden, dim=-1)
        return torch.cat([part[..., rank * width : (rank + 1) * width] for part in parts], dim=-1)

    attention.c_attn.register_forward_hook(regroup)
    attention.split_size = width


def gpt2_plan(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard Hugging Face GPT-2 Megatron's way: ``c_attn`` and ``c_fc`` column-wise, both ``c_proj`` row-wise,
    the word embedding and ``lm_head`` along the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config, tp = model.config, tp_mesh.size()
    if getattr(config, "add_cross_attention", False):
        raise ConfigError("--tensor-model-parallel-size: GPT-2 with cross-attention has no tensor-parallel plan")
    for flag, value in (
        ("--num-attention-heads", config.n_head),
        ("--hidden-size", config.n_embd),
        ("the MLP size", config.n_inner or 4 * config.n_embd),
        ("the vocabulary size", config.vocab_size),
    ):
        if value % tp:
            raise ConfigError(f"{flag} {value} of GPT-2 is not divisible by --tensor-model-parallel-size {tp}")
    transformer = model.transformer
    blocks = transformer.h.values() if isinstance(transformer.h, torch.nn.ModuleDict) else transformer.h
    sp = sequence_parallel
    for block in blocks:
        _conv1d_parallel(block.attn.c_attn, tp_mesh, colwise=True)
        _regroup_qkv(block.attn, tp_mesh)
        _conv1d_parallel(block.attn.c_proj, tp_mesh, colwise=False, sequence_parallel=sp)
        _conv1d_parallel(block.mlp.c_fc, tp_mesh, colwise=True)
        _conv1d_parallel(block.mlp.c_proj, tp_mesh, colwise=False, sequence_parallel=sp)
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            parallelize_module(
                block, tp_mesh, {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather}
            )
    if sp:
        h = transformer.h
        first = (h["0"] if "0" in h else None) if isinstance(h, torch.nn.ModuleDict) else h[0]
        if first is not None:  # the residual stream is split along the sequence from the first block on
            first.register_forward_pre_hook(_split_sequence(tp_mesh))
        if transformer.ln_f is not None:
            parallelize_module(transformer.ln_f, tp_mesh, SequenceParallel())
    residual = Shard(1) if sp else Replicate()
    embedding, output = transformer.wte, model.lm_head  # either may be absent on a pipeline stage
    tied = output is not None and embedding is not None and output.weight is embedding.weight
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if output is not None:
        parallelize_module(
            output, tp_mesh, ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        )
    if tied:
        output.weight = embedding.weight


def _split_sequence(tp_mesh: Any) -> Any:
    """A forward pre-hook keeping this rank's sequence shard of a whole (replicated) first argument; the
    backward all-gathers the shards' gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        x = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (x.redistribute(placements=[Shard(1)]).to_local(), *args[1:])

    return hook


def _llama_like(base: torch.nn.Module) -> bool:
    layers = getattr(base, "layers", None)
    blocks = list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers or [])
    names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    return bool(blocks) and all(hasattr(b, n) for b in blocks for n in names) and hasattr(base, "norm")


def _llama_sequence_parallel_plan(base: torch.nn.Module, declared: dict[str, str]) -> dict[str, Any]:
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
        "layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "norm": SequenceParallel(),
    }
    for pattern, style in declared.items():
        if style == "rowwise":  # the attention output and MLP down projections reduce-scatter
            plan[pattern] = RowwiseParallel(output_layouts=Shard(1))
    # A pipeline stage: only the first holds block 0 (later stages receive sequence shards), only the last
    # the final norm.
    layers = base.layers
    if not ("0" in layers if isinstance(layers, torch.nn.ModuleDict) else len(layers) > 0):
        del plan["layers.0"]
    if base.norm is None:
        del plan["norm"]
    return plan


def bert_plan(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard Hugging Face BERT (``BertForPreTraining``/``BertForMaskedLM``) Megatron's way: query/key/value and
    the intermediate projection column-wise, the attention output and output projections row-wise, the
    word embedding and the masked-LM decoder along the vocabulary. The model computes its masked-LM and
    next-sentence losses itself, on whole logits, so the decoder's vocabulary shards are all-gathered
    (the one place the full logits exist); pooler, NSP head and norms are replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config, tp, name = model.config, tp_mesh.size(), type(model).__name__
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not implemented for {name}: drop it")
    for flag, value in (
        ("--num-attention-heads", config.num_attention_heads),
        ("--hidden-size", config.hidden_size),
        ("--ffn-hidden-size", config.intermediate_size),
        ("the vocabulary size", config.vocab_size),
    ):
        if value % tp:
            raise ConfigError(f"{flag} {value} of {name} is not divisible by --tensor-model-parallel-size {tp}")
    layer_plan = {
        "attention.self.query": ColwiseParallel(),
        "attention.self.key": ColwiseParallel(),
        "attention.self.value": ColwiseParallel(),
        "attention.output.dense": RowwiseParallel(),
        "intermediate.dense": ColwiseParallel(),
        "output.dense": RowwiseParallel(),
    }
    layers = model.bert.encoder.layer
    for layer in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    # A pipeline stage may hold neither the embedding nor the heads (see parallel.pipeline).
    embeddings = model.bert.embeddings
    embedding = embeddings.word_embeddings if embeddings is not None else None
    head = model.cls.predictions if model.cls is not None else None
    tied_weight = head is not None and embedding is not None and head.decoder.weight is embedding.weight
    tied_bias = head is not None and head.decoder.bias is not None and head.decoder.bias is head.bias
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        parallelize_module(head.decoder, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    if tied_weight:
        head.decoder.weight = embedding.weight
    if tied_bias:
        head.bias = head.decoder.bias


# A plan per model family (``rapidlite.models.spec``), with the head it needs; a Hugging Face model of any other
# family (or head) takes the column/row-wise plan its config declares.
_FAMILY_PLANS: dict[str, tuple[Any, str | None]] = {
    "gpt": (gpt_plan, None),
    "gpt2": (gpt2_plan, "lm_head"),  # the causal LM: c_attn/c_fc/c_proj and a vocabulary-parallel lm_head
    "bert": (bert_plan, "cls"),  # pretraining and masked LM: the MLM decoder sharded with the embedding
}


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> torch.nn.Module:
    plan, head = _FAMILY_PLANS.get(spec_of(model).family, (None, None))
    if plan is not None and (head is None or hasattr(model, head)):
        plan(model, tp_mesh, sequence_parallel)
        return model
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        hf_plan(model, tp_mesh, sequence_parallel)
        return model
    raise ConfigError(
        f"--tensor-model-parallel-size: there is no tensor-parallel plan for {type(model).__name__}; the built-in "
        "GPT and Hugging Face models with a column/row-wise plan (LLaMA, Mistral, Qwen2, ...) have one"
    )


def backward_context() -> contextlib.AbstractContextManager:
    return loss_parallel_context()
