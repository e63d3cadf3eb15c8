"""Log-probabilities through a model's output layer without its whole logits (``rapidlite.models.chunked_loss``).

``output_logps(model, inputs, labels, shift=...)`` runs the model once and returns the per-token
log-probabilities of ``labels`` (or, ``sum_only``, their sum). Where the chunked path serves the model, the
output layer's forward is replaced for that call: it receives the hidden states as usual (inside the model's
forward, so DDP, FSDP2, DeepSpeed ZeRO-3 and tensor parallelism see an ordinary forward and gather, shard
and reduce as they always do) and returns the log-probabilities in place of the logits, which the model
passes out as its ``logits``. Elsewhere the logits are computed whole and the log-probabilities taken from
them, as before (per token: only the scored positions' logits made fp32, ``LOGITS_CHUNK_BYTES`` at a time).
With ``stats`` the same forward also gives each scored position's entropy and mean logit (KTO's metrics):
from the hidden states a chunk at a time in the chunked path, from the logits elsewhere.

The chunked path serves an ``nn.Linear`` output layer of at least ``MIN_VOCAB`` rows (smaller logits are
cheap, and their numbers stay exactly as they were) in the model families whose forward returns that layer's
output unchanged (``FAMILIES``: a Gemma-2 soft-cap or a Cohere logit scale after it would be skipped), and
rapidlite's built-in GPT. ``--no-chunked-loss`` turns it off.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidlite.models.chunked_loss import IGNORE, token_logps, token_stats
from rapidlite.models.losses import maybe_loss_parallel

MIN_VOCAB = 8192
# The whole logits' path (``logits_logps``, ``logits_stats``): the scored positions' logits are read in fp32 chunks
# of this size, so their copies and temporaries are bounded by it, not by the batch.
LOGITS_CHUNK_BYTES = 32 * 2**20
# Model types whose forward returns the output layer's result as the logits, tested in tests/test_chunked_loss.py.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "bert", "roberta", "t5", "mt5"})


def _bare(model: nn.Module) -> nn.Module:
    """The model inside the wrappers a strategy or compile puts around it (DDP, DeepSpeed, ``torch.compile``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def chunkable_head(model: nn.Module) -> nn.Linear | None:
    """The model's output layer when the chunked path serves it, else None."""
    bare = _bare(model)
    config = getattr(bare, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES:
        return None
    head = _output_layer(bare)
    # DeepSpeed ZeRO-3 keeps a partitioned parameter's shape in ds_shape (its data is empty between uses).
    if type(head) is not nn.Linear or getattr(head.weight, "ds_shape", head.weight.shape)[0] < MIN_VOCAB:
        return None
    return head


def loss_line(model: Any, settings: Any) -> str | None:
    """The run's one line on how its loss meets the output layer (None: a task whose loss does not use it)."""
    from rapidlite.config.tasks import find_task

    spec = find_task(settings.task.task) if settings.task.user_script is None else None
    models = model if isinstance(model, (list, tuple)) else [model]
    if spec is None or not spec.chunked_loss or len(models) != 1:
        return None  # a user script's own loss
    bare = _bare(models[0])
    gpt_head = getattr(bare, "output", None) if hasattr(bare, "chunked_loss") else None
    head = gpt_head if isinstance(gpt_head, nn.Linear) else chunkable_head(bare)
    layer = head or _output_layer(bare)
    weight = getattr(layer, "weight", None)
    rows = getattr(weight, "ds_shape", getattr(weight, "shape", (0,)))[0]
    if not settings.model.chunked_loss:
        return f"loss: the whole logits ({rows} per token), --no-chunked-loss"
    if head is not None and rows >= MIN_VOCAB:
        return f"loss: the output layer's {rows} logits a chunk of tokens at a time (--no-chunked-loss: whole)"
    if rows >= MIN_VOCAB:
        kind = getattr(getattr(bare, "config", None), "model_type", type(bare).__name__)
        return f"loss: the whole logits ({rows} per token): the chunked loss does not serve {kind} models"
    return None


def _output_layer(model: nn.Module) -> Any:
    """``get_output_embeddings()``, or None for a model without one (or a pipeline stage without its head)."""
    get_output = getattr(model, "get_output_embeddings", None)
    try:
        return get_output() if callable(get_output) else None
    except (AttributeError, NotImplementedError):
        return None


def causal_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position of a causal LM: the next label, ``IGNORE`` after the last."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


@contextlib.contextmanager
def returns_logps(
    head: nn.Linear, targets: torch.Tensor, sum_only: bool, stats: list | None = None, temperature: float = 1.0
) -> Iterator[None]:
    """For one call: ``head``'s forward returns the log-probabilities of ``targets`` instead of logits (its
    hooks, a strategy's gathers and layouts, run as for any call). With ``stats`` (a list), the forward also
    appends ``linear_stats``' entropy and mean logit of the scored tokens to it (no gradient), while the
    weight is in hand (gathered by ZeRO-3 or FSDP2 for the call). ``temperature``: of the logits divided by it
    (a bias-free layer's: its input is divided instead)."""

    def forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            shapes = f"hidden states {list(hidden.shape)} for targets {list(targets.shape)}"
            raise RuntimeError(f"the output layer got {shapes}: run with --no-chunked-loss")
        if temperature != 1.0:
            hidden = hidden / temperature
        if stats is not None:
            stats.append(linear_stats(self, hidden, targets))
        return linear_logps(self, hidden, targets, sum_only)

    forward.stats = stats  # where a pipeline's replay finds what its last stage's run appended (logps_override)
    head.forward = types.MethodType(forward, head)
    try:
        yield
    finally:
        del head.forward


def logps_override(model: nn.Module) -> tuple[nn.Module, Any] | None:
    """``(output layer, forward)`` while ``returns_logps`` is on for the model's output layer, else None. A
    pipeline records it with the call and puts it back on the layer when its last stage runs the head."""
    head = _output_layer(_bare(model))
    forward = getattr(head, "__dict__", {}).get("forward")
    return (head, forward) if forward is not None and hasattr(forward, "stats") else None


def head_logps(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, sum_only: bool) -> torch.Tensor:
    """``head(hidden)``'s log-probabilities of ``targets``, chunked, through the module (and its hooks)."""
    with returns_logps(head, targets, sum_only):
        return local_result(head(hidden))


def chunked_head_loss(
    head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None, per_token: bool
) -> Any:
    """Megatron's loss conventions (the built-in GPT's ``head_output``) through the chunked ``head``: with
    ``per_token`` the fp32 cross-entropy of every position ``[b, s]`` (0 at label -100, ``loss_mask`` not
    applied), else ``(loss_sum, num_tokens)`` over the labelled positions ``loss_mask`` keeps."""
    keep = kept_tokens(labels, None if per_token else loss_mask)
    targets = labels.masked_fill(~keep, IGNORE)
    if per_token:
        return -head_logps(head, hidden, targets, sum_only=False)
    count = int(keep.sum().item()) if not keep.is_meta else 0  # meta: --dry-run's profile of the forward
    return -head_logps(head, hidden, targets, sum_only=True), count


def chunks_loss(head: nn.Module | None, labels: torch.Tensor | None, enabled: bool) -> bool:
    """Whether a call of the built-in GPT with ``labels`` takes its loss through the chunked ``head`` (its
    forward, or a pipeline's last stage, which decides the same way)."""
    return labels is not None and enabled and head is not None and head.weight.shape[0] >= MIN_VOCAB


def kept_tokens(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Where ``chunked_head_loss``'s sum takes a token: a label other than -100 that ``loss_mask`` keeps."""
    keep = labels != IGNORE
    return keep if loss_mask is None else keep & (loss_mask != 0)


def _local_operands(head: nn.Linear, hidden: torch.Tensor) -> tuple[torch.Tensor, Any, Any, dict[str, Any]]:
    """``(hidden, weight, bias, keywords of token_logps)`` as this rank computes with them: under tensor
    parallelism (a vocabulary-sharded DTensor weight) the replicated hidden states, the local shard and its
    place in the vocabulary; else the module's own tensors."""
    weight, bias = head.weight, head.bias
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None:
        return hidden, weight, bias, {}
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()]).to_local()
    vocab = weight.shape[0]
    per_rank = -(-vocab // mesh.size())  # torch.chunk's split of the rows, as Shard(0) lays them out
    shard = {"group": mesh.get_group(), "vocab_offset": mesh.get_local_rank() * per_rank, "vocab": vocab}
    return hidden, weight.to_local(), bias.to_local() if bias is not None else None, shard


def linear_logps(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, sum_only: bool) -> torch.Tensor:
    """The chunked log-probabilities of ``targets`` (shaped like ``hidden`` without its last dimension) through
    ``head``. Under tensor parallelism each rank projects onto its vocabulary shard and the result, the same on
    every rank, leaves as a DTensor sharded along a last dimension of one element per rank, which the output
    layer's own layout hook passes through."""
    local_hidden, weight, bias, shard = _local_operands(head, hidden)
    out = token_logps(local_hidden, weight, bias, targets, sum_only=sum_only, **shard)
    if not shard:
        return out
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = head.weight.device_mesh
    if getattr(head, _REPLICATED, False):  # its layout hook wants the output replicated: it is, as it stands
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    return DTensor.from_local(out.unsqueeze(-1), mesh, [Shard(out.dim())], run_check=False)


_REPLICATED = "_rapidlite_replicated_output"


def replicated_output(layer: nn.Module) -> None:
    """Say that a tensor-parallel plan gathers ``layer``'s logits whole on every rank
    (``ColwiseParallel(output_layouts=Replicate())``): ``linear_logps`` then returns its log-probabilities
    replicated, which that layout hook passes through as they are."""
    setattr(layer, _REPLICATED, True)


def linear_stats(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_loss.token_stats`` through ``head`` (plain tensors, the same on every tensor-parallel rank)."""
    local_hidden, weight, bias, shard = _local_operands(head, hidden)
    shard.pop("vocab_offset", None)
    return token_stats(local_hidden, weight, bias, targets, **shard)


def model_logits(out: Any) -> torch.Tensor:
    """A Hugging Face output's logits (``prediction_logits`` for ``BertForPreTraining``'s masked-LM head)."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.prediction_logits


def local_result(result: torch.Tensor) -> torch.Tensor:
    """``linear_logps``' result as a plain tensor (its tensor-parallel wrapping undone)."""
    if hasattr(result, "to_local"):
        return result.to_local().squeeze(-1)
    return result


def output_logps(
    model: nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    *,
    shift: bool,
    sum_only: bool = False,
    chunked: bool = True,
    stats: bool = False,
    temperature: float = 1.0,
) -> Any:
    """``model(**inputs)``'s log-probabilities of ``labels`` (``IGNORE`` left out): per position ``[B, T]``
    (0 where ignored; with ``shift`` position t scores label t+1 and the last position is 0), or with
    ``sum_only`` their fp32 sum. Chunked where ``chunkable_head`` serves the model and ``chunked``. With
    ``stats``, ``(logps, (entropy, mean_logit))``: also each scored position's entropy of its next-token
    distribution and its mean logit, ``[B, T]`` fp32 without gradient (0 where ignored), from the same forward.
    ``temperature``: the distribution of the logits divided by it (sampling's, which online RL trains on)."""
    head = chunkable_head(model) if chunked else None
    if head is not None and temperature != 1.0 and head.bias is not None:
        head = None  # a bias is not divided by dividing the input: the whole logits are
    targets = causal_targets(labels) if shift else labels
    if head is not None:
        found: list | None = [] if stats else None
        with returns_logps(head, targets, sum_only, found, temperature):
            logps = local_result(model_logits(model(**inputs)))
        return (logps, found[0]) if stats else logps
    logits = model_logits(model(**inputs))
    if temperature != 1.0:
        logits = logits / temperature
    if sum_only or hasattr(logits, "full_tensor"):
        logps = _cross_entropy_logps(logits, labels, shift, sum_only)
    else:
        logps = logits_logps(logits, targets)
    return (logps, logits_stats(logits, targets)) if stats else logps


def _cross_entropy_logps(logits: torch.Tensor, labels: torch.Tensor, shift: bool, sum_only: bool) -> torch.Tensor:
    """``output_logps`` from the whole logits through ``F.cross_entropy`` (a vocabulary-parallel DTensor's
    through ``loss_parallel``, its logits never gathered)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    with maybe_loss_parallel(logits):
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum" if sum_only else "none"
        )
    if hasattr(ce, "full_tensor"):
        ce = ce.full_tensor()
    if sum_only:
        return -ce
    logps = -ce.view(labels.shape)
    return F.pad(logps, (0, 1)) if shift else logps


def _scored_chunks(logits: torch.Tensor, mask: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """The logits of the positions ``mask`` keeps, in order, in fp32, ``LOGITS_CHUNK_BYTES`` of them at a time:
    ``(their slice among the kept positions, their logits)``; the kept positions' logits are never copied whole."""
    flat, keep = logits.reshape(-1, logits.shape[-1]), mask.reshape(-1)
    rows, done = max(LOGITS_CHUNK_BYTES // (4 * flat.shape[1]), 1), 0
    for start in range(0, flat.shape[0], rows):
        picked = keep[start : start + rows].nonzero().squeeze(1)
        if picked.numel():
            yield slice(done, done + picked.numel()), flat[start : start + rows].index_select(0, picked).float()
            done += picked.numel()


def logits_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per position ``[B, T]``, the log-probability of ``targets`` (aligned with the positions; 0 at ``IGNORE``)
    under the whole ``logits``: only the targeted positions' logits become fp32, a chunk at a time."""
    mask = targets != IGNORE
    wanted = targets[mask]
    values = torch.empty(wanted.shape[0], dtype=torch.float32, device=logits.device)
    for part, chunk in _scored_chunks(logits, mask):
        values[part] = chunk.gather(1, wanted[part, None]).squeeze(1) - chunk.logsumexp(-1)
    return values.new_zeros(targets.shape).masked_scatter(mask, values)


@torch.no_grad()
def logits_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``output_logps``' ``(entropy, mean_logit)`` from the whole logits (gathered, under tensor parallelism), the
    targeted positions' in fp32 a chunk at a time."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    mask = targets != IGNORE
    entropy = torch.empty(int(mask.sum()), dtype=torch.float32, device=logits.device)
    mean_logit = torch.empty_like(entropy)
    for part, chunk in _scored_chunks(logits, mask):
        logp = chunk.log_softmax(-1)
        entropy[part] = -(logp.exp() * logp).sum(-1)
        mean_logit[part] = chunk.mean(-1)
    zeros = entropy.new_zeros(targets.shape)
    return zeros.masked_scatter(mask, entropy), zeros.masked_scatter(mask, mean_logit)
