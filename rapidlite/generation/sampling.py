"""Sampling completions from the training model, with a key/value cache, keyed per completion.

``sample(model, prompts, keys, settings)`` completes each prompt (token ids) once per key: the prompts are
left-padded into batches of ``settings.batch_size``, run once through the model to fill the cache, then extended
one token a step until every row has ended (EOS) or reached ``max_completion_length``. Each step's logits go
through Hugging Face's own logits processors in ``generate``'s order (repetition penalty, then temperature, top-k,
top-p, min-p: ``transformers.generation.logits_process``), and each row draws its token at a uniform number that
is a hash of (its key, the step) (``draw``: one vectorised op for the whole batch, no per-row generator): a
completion depends on its prompt and its key (``completion_key``) only, never on which rank, batch or row it was
sampled in, so a run on N ranks samples what one process samples.

The model is any causal LM whose forward takes a key/value cache (``cache``, or ``past_key_values`` before
transformers 5.2x: Hugging Face's, LoRA-wrapped or not); under tensor parallelism every rank of the group runs the
same steps and draws the same tokens (its logits are gathered). Parameters sharded by ZeRO-3 are gathered for the
whole rollout by the caller (the strategy's ``gathered_for_generation``), not once a token.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """``--max-completion-length``, ``--temperature``, ``--top-p``, ``--top-k`` (0: off), ``--min-p`` (None: off),
    ``--repetition-penalty`` and ``--generation-batch-size`` (completions a forward): TRL's names and defaults."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    batch_size: int = 32


def completion_key(seed: int, rollout: int, index: int) -> int:
    """The random stream of the ``index``-th completion of the ``rollout``-th rollout of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{rollout}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Completions:
    """Per completion: its token ids (up to and including the first EOS) and whether it was cut at the length
    limit without one."""

    ids: list[list[int]]
    truncated: list[bool]


def _processors(settings: SamplingSettings):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = LogitsProcessorList()
    if settings.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.temperature != 1.0:
        out.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k:
        out.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        out.append(TopPLogitsWarper(settings.top_p))
    if settings.min_p is not None:
        out.append(MinPLogitsWarper(settings.min_p))
    return out


def _forward_arguments(model: torch.nn.Module) -> tuple[str, dict[str, int]]:
    """The forward's name for the key/value cache (``cache`` from transformers 5.2x, else ``past_key_values``), and
    ``logits_to_keep=1`` where it takes it (the prompt's pass needs its last position's logits only)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's own forward
    parameters = inspect.signature(base.forward).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    return name, ({"logits_to_keep": 1} if "logits_to_keep" in parameters else {})


MASK63 = (1 << 63) - 1
# splitmix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps as two's complement).
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) if c >= 1 << 63 else c for c in (
    0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))  # fmt: skip


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def keyed_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform number in (0, 1) per row (float64), a function of (the row's key, ``step``) only: splitmix64 of
    the two, its top 53 bits."""
    step_term = ((step + 1) * _GOLDEN + (1 << 63)) % (1 << 64) - (1 << 63)  # wrapped to int64 in Python
    z = keys * _MIX2 + step_term
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def draw(scores: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
    """A token per row from ``softmax(scores)`` (``[rows, vocab]``; -inf: filtered out), by inverting each row's
    cumulative distribution at its ``keyed_uniform``: what ``torch.multinomial`` does, with the randomness a
    function of (key, step) and no per-row generator, so a row draws the same token in any batch."""
    cdf = torch.softmax(scores.double(), dim=-1).cumsum(-1)
    target = keyed_uniform(keys, step) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp(max=scores.shape[-1] - 1)


def _last_logits(out) -> torch.Tensor:
    logits = out.logits[:, -1]
    if hasattr(logits, "full_tensor"):  # tensor parallelism: the vocabulary's shards gathered
        logits = logits.full_tensor()
    return logits.float()


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    keys: Sequence[int],
    settings: SamplingSettings,
    eos_token_id: int | Sequence[int],
    pad_token_id: int | None,
    all_finished: Callable[[bool], bool] | None = None,
) -> Completions:
    """One completion of ``prompts[i]`` for ``keys[i]``, for every i (see the module's docstring). A tokenizer
    without a pad token pads with EOS (no padded position is ever attended to or kept). ``all_finished``: given
    whether this batch's rows have all ended, whether every rank's have (ranks whose forwards are collective stop
    together; a row that has ended draws pad tokens meanwhile, which are not kept)."""
    if len(prompts) != len(keys):
        raise ValueError(f"{len(prompts)} prompts for {len(keys)} keys")
    if pad_token_id is None:
        pad_token_id = eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)[0]
    ids: list[list[int]] = []
    truncated: list[bool] = []
    for start in range(0, len(prompts), settings.batch_size):
        batch = _sample_batch(
            model, prompts[start : start + settings.batch_size], keys[start : start + settings.batch_size],
            settings, eos_token_id, pad_token_id, all_finished or bool,
        )  # fmt: skip
        ids += batch.ids
        truncated += batch.truncated
    return Completions(ids, truncated)


@functools.cache
def _rollout_cache_class() -> type:
    """``RolloutCache(capacity)``: a Hugging Face ``DynamicCache`` whose layers write each step's keys and values
    into buffers of the batch's whole length (``capacity``: the longest prompt plus ``--max-completion-length``)
    and hand out views of the filled part, where ``DynamicLayer`` concatenates, copying the whole cache at every
    token. Selecting rows (``batch_select_indices``: a prompt's pass copied to its completions, ended rows dropped)
    indexes the buffers. Built on first use: transformers is imported only by a run that samples."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            rows, heads = key_states.shape[:2]
            self.buffers = (
                key_states.new_empty((rows, heads, self.capacity, key_states.shape[-1])),
                value_states.new_empty((rows, heads, self.capacity, value_states.shape[-1])),
            )
            self.length = 0
            self._view()

        def _view(self) -> None:
            self.keys, self.values = (b[:, :, : self.length] for b in self.buffers)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self.buffers[0][:, :, self.length : end] = key_states
            self.buffers[1][:, :, self.length : end] = value_states
            self.length = end
            self._view()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.buffers = tuple(b[indices] for b in self.buffers)
                self._view()

    class RolloutCache(DynamicCache):
        def __init__(self, capacity: int) -> None:
            Cache.__init__(self, layer_class_to_replicate=functools.partial(GrowingLayer, capacity))

    return RolloutCache


def _left_padded(prompts, width: int, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
            mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def _sample_batch(model, prompts, keys, settings, eos_token_id, pad_token_id, all_finished) -> Completions:
    """One batch: the distinct prompts run once through the model (GRPO's completions of a prompt share its
    pass: their cache rows are copies), then a token a step for every row. When a quarter of the rows still in
    the batch have ended, they leave it (their cache rows dropped): the steps that follow run on the rows still
    going. A row's tokens do not depend on the batch it is in (see ``draw``)."""
    device = next(model.parameters()).device
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    width = max(len(p) for p in prompts)
    distinct: dict[tuple[int, ...], int] = {}
    owner = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
    input_ids, mask = _left_padded(list(distinct), width, pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    processors = _processors(settings)
    cache = _rollout_cache_class()(width + settings.max_completion_length)
    name, last_only = _forward_arguments(model)
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache}, **last_only
    )  # fmt: skip
    logits = _last_logits(out)[owner]
    cache.batch_select_indices(owner)
    sequences, mask, positions = input_ids[owner], mask[owner], positions[owner, -1:]
    row_keys = torch.tensor([k & MASK63 for k in keys], dtype=torch.long, device=device)
    rows = torch.arange(len(prompts), device=device)  # each batch row's place in ``prompts``
    tokens = torch.full((len(prompts), settings.max_completion_length), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    # What the repetition penalty sees of a row: its own tokens. Its left padding is replaced by its first token
    # (a token it has anyway), so that a row's penalty never depends on the longest prompt of its batch.
    first = sequences.gather(1, (mask == 0).sum(-1, keepdim=True).clamp(max=width - 1))
    steps = 0
    for step in range(settings.max_completion_length):
        # Only the repetition penalty reads the tokens seen.
        seen = torch.where(mask.bool(), sequences, first) if settings.repetition_penalty != 1.0 else sequences
        drawn = draw(processors(seen, logits), row_keys, step)
        drawn = torch.where(finished, torch.full_like(drawn, pad_token_id), drawn)
        tokens[rows, step] = drawn
        finished |= torch.isin(drawn, eos)
        steps, ended = step + 1, int(finished.sum())  # one read of the device a token
        if all_finished(ended == len(finished)) or steps == settings.max_completion_length:
            break
        if 4 * ended >= len(finished) and ended < len(finished):  # the ended rows leave the batch
            going = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(going)
            rows, row_keys, finished, drawn = rows[going], row_keys[going], finished[going], drawn[going]
            sequences, mask, positions, first = sequences[going], mask[going], positions[going], first[going]
        sequences = torch.cat([sequences, drawn[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(drawn)[:, None]], dim=1)
        positions = positions + 1
        out = model(
            input_ids=drawn[:, None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{name: cache},
        )  # the cache object is updated in place
        logits = _last_logits(out)
    ids, truncated = [], []
    eos_ids = set(eos.tolist())
    for row in tokens[:, :steps].tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        ids.append(row[: end + 1] if end is not None else row)
        truncated.append(end is None)
    return Completions(ids, truncated)
