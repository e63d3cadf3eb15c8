"""Hugging Face GPT-2: fused ``Conv1D`` projections (``c_attn`` = q|k|v, ``c_proj``, ``c_fc``) in
``transformer.h``. Its tensor-parallel plan splits them Megatron's way; its pipeline stages are the decoder
split of ``transformer.wte`` + ``wpe`` → ``transformer.h`` → ``transformer.ln_f`` → ``lm_head``."""

from __future__ import annotations

from typing import Any

from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.models.sharding import (
    check_divisible,
    conv1d_parallel,
    regroup_qkv,
    shard_vocabulary,
    split_sequence,
    stack_blocks,
)
from rapidlite.models.spec import ModelSpec, blocks_at, register
from rapidlite.models.staging import DecoderSplit


def gpt2_plan(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard GPT-2 with a language-model head Megatron's way: ``c_attn`` and ``c_fc`` column-wise, both
    ``c_proj`` row-wise, the word embedding and ``lm_head`` along the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

    config, tp = model.config, tp_mesh.size()
    if not hasattr(model, "lm_head"):
        raise ConfigError(
            f"--tensor-model-parallel-size: the gpt2 family's plan splits GPT-2 language models (an lm_head), "
            f"not {type(model).__name__}"
        )
    if getattr(config, "add_cross_attention", False):
        raise ConfigError("--tensor-model-parallel-size: GPT-2 with cross-attention has no tensor-parallel plan")
    sizes = (
        ("--num-attention-heads", config.n_head),
        ("--hidden-size", config.n_embd),
        ("the MLP size", config.n_inner or 4 * config.n_embd),
        ("the vocabulary size", config.vocab_size),
    )
    check_divisible(sizes, tp, of="GPT-2")
    transformer, sp = model.transformer, sequence_parallel
    for block in stack_blocks(transformer.h):
        conv1d_parallel(block.attn.c_attn, tp_mesh, colwise=True)
        regroup_qkv(block.attn, tp_mesh)
        conv1d_parallel(block.attn.c_proj, tp_mesh, colwise=False, sequence_parallel=sp)
        conv1d_parallel(block.mlp.c_fc, tp_mesh, colwise=True)
        conv1d_parallel(block.mlp.c_proj, tp_mesh, colwise=False, sequence_parallel=sp)
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            parallelize_module(
                block, tp_mesh, {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather}
            )
    if sp:
        h = transformer.h
        first = (h["0"] if "0" in h else None) if isinstance(h, nn.ModuleDict) else h[0]
        if first is not None:  # the residual stream is split along the sequence from the first block on
            first.register_forward_pre_hook(split_sequence(tp_mesh))
        if transformer.ln_f is not None:
            parallelize_module(transformer.ln_f, tp_mesh, SequenceParallel())
    shard_vocabulary(transformer.wte, model.lm_head, tp_mesh, sp)  # either may be absent on a pipeline stage


SPEC = register(
    ModelSpec(
        family="gpt2",
        model_types=("gpt2",),
        blocks=blocks_at("transformer", "h"),
        size_keys={
            "num_layers": ("n_layer",),
            "hidden_size": ("n_embd",),
            "num_attention_heads": ("n_head",),
            "ffn_hidden_size": ("n_inner",),
        },
        hidden_dropout_keys=("resid_pdrop", "embd_pdrop"),
        attention_dropout_keys=("attn_pdrop",),
        tensor_parallel=gpt2_plan,
        pipeline=DecoderSplit("transformer", "wte", "h", "ln_f", pos="wpe", drop="drop"),
        lora_targets=("c_attn", "c_proj", "c_fc"),
    )
)
