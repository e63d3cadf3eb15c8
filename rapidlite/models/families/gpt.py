"""The built-in GPT (``rapidlite.models.gpt``) as a model family: its spec, tensor-parallel plan and pipeline
split, beside the model code."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rapidlite.config.moe import BUILT_IN_AUX_COEFF
from rapidlite.errors import ConfigError
from rapidlite.models.gpt import GPTModel, rope_angles
from rapidlite.models.gpt_hf import save_for_transformers
from rapidlite.models.head import chunked_head_loss, chunks_loss, kept_tokens
from rapidlite.models.sharding import check_divisible, stack_blocks
from rapidlite.models.spec import EXPERTS, ModelSpec, MoELayout, blocks_at, register
from rapidlite.models.staging import Call, Holder, bind_call


def gpt_plan(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard the built-in GPT over ``tp_mesh`` in place (see ``rapidlite.models.sharding`` for the layout)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    c, tp = model.config, tp_mesh.size()
    if c.num_experts:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp}: the built-in GPT's experts (--num-experts) are not split that way; "
            "train it with data parallelism and ZeRO"
        )
    sizes = (
        ("--num-attention-heads", c.num_attention_heads),
        ("--hidden-size", c.hidden_size),
        ("--ffn-hidden-size", c.ffn_hidden_size),
    )
    check_divisible(sizes, tp)
    if c.padded_vocab_size % tp:
        raise ConfigError(
            f"the padded vocabulary ({c.padded_vocab_size}) is not divisible by --tensor-model-parallel-size {tp}: "
            f"set --make-vocab-size-divisible-by to a multiple of {tp}"
        )
    if sequence_parallel and any(
        hasattr(m, "normalized_shape") and not isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules()
    ):
        raise ConfigError(
            "--sequence-parallel: the built-in GPT was built on CUDA with NVIDIA Apex's FusedLayerNorm, which "
            "cannot run on sequence shards; build the model on the CPU (rapidlite moves it to the GPU)"
        )
    residual = Shard(1) if sequence_parallel else Replicate()
    # A pipeline stage holds only some of these (see PipelineRunner): each part is split if present.
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
    for block in stack_blocks(model.layers):
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
        # The attention's and MLP's input enters as one replicated DTensor (all-gathered from sequence shards
        # with sequence parallelism), so q, k and v (gate and up) share it: their input gradients are summed
        # as partial sums and reduced once, Megatron's one all-reduce, not once per projection.
        if sequence_parallel:
            plan["input_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
        plan["attention"] = PrepareModuleInput(
            input_layouts=(residual, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
    if model.tied and model.output is not None and model.embedding is not None:
        # Both shards are rows of the vocabulary: the same DTensor serves as both.
        model.output.weight = model.embedding.word_embeddings.weight


class GPTSplit:
    """The built-in GPT in stages: ``embedding`` → ``layers`` → ``final_norm`` → ``output``."""

    name = "built-in GPT"

    def unsupported(self, model: nn.Module) -> str | None:
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return stack_blocks(model.layers)

    def tied(self, model: nn.Module) -> bool:
        return model.tied

    def prune(self, model: nn.Module, keep: list[int], has_first: bool, has_last: bool) -> None:
        blocks = self.blocks(model)
        model.layers = nn.ModuleDict({str(i): blocks[i] for i in keep})
        if not has_first:
            model.embedding = Holder(model.embedding.word_embeddings) if has_last and model.tied else None
        if not has_last:
            model.final_norm = None
            model.output = None

    def stage_parts(self, model: nn.Module, first: bool, last: bool) -> dict[str, nn.Module]:
        parts: dict[str, nn.Module] = {}
        if first or (last and model.tied):
            parts["embedding"] = model.embedding
        if last:
            parts["final_norm"] = model.final_norm
            parts["output"] = model.output
        return parts

    def word_embedding(self, stage: nn.Module) -> nn.Module | None:
        return getattr(getattr(stage, "embedding", None), "word_embeddings", None)

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        names = ("input_ids", "position_ids", "attention_mask", "labels", "loss_mask", "segment_ids")
        values = bind_call(GPTModel.forward.__get__(model), args, kwargs, names, self.name)
        input_ids = values["input_ids"]
        b, s = input_ids.shape
        position_ids = values["position_ids"]
        if position_ids is None:
            c = model.config
            if c.position_embedding_type == "learned_absolute" and s > c.max_position_embeddings:
                raise ConfigError(f"input length {s} exceeds --max-position-embeddings {c.max_position_embeddings}")
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        mask = values["attention_mask"]
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be bool (True = attend), got {mask.dtype}")
        labels = values["labels"]
        loss = {"labels": labels, "loss_mask": values["loss_mask"], "per_token": model.per_token_loss}
        loss["chunked"] = chunks_loss(model.output, labels, model.chunked_loss)  # read on the last stage
        # Under context parallelism each stage's attention reads the shard's documents (``segment_ids``).
        stage = {"position_ids": position_ids, "attention_mask": mask, "segment_ids": values["segment_ids"]}
        return Call(input_ids, stage, loss)

    def run(self, stage: nn.Module, x: torch.Tensor, call: Call) -> torch.Tensor:
        c = stage.config
        position_ids, mask = call.stage_kwargs["position_ids"], call.stage_kwargs["attention_mask"]
        segment_ids = call.stage_kwargs["segment_ids"]
        if stage.first:
            x = stage.embedding(x, position_ids)
        rope = rope_angles(position_ids, c.head_dim, c.rotary_base) if c.position_embedding_type == "rope" else None
        for layer in stage.layers.values():
            x = layer(x, rope, mask, segment_ids)
        if not stage.last:
            return x
        hidden, loss = stage.final_norm(x), call.loss_kwargs
        if loss["chunked"]:  # the loss (per token, or summed) in place of the logits
            result = chunked_head_loss(stage.output, hidden, loss["labels"], loss["loss_mask"], loss["per_token"])
            return result if loss["per_token"] else result[0]
        return stage.output(hidden)

    def finish(self, model: nn.Module, output: torch.Tensor, call: Call) -> Any:
        labels, loss_mask = call.loss_kwargs["labels"], call.loss_kwargs["loss_mask"]
        if not call.loss_kwargs["chunked"]:
            return model.head_output(output, labels, loss_mask)
        return output if model.per_token_loss else (output, int(kept_tokens(labels, loss_mask).sum().item()))


SPEC = register(
    ModelSpec(
        family="gpt",
        matches=lambda model: isinstance(model, GPTModel),
        blocks=blocks_at("layers"),
        size_keys={
            "num_layers": ("num_layers",),
            "hidden_size": ("hidden_size",),
            "num_attention_heads": ("num_attention_heads",),
            "ffn_hidden_size": ("ffn_hidden_size",),
        },
        hidden_dropout_keys=("hidden_dropout",),
        attention_dropout_keys=("attention_dropout",),
        tensor_parallel=gpt_plan,
        pipeline=GPTSplit(),
        lora_targets=("q_proj", "k_proj", "v_proj", "out_proj", "up_proj", "gate_proj", "down_proj", EXPERTS),
        save=save_for_transformers,  # GPT-2's, LLaMA's or Mixtral's layout, which transformers loads
        # With --num-experts (rapidlite.models.gpt_moe); Megatron's losses and default weight.
        moe=MoELayout(
            router="router",
            expert_parameters=("gate_up_proj", "up_proj", "down_proj"),
            shared=("shared_experts",),
            default_aux_coeff=BUILT_IN_AUX_COEFF,
            per_layer=True,
        ),
    )
)
