"""Hugging Face BERT and RoBERTa encoders (``<base>.encoder.layer``). The tensor-parallel plan and the pipeline
split cover BERT for pretraining and masked LM (``BertForPreTraining``, ``BertForMaskedLM``: a ``cls`` head over
``bert``); other heads are refused with one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.models.head import replicated_output
from rapidlite.models.sharding import check_divisible, stack_blocks
from rapidlite.models.spec import ModelSpec, largest_stack, layer_stack, register
from rapidlite.models.staging import Call, Holder, bind_call

_HEADS = "BERT for pretraining or masked LM (a cls head over bert)"


def _has_pretraining_head(model: nn.Module) -> bool:
    # RoBERTa-style models name their base and head otherwise.
    return hasattr(model, "cls") and hasattr(model, "bert")


def bert_plan(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Shard BERT Megatron's way: query/key/value and the intermediate projection column-wise, the attention
    output and output projections row-wise, the word embedding and the masked-LM decoder along the
    vocabulary. The model computes its masked-LM and next-sentence losses itself, on whole logits, so the
    decoder's vocabulary shards are all-gathered (the one place the full logits exist); pooler, NSP head and
    norms are replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    config, tp, name = model.config, tp_mesh.size(), type(model).__name__
    if not _has_pretraining_head(model):
        raise ConfigError(f"--tensor-model-parallel-size: the bert family's plan splits {_HEADS}, not {name}")
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not implemented for {name}: drop it")
    sizes = (
        ("--num-attention-heads", config.num_attention_heads),
        ("--hidden-size", config.hidden_size),
        ("--ffn-hidden-size", config.intermediate_size),
        ("the vocabulary size", config.vocab_size),
    )
    check_divisible(sizes, tp, of=name)
    layer_plan = {
        # query, key and value share one replicated input: its gradient is all-reduced once, not three times
        "attention.self": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "attention.self.query": ColwiseParallel(),
        "attention.self.key": ColwiseParallel(),
        "attention.self.value": ColwiseParallel(),
        "attention.output.dense": RowwiseParallel(),
        "intermediate.dense": ColwiseParallel(),
        "output.dense": RowwiseParallel(),
    }
    for layer in stack_blocks(model.bert.encoder.layer):
        parallelize_module(layer, tp_mesh, layer_plan)
    # A pipeline stage may hold neither the embedding nor the heads (see BertSplit.prune).
    embeddings = model.bert.embeddings
    embedding = embeddings.word_embeddings if embeddings is not None else None
    head = model.cls.predictions if model.cls is not None else None
    tied_weight = head is not None and embedding is not None and head.decoder.weight is embedding.weight
    tied_bias = head is not None and head.decoder.bias is not None and head.decoder.bias is head.bias
    if embedding is not None:
        parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        parallelize_module(head.decoder, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        replicated_output(head.decoder)
    if tied_weight:
        head.decoder.weight = embedding.weight
    if tied_bias:
        head.bias = head.decoder.bias


class BertSplit:
    """BERT for pretraining in stages: ``bert.embeddings`` → ``bert.encoder.layer`` → ``bert.pooler`` + ``cls``
    (masked-LM decoder, next-sentence head)."""

    name = "Hugging Face BERT"

    def unsupported(self, model: nn.Module) -> str | None:
        return None if _has_pretraining_head(model) else f"it splits {_HEADS}"

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return stack_blocks(model.bert.encoder.layer)

    def tied(self, model: nn.Module) -> bool:
        embeddings = model.bert.embeddings
        return (
            model.cls is not None
            and embeddings is not None
            and model.cls.predictions.decoder.weight is embeddings.word_embeddings.weight
        )

    def prune(self, model: nn.Module, keep: list[int], has_first: bool, has_last: bool) -> None:
        blocks, tied = self.blocks(model), self.tied(model)
        model.bert.encoder.layer = nn.ModuleDict({str(i): blocks[i] for i in keep})
        if not has_first:
            model.bert.embeddings = Holder(model.bert.embeddings.word_embeddings) if has_last and tied else None
        if not has_last:
            model.bert.pooler = None
            model.cls = None

    def stage_parts(self, model: nn.Module, first: bool, last: bool) -> dict[str, nn.Module]:
        parts: dict[str, nn.Module] = {}
        if first or (last and model.bert.embeddings is not None):
            parts["embeddings"] = model.bert.embeddings
        if last:
            if model.bert.pooler is not None:
                parts["pooler"] = model.bert.pooler
            parts["cls"] = model.cls
        return parts

    def word_embedding(self, stage: nn.Module) -> nn.Module | None:
        return getattr(getattr(stage, "embeddings", None), "word_embeddings", None)

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        names = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "next_sentence_label")
        values = bind_call(type(model).forward.__get__(model), args, kwargs, names, self.name)
        if values["input_ids"] is None:
            raise ConfigError("under pipeline parallelism pass input_ids to the model (inputs_embeds is not supported)")
        stage = {k: values[k] for k in ("attention_mask", "token_type_ids", "position_ids")}
        return Call(values["input_ids"], stage, {k: values[k] for k in ("labels", "next_sentence_label")})

    def run(self, stage: nn.Module, x: torch.Tensor, call: Call) -> Any:
        from transformers.masking_utils import create_bidirectional_mask

        kwargs = call.stage_kwargs
        if stage.first:
            x = stage.embeddings(
                input_ids=x, token_type_ids=kwargs["token_type_ids"], position_ids=kwargs["position_ids"]
            )
        mask = create_bidirectional_mask(config=stage.config, inputs_embeds=x, attention_mask=kwargs["attention_mask"])
        for layer in stage.layers.values():
            x = layer(x, mask)
            if isinstance(x, tuple):
                x = x[0]
        if not stage.last:
            return x
        if hasattr(stage, "pooler"):
            return stage.cls(x, stage.pooler(x))  # (masked-LM logits, next-sentence logits)
        return stage.cls(x)

    def finish(self, model: nn.Module, output: Any, call: Call) -> Any:
        import torch.nn.functional as F
        from transformers.models.bert.modeling_bert import BertForPreTrainingOutput, MaskedLMOutput

        labels, next_sentence = call.loss_kwargs["labels"], call.loss_kwargs["next_sentence_label"]
        vocab = model.config.vocab_size
        if isinstance(output, tuple):
            scores, relationship = output
            loss = None
            if labels is not None and next_sentence is not None:
                loss = F.cross_entropy(scores.view(-1, vocab), labels.view(-1)) + F.cross_entropy(
                    relationship.view(-1, 2), next_sentence.view(-1)
                )
            return BertForPreTrainingOutput(loss=loss, prediction_logits=scores, seq_relationship_logits=relationship)
        loss = F.cross_entropy(output.view(-1, vocab), labels.view(-1)) if labels is not None else None
        return MaskedLMOutput(loss=loss, logits=output)


def _bert_blocks(model: nn.Module) -> Sequence[nn.Module] | None:
    encoder = getattr(getattr(model, "base_model", model), "encoder", None)
    return layer_stack(getattr(encoder, "layer", None)) or largest_stack(model)


SPEC = register(
    ModelSpec(
        family="bert",
        model_types=("bert", "roberta", "xlm-roberta"),
        blocks=_bert_blocks,
        hidden_dropout_keys=("hidden_dropout_prob",),
        attention_dropout_keys=("attention_probs_dropout_prob",),
        tensor_parallel=bert_plan,
        pipeline=BertSplit(),
        lora_targets=("query", "key", "value", "dense"),
    )
)
