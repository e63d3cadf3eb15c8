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
from collections.abc import Iterator
from typing import Any

import torch

from rapidlite.errors import ConfigError


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
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is implemented for the built-in GPT only, not {name}: drop it")
    heads = config.num_attention_heads
    for flag, value in (
        ("--num-attention-heads", heads),
        ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
        ("--ffn-hidden-size", config.intermediate_size),
        ("the vocabulary size", config.vocab_size),
    ):
        if value % tp:
            raise ConfigError(f"{flag} {value} of {name} is not divisible by --tensor-model-parallel-size {tp}")
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    parallelize_module(base, tp_mesh, {pattern: styles[style]() for pattern, style in declared.items()})
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and embedding is not None and output.weight is embedding.weight
    # A pipeline stage may hold neither (see parallel.pipeline).
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if output is not None:
        parallelize_module(output, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    if tied:
        output.weight = embedding.weight


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, sequence_parallel: bool) -> torch.nn.Module:
    from rapidlite.models.gpt import GPTModel

    if isinstance(model, GPTModel):
        gpt_plan(model, tp_mesh, sequence_parallel)
        return model
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        hf_plan(model, tp_mesh, sequence_parallel)
        return model
    raise ConfigError(
        f"--tensor-model-parallel-size: there is no tensor-parallel plan for {type(model).__name__}; the built-in "
        "GPT and Hugging Face models with a column/row-wise plan (LLaMA, Mistral, Qwen2, ...) have one"
    )


_loss_parallel_depth = 0


@contextlib.contextmanager
def loss_parallel_context() -> Iterator[None]:
    """``loss_parallel``, re-entrant: PyTorch's switches the parallel cross-entropy off on any exit, so a
    nested use (the forward's inside a pipeline step's backward) would leave the backward without it."""
    global _loss_parallel_depth
    if _loss_parallel_depth:
        _loss_parallel_depth += 1
        try:
            yield
        finally:
            _loss_parallel_depth -= 1
        return
    from torch.distributed.tensor.parallel import loss_parallel

    _loss_parallel_depth = 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_depth = 0


@contextlib.contextmanager
def maybe_loss_parallel(logits: torch.Tensor) -> Iterator[None]:
    """``loss_parallel`` when the logits are vocabulary-sharded DTensors (forward and backward need it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        with loss_parallel_context():
            yield
    else:
        yield


def backward_context() -> contextlib.AbstractContextManager:
    return loss_parallel_context()
