"""Padding-free batches on Hugging Face models: a micro-batch's samples in one row, attention kept inside each.

A padding-free batch (``rapidlite.data.collate.FlatteningCollator``, Hugging Face's ``DataCollatorWithFlattening``
layout) is one row ``[1, T]`` of the micro-batch's real tokens, ``position_ids`` restarting at 0 at each sample
and no attention mask. What the installed transformers (5.x) makes of such a row, with SDPA or eager attention
(the implementations a CPU has):

- decoder models (LLaMA, Qwen2, Mistral, GPT-2, ...: their mask comes from ``masking_utils.create_causal_mask``)
  read the restarts (``find_packed_sequence_indices``) when there is no attention mask and no key/value cache,
  and attend block-diagonally, causal inside each sample: exact as the row is (``positions``);
- encoder models (BERT, DistilBERT, ELECTRA, ModernBERT, RoBERTa, ...) build their mask with
  ``create_bidirectional_mask``, which ignores position ids: the row would attend across samples. They take a
  prepared 4-D mask as it is, so the block-diagonal mask of the restarts is handed to them (``mask``: boolean
  for SDPA, additive for eager); RoBERTa-style embeddings number positions from ``pad_token_id + 1``, and their
  position ids are offset so;
- anything else (DeBERTa-v2's relative attention, a flash or flex kernel that takes neither) is refused.

Which of these holds is decided by running the model on a 7-token probe (two samples packed against each
alone), never by its class name, so a model that would attend across samples is refused before training.

A block-diagonal mask keeps the samples apart, but SDPA still computes the whole row's T x T scores (CPUs have
no variable-length kernel): quadratic in the row, not in each sample. So a model whose attention goes through
transformers' ``AttentionInterface`` with SDPA is switched to ``rapidlite_packed_sdpa``, which runs the model's
own SDPA attention on each sample's diagonal block of the mask (the samples found from the position ids the
layers pass down) and falls back to the whole row when a call is not packed (padded evaluation batches).

Heads: per-token heads (causal LM, token classification, masked LM) read a packed row as a padded one.
Sequence classification heads pool one token per row (the last non-padding one for decoders, the first for
BERT-style encoders), so for them the backbone runs the packed row and its output is scattered back to the
padded layout before the head, which is handed the padded input ids and mask: each sample's token is pooled
and the loss computed exactly as on the padded batch. Heads that normalise over a whole row (question
answering's span softmax, multiple choice) cannot take a packed row and are refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from rapidlite.errors import ConfigError

TOKEN, SEQUENCE = "token", "sequence"
POSITIONS, MASK = "positions", "mask"


@dataclass(frozen=True)
class PackedPlan:
    """How a model runs a packed row: ``head`` (``token`` or ``sequence``), ``attention`` (``positions``: the
    model separates samples by their restarting positions; ``mask``: a block-diagonal mask is handed to it),
    ``position_offset`` (added to the restarting positions) and ``shift_labels`` (a causal LM: each sample's
    first label must be -100)."""

    head: str
    attention: str
    position_offset: int = 0
    shift_labels: bool = False


def _mapped_names(*mappings: Any) -> set[str]:
    names: set[str] = set()
    for mapping in mappings:
        for value in mapping.values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return names


def head_kind(model: torch.nn.Module) -> tuple[str, bool] | None:
    """``(head, shift_labels)`` of a Hugging Face model from transformers' auto-class tables (the class or one
    it derives from), or None for heads a packed row does not fit."""
    from transformers.models.auto import modeling_auto as auto

    classes = {cls.__name__ for cls in type(model).__mro__}
    if classes & _mapped_names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES):
        return SEQUENCE, False
    if classes & _mapped_names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return TOKEN, True
    token_heads = _mapped_names(
        auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_MAPPING_NAMES,
    )
    if classes & token_heads:
        return TOKEN, False
    return None


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """The sample each token of packed rows belongs to, numbered from 0 in each row: a sample starts wherever a
    position does not follow the previous one by 1 (transformers' rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts.long().cumsum(-1) - 1


def block_diagonal_mask(position_ids: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``[rows, 1, T, T]`` mask of packed rows in which a token attends to the tokens of its own sample only:
    boolean (True = attend) for SDPA, additive (0 or the dtype's minimum) for eager attention."""
    seq = segments(position_ids)
    allowed = (seq[:, :, None] == seq[:, None, :])[:, None]
    if implementation in ("sdpa", PACKED_SDPA):
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


PACKED_SDPA = "rapidlite_packed_sdpa"
# A row is split into one SDPA call per sample when that saves at least this many score multiply-adds (query x
# key pairs x heads x head size) per sample: below it one call over the whole row under the block mask is faster.
# Measured on a 2-core x86 CPU with BERT (2 heads of 64), 16 samples a row, forward and backward: the two break
# even at about 1.4M (samples of 25 tokens); at 12 tokens the whole row is 1.4x faster, at 100 tokens the split
# 2.3x, at 200 tokens 3.3x.
SPLIT_SAVING = 2_000_000


def _spans(position_ids: Any, query: torch.Tensor, mask: Any) -> list[tuple[int, int]] | None:
    """The ``(start, end)`` of each sample of a packed one-row attention call, or None when the call is not one
    (several rows, a cache, no block mask, a single sample) or its samples are too short to gain from their own
    calls (``SPLIT_SAVING``)."""
    length = query.shape[2]
    if not (isinstance(position_ids, torch.Tensor) and isinstance(mask, torch.Tensor)) or query.shape[0] != 1:
        return None
    if position_ids.shape[-1] != length or mask.ndim != 4 or tuple(mask.shape[-2:]) != (length, length):
        return None
    positions = position_ids.reshape(-1, length)[0]
    starts = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    if not starts:
        return None
    bounds = [0, *starts, length]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    saved = (length * length - sum((b - a) ** 2 for a, b in spans)) * query.shape[1] * query.shape[3]
    return spans if saved >= SPLIT_SAVING * len(spans) else None


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run on each sample of a packed row alone (its diagonal block of the mask):
    the scores a padded batch computes, not the whole row's; any other call is SDPA's as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = _spans(kwargs.get("position_ids"), query, attention_mask) if key.shape[2] == query.shape[2] else None
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], attention_mask[:, :, a:b, a:b], **kwargs
        )[0]
        for a, b in spans
    ]
    return torch.cat(outputs, dim=1), None


def _register_packed_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def _arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name (``**kwargs`` spread), so a hook can rewrite them as keywords."""
    bound = signature.bind_partial(*args, **kwargs).arguments
    out: dict[str, Any] = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("a packed forward takes its inputs by name")
        else:
            out[name] = value
    return out


def _is_packed_call(call: dict[str, Any]) -> bool:
    ids, positions = call.get("input_ids"), call.get("position_ids")
    return (
        isinstance(ids, torch.Tensor)
        and isinstance(positions, torch.Tensor)
        and call.get("attention_mask") is None
        and ids.ndim == 2
        and ids.shape[0] == 1
    )


class PaddingFree:
    """The forward hooks that run packed rows on ``model`` by ``plan`` (see the module docstring); ``remove()``
    takes them off. Calls with an attention mask (padded batches: evaluation) pass through untouched."""

    def __init__(self, model: torch.nn.Module, plan: PackedPlan) -> None:
        self.model, self.plan = model, plan
        self.base = getattr(model, "base_model", model)
        self._implementation = getattr(model.config, "_attn_implementation", None)
        if self._implementation == "sdpa" and getattr(model, "_can_set_attn_implementation", lambda: False)():
            _register_packed_sdpa()
            model.set_attn_implementation(PACKED_SDPA)
        self._base_signature = inspect.signature(self.base.forward)
        self._stash: dict[str, Any] | None = None  # the packed row of the current sequence-classification call
        self._handles = []
        if plan.head == SEQUENCE:
            if self.base is model:
                raise ValueError("a sequence classification head needs a base model beneath it")
            self._outer_signature = inspect.signature(model.forward)
            self._handles.append(model.register_forward_pre_hook(self._outer_pre, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._outer_post, always_call=True))
            self._handles.append(self.base.register_forward_hook(self._base_post))
        if plan.head == SEQUENCE or plan.attention == MASK or plan.position_offset:
            self._handles.append(self.base.register_forward_pre_hook(self._base_pre, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.model.config._attn_implementation == PACKED_SDPA:
            self.model.set_attn_implementation(self._implementation)

    def describe(self) -> str:
        implementation = self.model.config._attn_implementation
        attention = (
            "the model's own packed-sequence masking (restarting position ids)"
            if self.plan.attention == POSITIONS
            else "a block-diagonal mask"
        )
        if implementation == PACKED_SDPA:
            attention += ", SDPA run on each sample alone"
        else:
            attention += f" ({implementation} over the whole row)"
        head = "the head pools each sample" if self.plan.head == SEQUENCE else "per-token head"
        return f"{type(self.model).__name__}: attention kept inside each sample by {attention}; {head}"

    # ------------------------------------------------------------------ hooks
    def _outer_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        self._stash = None
        call = _arguments(self._outer_signature, args, kwargs)
        if not _is_packed_call(call):
            return None
        ids, positions = call["input_ids"], call["position_ids"]
        seq = segments(positions)[0]
        starts = torch.nonzero(torch.diff(seq, prepend=seq.new_tensor([-1]))).flatten()
        col = torch.arange(ids.shape[1], device=ids.device) - starts[seq]
        rows, length = int(seq[-1]) + 1, int((torch.diff(starts, append=starts.new_tensor([ids.shape[1]]))).max())
        self._stash = {"input_ids": ids, "position_ids": positions, "index": (seq, col), "shape": (rows, length)}
        pad = getattr(module.config, "pad_token_id", None)
        padded = ids.new_full((rows, length), pad if isinstance(pad, int) else 0)
        padded[seq, col] = ids[0]
        mask = torch.zeros((rows, length), dtype=torch.long, device=ids.device)
        mask[seq, col] = 1
        call.update(input_ids=padded, attention_mask=mask, position_ids=None)
        token_types = call.get("token_type_ids")
        if isinstance(token_types, torch.Tensor):
            self._stash["token_type_ids"] = token_types
            call["token_type_ids"] = token_types.new_zeros((rows, length)).index_put((seq, col), token_types[0])
        return (), call

    def _outer_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._stash = None

    def _base_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        call = _arguments(self._base_signature, args, kwargs)
        stash = self._stash
        if stash is not None:  # the head was handed the padded batch; the backbone runs the packed row
            call.update(input_ids=stash["input_ids"], position_ids=stash["position_ids"], attention_mask=None)
            if "token_type_ids" in stash:
                call["token_type_ids"] = stash["token_type_ids"]
        positions = call.get("position_ids")
        if not isinstance(positions, torch.Tensor) or call.get("attention_mask") is not None:
            return ((), call) if stash is not None else None
        if self.plan.attention == MASK:
            dtype = next(module.parameters()).dtype
            call["attention_mask"] = block_diagonal_mask(positions, module.config._attn_implementation, dtype)
        if self.plan.position_offset:
            call["position_ids"] = positions + self.plan.position_offset
        return (), call

    def _base_post(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        stash = self._stash
        if stash is None:
            return None
        hidden = output[0]
        rows, length = stash["shape"]
        padded = hidden.new_zeros((rows, length, hidden.shape[-1])).index_put(stash["index"], hidden[0])
        if isinstance(output, tuple):
            return (padded, *output[1:])
        output["last_hidden_state"] = padded
        pooler = getattr(module, "pooler", None)
        if getattr(output, "pooler_output", None) is not None and pooler is not None:
            output["pooler_output"] = pooler(padded)  # BERT pools inside the base model: its first token per sample
        return output


def _probe_ids(config: Any, count: int) -> list[int]:
    """``count`` ordinary token ids: none of the config's special tokens (a pad token would end a sample early
    for a head that pools the last non-padding token)."""
    special = {
        getattr(config, name, None)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id")
    }
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    ordinary = [i for i in range(3, min(vocab, 64)) if i not in special] or list(range(vocab))
    return [ordinary[i % len(ordinary)] for i in range(count)]


def _close(got: torch.Tensor, want: torch.Tensor, floor: float) -> bool:
    scale = max(floor, float(want.abs().max()))
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-3, atol=1e-4 * scale)


def packs_exactly(model: torch.nn.Module, plan: PackedPlan) -> bool:
    """Whether two samples packed into one row give each sample's outputs alone, with ``plan``'s hooks on the
    model: the backbone's hidden state of every token (whether attention stayed inside each sample) and the
    head's outputs (every token's, or each sample's pooled ones for sequence classification)."""
    config = model.config
    device = next(model.parameters()).device
    ids = torch.tensor([_probe_ids(config, 7)], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)
    adapter = PaddingFree(model, plan)
    hidden: list[torch.Tensor] = []
    seen = adapter.base.register_forward_hook(lambda module, args, output: hidden.append(output[0].float()))
    was_training, use_cache = model.training, getattr(config, "use_cache", None)
    model.eval()
    config.use_cache = False  # a key/value cache turns transformers' packed-sequence detection off
    try:
        with torch.no_grad():
            first = model(input_ids=ids[:, :3])[0].float()
            second = model(input_ids=ids[:, 3:])[0].float()
            packed = model(input_ids=ids, position_ids=positions)[0].float()
    except Exception:  # a model that takes no 4-D mask or no position ids: not this plan
        return False
    finally:
        model.train(was_training)
        config.use_cache = use_cache
        seen.remove()
        adapter.remove()
    if len(hidden) < 3:
        # The head bypassed the base model's forward (OPT calls its decoder directly), so no hidden state was
        # seen: the per-token outputs still tell, since each depends on what its token attended to.
        return plan.head == TOKEN and _close(packed, torch.cat([first, second], dim=1), floor=0.0)
    alone = (hidden[0][0], hidden[1][0])
    if plan.head == SEQUENCE:  # the backbone's output was scattered back to the padded layout [2, 4, H]
        together = (hidden[2][0, :3], hidden[2][1, :4])
        outputs, want = packed, torch.cat([first, second])
    else:
        together = (hidden[2][0, :3], hidden[2][0, 3:])
        outputs, want = packed, torch.cat([first, second], dim=1)
    same_hidden = all(_close(got, ref, floor=1.0) for got, ref in zip(together, alone, strict=True))
    return same_hidden and _close(outputs, want, floor=0.0)


def fit_padding_free(model: torch.nn.Module) -> PaddingFree:
    """Hooks that run ``--padding-free`` rows on ``model`` exactly, the first plan the probe finds exact (the
    model's own packed masking, else a block-diagonal mask, with RoBERTa's position offset if needed); a model
    with no exact plan, or whose head cannot take a packed row, is refused with one line."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ConfigError(
            f"--padding-free runs Hugging Face transformers models; {name} is not one: drop --padding-free"
        )
    kind = head_kind(model)
    if kind is None:
        raise ConfigError(
            f"--padding-free: {name} reads whole rows (a span, choice or sequence-to-sequence head), which a row of "
            "packed samples would mix; drop --padding-free"
        )
    head, shift = kind
    implementation = getattr(config, "_attn_implementation", None)
    candidates = [(POSITIONS, 0)]
    if implementation in ("sdpa", "eager"):
        candidates.append((MASK, 0))
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int):
            candidates.append((MASK, pad + 1))  # RoBERTa-style position numbering
    for attention, offset in candidates:
        plan = PackedPlan(head, attention, offset, shift)
        if packs_exactly(model, plan):
            return PaddingFree(model, plan)
    no_pad = head == SEQUENCE and not isinstance(getattr(config, "pad_token_id", None), int)
    raise ConfigError(
        f"--padding-free: {name} with {implementation} attention does not give the samples of a packed row their own "
        "outputs (it reads neither restarting position ids nor a block-diagonal mask"
        f"{'; its config has no pad_token_id to pool each sample by' if no_pad else ''}); drop --padding-free"
    )
