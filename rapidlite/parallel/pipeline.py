"""Pipeline parallelism (``--pipeline-model-parallel-size``) on ``torch.distributed.pipelining``.

The transformer blocks are split into stages (evenly, or by ``--pipeline-split``): the embedding goes
with the first stage, the final norm and output layer with the last. Each rank keeps the model object it
was given, pruned in place to its own stages, so parameter names (and checkpoints) stay those of the
whole model: ``layers`` becomes a ``ModuleDict`` keyed by the global block index (``layers.5.…`` is the
same name either way). The stages themselves are thin modules over the same blocks, run by the schedule
(``--pipeline-schedule gpipe | 1f1b | interleaved-1f1b``; the interleaved one with
``--num-layers-per-virtual-pipeline-stage``, rank r holding stages r, r + pp, r + 2pp, ...).

The forward step a user wrote for one process runs unchanged. For each micro-batch of a global batch
the engine first runs the step with a stand-in model that records the call (``model(tokens,
position_ids=..., labels=...)``) and stops it there; the schedule then runs the stages on the recorded
inputs, and on the last stage the step runs again with the stand-in returning what the whole model would
have returned (logits, or the loss when labels were passed), so the user's own loss code computes the
loss the schedule back-propagates. The micro-batches of a global batch are the pipeline's micro-batches,
as in Megatron (``--num-micro-batches`` is the accumulation), and the loss reported is the last stage's,
shared with the pipeline's other ranks.

A tied input/output embedding (the built-in GPT's default, GPT-2) lives on the first and the last stage,
as in Megatron: both copies start equal, their gradients are summed over the two stages before each
step, and the gradient norm counts the weight once, so they stay equal and train as one weight.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.losses import loss_parallel_context, unpack_loss
from rapidlite.models.spec import spec_of


# ------------------------------------------------------------------------------------------ layout
def stage_layer_ids(num_layers: int, num_stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """The block indices of each stage: ``split`` (layers per stage) or as even as possible, earlier stages
    taking one more when the layers do not divide."""
    if split is not None:
        if len(split) != num_stages:
            raise ConfigError(
                f"--pipeline-split gives {len(split)} stages but the pipeline has {num_stages} "
                "(pipeline size x virtual stages per rank): give one layer count per stage"
            )
        if sum(split) != num_layers or min(split) < 1:
            raise ConfigError(
                f"--pipeline-split {','.join(map(str, split))} must give every stage at least one layer and add up "
                f"to the model's {num_layers} layers"
            )
        counts = list(split)
    else:
        if num_layers < num_stages:
            raise ConfigError(
                f"the model has {num_layers} layers, fewer than its {num_stages} pipeline stages: lower "
                "--pipeline-model-parallel-size (or the virtual stages) or add layers"
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ids, start = [], 0
    for count in counts:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def local_stage_indices(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """Looped placement: rank r runs stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp_size for v in range(virtual)]


# ------------------------------------------------------------------------------------------ model families
@dataclass
class Call:
    """One recorded call of the whole model, split into what the stages need."""

    inputs: torch.Tensor  # the first stage's input (token ids)
    stage_kwargs: dict[str, Any] = field(default_factory=dict)  # every stage (positions, masks)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # the last stage's loss (labels, loss mask)


class _Holder(nn.Module):
    """Keeps a tied word embedding on the last stage under its original name (``embedding.word_embeddings``)."""

    def __init__(self, word_embeddings: nn.Module) -> None:
        super().__init__()
        self.word_embeddings = word_embeddings


def _bind(forward: Callable, args: tuple, kwargs: dict, supported: Sequence[str], family: str) -> dict[str, Any]:
    bound = inspect.signature(forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    extra = values.pop("kwargs", None) or {}
    values.update(extra)
    for name, value in values.items():
        if name not in supported and value not in (None, False, 0):
            raise ConfigError(
                f"under pipeline parallelism the {family} model takes {', '.join(supported)}; "
                f"the forward step passed {name}"
            )
    return {name: values.get(name) for name in supported}


class GPTFamily:
    """The built-in GPT: ``embedding`` → ``layers`` → ``final_norm`` → ``output``."""

    name = "built-in GPT"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return spec_of(model).family == "gpt"

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)

    def tied(self, model: nn.Module) -> bool:
        return model.tied

    def prune(self, model: nn.Module, keep: list[int], has_first: bool, has_last: bool) -> None:
        blocks = self.blocks(model)
        model.layers = nn.ModuleDict({str(i): blocks[i] for i in keep})
        if not has_first:
            model.embedding = _Holder(model.embedding.word_embeddings) if has_last and model.tied else None
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

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        from rapidlite.models.gpt import GPTModel

        names = ("input_ids", "position_ids", "attention_mask", "labels", "loss_mask")
        values = _bind(GPTModel.forward.__get__(model), args, kwargs, names, self.name)
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
        return Call(
            input_ids,
            {"position_ids": position_ids, "attention_mask": mask},
            {"labels": values["labels"], "loss_mask": values["loss_mask"]},
        )

    def run(self, stage: StageModule, x: torch.Tensor, call: Call) -> torch.Tensor:
        from rapidlite.models.gpt import rope_angles

        c = stage.config
        position_ids, mask = call.stage_kwargs["position_ids"], call.stage_kwargs["attention_mask"]
        if stage.first:
            x = stage.embedding(x, position_ids)
        rope = rope_angles(position_ids, c.head_dim, c.rotary_base) if c.position_embedding_type == "rope" else None
        for layer in stage.layers.values():
            x = layer(x, rope, mask)
        if stage.last:
            return stage.output(stage.final_norm(x))
        return x

    def finish(self, model: nn.Module, logits: torch.Tensor, call: Call) -> Any:
        return model.head_output(logits, call.loss_kwargs["labels"], call.loss_kwargs["loss_mask"])


class HFDecoderFamily:
    """Hugging Face decoder-only LMs: ``<base>.<embed> [+ <pos>] → <base>.<layers> → <base>.<norm> →
    lm_head``. LLaMA/Mistral/Qwen2-style (``model.embed_tokens``, rotary) and GPT-2 (``transformer.wte`` +
    ``wpe``) share it."""

    def __init__(self, base: str, embed: str, layers: str, norm: str, pos: str | None, drop: str | None) -> None:
        self.base, self.embed, self.layers, self.norm, self.pos, self.drop = base, embed, layers, norm, pos, drop
        self.name = f"Hugging Face ({base}.{layers})"

    def matches(self, model: nn.Module) -> bool:
        base = getattr(model, self.base, None)
        return (
            base is not None
            and hasattr(model, "lm_head")
            and all(hasattr(base, a) for a in (self.embed, self.layers, self.norm))
            and (self.pos is None or hasattr(base, self.pos))
        )

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers = getattr(getattr(model, self.base), self.layers)
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

    def tied(self, model: nn.Module) -> bool:
        embed = getattr(getattr(model, self.base), self.embed)
        return model.lm_head is not None and embed is not None and model.lm_head.weight is embed.weight

    def prune(self, model: nn.Module, keep: list[int], has_first: bool, has_last: bool) -> None:
        base, blocks, tied = getattr(model, self.base), self.blocks(model), self.tied(model)
        setattr(base, self.layers, nn.ModuleDict({str(i): blocks[i] for i in keep}))
        if not has_first:
            if not (has_last and tied):
                setattr(base, self.embed, None)
            for name in (self.pos, self.drop):
                if name is not None:
                    setattr(base, name, None)
        if not has_last:
            setattr(base, self.norm, None)
            model.lm_head = None

    def stage_parts(self, model: nn.Module, first: bool, last: bool) -> dict[str, nn.Module]:
        base = getattr(model, self.base)
        parts: dict[str, nn.Module] = {}
        if first or (last and getattr(base, self.embed) is not None):
            parts["embed"] = getattr(base, self.embed)
        if first:
            for name in (self.pos, self.drop):
                if name is not None:
                    parts[name] = getattr(base, name)
        if getattr(base, "rotary_emb", None) is not None:
            parts["rotary_emb"] = base.rotary_emb
        if last:
            parts["norm"] = getattr(base, self.norm)
            parts["lm_head"] = model.lm_head
        return parts

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        names = ("input_ids", "attention_mask", "position_ids", "labels")
        values = _bind(type(model).forward.__get__(model), args, kwargs, names, self.name)
        input_ids = values["input_ids"]
        if input_ids is None:
            raise ConfigError("under pipeline parallelism pass input_ids to the model (inputs_embeds is not supported)")
        position_ids = values["position_ids"]
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return Call(
            input_ids,
            {"position_ids": position_ids, "attention_mask": values["attention_mask"]},
            {"labels": values["labels"]},
        )

    def run(self, stage: StageModule, x: torch.Tensor, call: Call) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids, attention_mask = call.stage_kwargs["position_ids"], call.stage_kwargs["attention_mask"]
        if stage.first:
            ids = x
            x = stage.embed(ids)
            if self.pos is not None:
                x = x + getattr(stage, self.pos)(position_ids)
            if self.drop is not None:
                x = getattr(stage, self.drop)(x)
        mask = create_causal_mask(
            config=stage.config,
            inputs_embeds=x,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}
        if hasattr(stage, "rotary_emb"):
            kwargs["position_embeddings"] = stage.rotary_emb(x, position_ids=position_ids)
        for layer in stage.layers.values():
            x = layer(x, **kwargs)
            if isinstance(x, tuple):
                x = x[0]
        if stage.last:
            return stage.lm_head(stage.norm(x))
        return x

    def finish(self, model: nn.Module, logits: torch.Tensor, call: Call) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        labels = call.loss_kwargs["labels"]
        loss = None
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class BertFamily:
    """Hugging Face BERT for pretraining (``BertForPreTraining``, ``BertForMaskedLM``): ``bert.embeddings`` →
    ``bert.encoder.layer`` → ``bert.pooler`` + ``cls`` (masked-LM decoder, next-sentence head)."""

    name = "Hugging Face BERT"

    @staticmethod
    def matches(model: nn.Module) -> bool:
        # Pretraining and masked-LM heads (``cls``) over ``bert`` (RoBERTa-style models name theirs otherwise).
        return spec_of(model).family == "bert" and hasattr(model, "cls") and hasattr(model, "bert")

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers = model.bert.encoder.layer
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

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
            model.bert.embeddings = _Holder(model.bert.embeddings.word_embeddings) if has_last and tied else None
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

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        names = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "next_sentence_label")
        values = _bind(type(model).forward.__get__(model), args, kwargs, names, self.name)
        if values["input_ids"] is None:
            raise ConfigError("under pipeline parallelism pass input_ids to the model (inputs_embeds is not supported)")
        stage = {k: values[k] for k in ("attention_mask", "token_type_ids", "position_ids")}
        return Call(values["input_ids"], stage, {k: values[k] for k in ("labels", "next_sentence_label")})

    def run(self, stage: StageModule, x: torch.Tensor, call: Call) -> Any:
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


FAMILIES: tuple[Any, ...] = (
    GPTFamily(),
    HFDecoderFamily("model", "embed_tokens", "layers", "norm", None, None),
    HFDecoderFamily("transformer", "wte", "h", "ln_f", "wpe", "drop"),
    BertFamily(),
)


def family_of(model: nn.Module) -> Any:
    for family in FAMILIES:
        if family.matches(model):
            return family
    raise ConfigError(
        f"--pipeline-model-parallel-size: there is no pipeline split for {type(model).__name__}; the built-in GPT "
        "Hugging Face decoder LMs (LLaMA, Mistral, Qwen2, GPT-2, ...) and BERT for pretraining have one"
    )


# ------------------------------------------------------------------------------------------ stages
class StageModule(nn.Module):
    """One pipeline stage: the blocks of the stage (``layers``, keyed by global index) and, on the first
    and last stage, the embedding and the head. Its submodules are the rank's model's own."""

    def __init__(
        self, runner: PipelineRunner, parts: dict[str, nn.Module], layers: nn.ModuleDict, first: bool, last: bool
    ) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)
        self.layers = layers
        self.first, self.last = first, last
        self.config = runner.model.config
        self._runner = [runner]  # a list: not registered as a submodule

    def forward(self, *activations: torch.Tensor, microbatch: torch.Tensor) -> Any:
        runner = self._runner[0]
        call = runner.calls[int(microbatch)]
        x = call.inputs if self.first else activations[0]
        out = runner.family.run(self, x, call)
        if self.last and hasattr(out, "to_local"):  # vocabulary-sharded logits cross stages as local shards
            runner.sharded_logits = True
            out = out.to_local()
        return out


class _CallRecorded(Exception):
    """Stops a forward step once it has called the model (the schedule runs the model itself)."""


class PipelineRunner:
    """This rank's stages, the schedule, and the record/replay of the user's forward step."""

    def __init__(
        self,
        model: nn.Module,
        pp_group: Any,
        pp_rank: int,
        pp_size: int,
        device: torch.device,
        schedule: str,
        layers_per_virtual_stage: int | None = None,
        split: Sequence[int] | None = None,
        tp_mesh: Any = None,
    ) -> None:
        self.model, self.family = model, family_of(model)
        self.pp_group, self.pp_rank, self.pp_size = pp_group, pp_rank, pp_size
        self.device, self.schedule_name, self.tp_mesh = device, schedule, tp_mesh
        num_layers = len(self.family.blocks(model))
        virtual = 1
        if layers_per_virtual_stage:
            if num_layers % (layers_per_virtual_stage * pp_size):
                raise ConfigError(
                    f"the model's {num_layers} layers are not divisible by --num-layers-per-virtual-pipeline-stage "
                    f"{layers_per_virtual_stage} x --pipeline-model-parallel-size {pp_size}"
                )
            virtual = num_layers // (layers_per_virtual_stage * pp_size)
        self.num_stages = pp_size * virtual
        self.stage_ids = local_stage_indices(pp_rank, pp_size, virtual)
        layer_ids = stage_layer_ids(num_layers, self.num_stages, split)
        self.layer_ids = [layer_ids[s] for s in self.stage_ids]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.tied = self.family.tied(model)
        self.family.prune(model, [i for ids in self.layer_ids for i in ids], self.has_first, self.has_last)
        self.calls: list[Call] = []
        self.results: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._phase: str | None = None
        self._recorded: Call | None = None
        self._replays: list[Callable[[], Any]] = []
        self._replay_output: Any = None
        self._schedules: dict[tuple[int, bool], Any] = {}
        self.loss_scale = 1.0
        self.sharded_logits = False
        self.stages: list[StageModule] = []
        model.forward = self._dispatch  # the forward step's call is recorded, then replayed by the schedule

    # ---------------------------------------------------------------- building
    def build_stages(self) -> list[StageModule]:
        """The stage modules over the (already tensor-parallel, checkpointed) model's blocks."""
        layers = self.family.blocks(self.model)
        by_index = dict(zip((i for ids in self.layer_ids for i in ids), layers, strict=True))
        for stage_id, ids in zip(self.stage_ids, self.layer_ids, strict=True):
            first, last = stage_id == 0, stage_id == self.num_stages - 1
            parts = self.family.stage_parts(self.model, first, last)
            stage_layers = nn.ModuleDict({str(i): by_index[i] for i in ids})
            self.stages.append(StageModule(self, parts, stage_layers, first, last))
        return self.stages

    def _schedule(self, n_microbatches: int, train: bool) -> Any:
        key = (n_microbatches, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            pipeline_stages = [
                PipelineStage(stage, stage_id, self.num_stages, self.device, group=self.pp_group)
                for stage, stage_id in zip(self.stages, self.stage_ids, strict=True)
            ]
            # Gradients are summed over micro-batches; the optimizer step divides them (see train_step).
            kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._loss, "scale_grads": False}
            if self.schedule_name == "interleaved-1f1b":
                schedule = ScheduleInterleaved1F1B(pipeline_stages, **kwargs)
            elif self.schedule_name == "1f1b" and train:
                schedule = Schedule1F1B(pipeline_stages[0], **kwargs)
            else:  # forward-only passes (evaluation) run fill-drain
                schedule = ScheduleGPipe(pipeline_stages[0], **kwargs)
            self._schedules[key] = schedule
        return self._schedules[key]

    # ---------------------------------------------------------------- the model as the forward step sees it
    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self._phase == "record":
            self._recorded = self.family.bind(self.model, args, kwargs)
            raise _CallRecorded
        if self._phase == "replay":
            call = self.family.bind(self.model, args, kwargs)
            return self.family.finish(self.model, self._replay_output, call)
        raise ConfigError(
            "under pipeline parallelism the model runs inside the trainer's steps (run_forward_step); "
            "it cannot be called directly"
        )

    def _record(self, step: Callable[[], Any]) -> Call:
        self._phase, self._recorded = "record", None
        try:
            step()
        except _CallRecorded:
            pass
        finally:
            self._phase = None
        if self._recorded is None:
            raise ConfigError("under pipeline parallelism run_forward_step must call the model it is given")
        return self._recorded

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        index = int(target)
        if self.sharded_logits:  # the last stage's logits went out as local vocabulary shards
            from torch.distributed.tensor import DTensor, Shard

            output = DTensor.from_local(output, self.tp_mesh, [Shard(-1)], run_check=False)
        self._phase, self._replay_output = "replay", output
        try:
            result = self._replays[index]()
        finally:
            self._phase, self._replay_output = None, None
        loss, items = unpack_loss(result)
        self.results[index] = (loss.detach().float(), items)
        return loss * self.loss_scale if torch.is_grad_enabled() else loss

    # ---------------------------------------------------------------- running
    def run(
        self, steps: Sequence[tuple[Callable[[], Any], Callable[[], Any]]], train: bool, loss_scale: float = 1.0
    ) -> list[tuple[torch.Tensor, int | None]]:
        """Run the micro-batches ``steps`` (each a (record, replay) pair of the user's forward step) through the
        pipeline: forward and backward when ``train``, forward only otherwise. Returns the last stage's
        ``(loss, items)`` per micro-batch (empty on other ranks)."""
        self.calls = [self._record(record) for record, _ in steps]
        self._replays = [replay for _, replay in steps]
        self.results, self.loss_scale = {}, loss_scale
        n = len(steps)
        index = torch.arange(n, device=self.device)
        schedule = self._schedule(n, train)
        context = loss_parallel_context() if self.tp_mesh is not None else contextlib.nullcontext()
        with context:
            if train:
                schedule.step(microbatch=index, target=index, return_outputs=False)
            else:
                with torch.no_grad():
                    schedule.eval(microbatch=index, target=index)
        self.calls, self._replays = [], []
        return [self.results[i] for i in range(n)] if self.has_last else []

    # ---------------------------------------------------------------- export
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (on CPU), gathered from every stage; empty elsewhere. A
        collective: every rank calls it."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Whole within each stage (tensor-parallel and FSDP shards gathered), then moved to the host.
        local = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        local = {k: v.detach().cpu() for k, v in local.items()}
        rank = dist.get_rank()
        if 0 not in dist.get_process_group_ranks(self.pp_group):  # another pipeline's copy: rank 0 has one
            return {}
        gathered: list[Any] | None = [None] * self.pp_size if rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self.pp_group)
        if rank != 0:
            return {}
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            for key, value in part.items():
                full.setdefault(key, value)
        return full

    # ---------------------------------------------------------------- gradients
    def tied_weight(self) -> nn.Parameter | None:
        """The tied word embedding on this rank, if it is on the first or the last stage."""
        if not self.tied:
            return None
        stage = self.stages[0] if self.has_first else self.stages[-1]
        embedding = next((getattr(stage, n) for n in ("embedding", "embed", "embeddings") if hasattr(stage, n)), None)
        module = getattr(embedding, "word_embeddings", embedding)
        return module.weight if module is not None and (self.has_first or self.has_last) else None


def embedding_groups(mesh: Any, pp: int) -> Any:
    """The process group joining this rank's first and last pipeline stage (same data/tensor coordinates), for
    summing a tied embedding's gradient; every rank must call this (group creation is collective)."""
    import torch.distributed as dist

    ranks = mesh.mesh  # [pp, ...] tensor of global ranks
    flat = ranks.reshape(pp, -1)
    mine = None
    for column in range(flat.shape[1]):
        pair = [int(flat[0, column]), int(flat[pp - 1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
