"""Building blocks of pipeline splits, for the model families' own (``ModelSpec.pipeline``).

A split tells ``rapidlite.parallel.pipeline`` how one family's model comes apart into stages: its blocks,
whether its input and output embeddings are tied, how to prune the model in place to a rank's stages, which
parts (embedding, norms, head) a first or last stage holds, how a call of the whole model maps onto the
stages (``bind``), how a stage runs, and how the last stage's output becomes what the whole model would have
returned (``finish``). ``DecoderSplit`` is the split of Hugging Face decoder-only LMs, shared by the families
whose models have that shape. This module is at the models layer: it imports nothing from
``rapidlite.parallel``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.models.sharding import stack_blocks


@dataclass
class Call:
    """One recorded call of the whole model, split into what the stages need."""

    inputs: torch.Tensor  # the first stage's input (token ids)
    stage_kwargs: dict[str, Any] = field(default_factory=dict)  # every stage (positions, masks)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # the last stage's loss (labels, loss mask)
    # (output layer, forward) when the step asked for log-probabilities through the chunked output layer
    # (rapidlite.models.head.returns_logps): the last stage's head call runs that forward, not the logits.
    output_forward: tuple[nn.Module, Any] | None = None


class PipelineSplit(Protocol):
    """What a family declares for pipeline parallelism. ``stage`` arguments are the pipeline's stage modules:
    ``first``/``last`` flags, the model's ``config``, ``layers`` (a ``ModuleDict`` by global block index) and
    the parts ``stage_parts`` named, as attributes."""

    name: str  # how refusals name the model, e.g. "built-in GPT"

    def unsupported(self, model: nn.Module) -> str | None:
        """Why this model cannot be split (its head, a feature the stages would skip), else None."""

    def blocks(self, model: nn.Module) -> list[nn.Module]: ...

    def tied(self, model: nn.Module) -> bool: ...

    def prune(self, model: nn.Module, keep: list[int], has_first: bool, has_last: bool) -> None:
        """Keep only blocks ``keep`` (as a ``ModuleDict`` keyed by global index, so parameter names stay the whole
        model's) and the embedding/head of the first/last stage; a tied embedding stays on the last stage."""

    def stage_parts(self, model: nn.Module, first: bool, last: bool) -> dict[str, nn.Module]: ...

    def word_embedding(self, stage: nn.Module) -> nn.Module | None:
        """The stage's word embedding (whose weight a tied output layer shares), if it holds one."""

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call: ...

    def run(self, stage: nn.Module, x: torch.Tensor, call: Call) -> Any: ...

    def finish(self, model: nn.Module, output: Any, call: Call) -> Any: ...


class Holder(nn.Module):
    """Keeps a tied word embedding on the last stage under its original name (``<parent>.word_embeddings``)."""

    def __init__(self, word_embeddings: nn.Module) -> None:
        super().__init__()
        self.word_embeddings = word_embeddings


def bind_call(forward: Callable, args: tuple, kwargs: dict, supported: Sequence[str], name: str) -> dict[str, Any]:
    """The arguments of a call of ``forward`` by name (defaults filled in); any other argument with a value that
    does something is refused in one line, since the stages would silently drop it."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    extra = values.pop("kwargs", None) or {}
    values.update(extra)
    for key, value in values.items():
        if key not in supported and value not in (None, False, 0):
            raise ConfigError(
                f"under pipeline parallelism the {name} model takes {', '.join(supported)}; "
                f"the forward step passed {key}"
            )
    return {key: values.get(key) for key in supported}


class DecoderSplit:
    """Hugging Face decoder-only LMs: ``<base>.<embed> [+ <pos>] → <base>.<layers> → <base>.<norm> →
    lm_head``. LLaMA/Mistral/Qwen2-style (``model.embed_tokens``, rotary) and GPT-2 (``transformer.wte`` +
    ``wpe``) share it."""

    def __init__(self, base: str, embed: str, layers: str, norm: str, pos: str | None, drop: str | None) -> None:
        self.base, self.embed, self.layers, self.norm, self.pos, self.drop = base, embed, layers, norm, pos, drop
        self.name = f"Hugging Face ({base}.{layers})"

    def unsupported(self, model: nn.Module) -> str | None:
        base = getattr(model, self.base, None)
        parts = (self.embed, self.layers, self.norm, *((self.pos,) if self.pos else ()))
        if base is None or not hasattr(model, "lm_head") or not all(hasattr(base, a) for a in parts):
            return f"it splits causal language models ({self.base}.{self.layers} under an lm_head)"
        config = model.config
        # The stages run the blocks and the head themselves, so what a model's forward adds around them is lost.
        if getattr(config, "final_logit_softcapping", None):
            return "its final logit soft-capping would be skipped"
        others = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
        if others:
            return f"its {', '.join(others)} layers would be masked as full causal attention"
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return stack_blocks(getattr(getattr(model, self.base), self.layers))

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

    def word_embedding(self, stage: nn.Module) -> nn.Module | None:
        return getattr(stage, "embed", None)

    def bind(self, model: nn.Module, args: tuple, kwargs: dict) -> Call:
        names = ("input_ids", "attention_mask", "position_ids", "labels")
        values = bind_call(type(model).forward.__get__(model), args, kwargs, names, self.name)
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

    def run(self, stage: nn.Module, x: torch.Tensor, call: Call) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids, attention_mask = call.stage_kwargs["position_ids"], call.stage_kwargs["attention_mask"]
        if stage.first:
            ids = x
            x = stage.embed(ids)
            if self.pos is not None:
                x = x + getattr(stage, self.pos)(position_ids)
            if self.drop is not None:
                x = getattr(stage, self.drop)(x)
        # As Mistral-style models choose (a config with layer_types mixing kinds is refused in unsupported).
        windowed = getattr(stage.config, "sliding_window", None) and not getattr(stage.config, "layer_types", None)
        mask = (create_sliding_window_causal_mask if windowed else create_causal_mask)(
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
