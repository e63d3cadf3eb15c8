"""Activations for ``--dry-run``: what autograd saves in one meta forward, per transformer block, and how the
layout scales it (see ``rapidlite.planning``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rapidlite.config.settings import Sections
from rapidlite.errors import first_line
from rapidlite.models.chunked_loss import FORWARD_GRAD, PASSING
from rapidlite.planning.model import forward_loss


@dataclass
class ActivationProfile:
    """Bytes autograd saves for one micro-batch, by where they were saved (blocks in order)."""

    before_blocks: int = 0  # embeddings
    after_blocks_split: int = 0  # head tensors split by tensor parallelism (vocabulary logits)
    after_blocks: int = 0  # final norm and the rest of the head
    blocks_split: list[int] = field(default_factory=list)  # per block: split by tensor parallelism
    blocks_whole: list[int] = field(default_factory=list)  # per block: hidden-size tensors
    blocks_kept_selective: list[int] = field(default_factory=list)  # matmul/attention outputs
    block_inputs: list[int] = field(default_factory=list)
    largest: int = 0  # the largest saved tensor (its gradient is a buffer of the same size in the backward)
    largest_split: bool = False
    forward_grad: int = 0  # parameter gradients made in the forward pass (the chunked loss's output weight)


class FusedAttention(TorchFunctionMode):
    """Attention as the run computes it. On ``meta`` tensors ``F.scaled_dot_product_attention`` takes its math
    path, which saves the ``[heads, tokens, tokens]`` scores and their softmax; a run takes a fused kernel
    (flash or memory-efficient on CUDA, flash on a CPU) that saves the query, key, value, output and one
    log-sum-exp a row. The CPU kernel has no dropout and no gradient for the mask: a CPU run with attention
    dropout, or with a mask that trains (T5's relative position bias is added to it), takes the math path, so
    ``cpu`` keeps that path for them. CUDA's memory-efficient kernel takes the mask's gradient: its saved
    tensors are the fused ones, counted here with the mask held apart."""

    # F.scaled_dot_product_attention is a builtin without a signature: its parameters, in order.
    _SIGNATURE = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for n, d in (
            ("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
            ("is_causal", False), ("scale", None), ("enable_gqa", False),
        )]
    )  # fmt: skip

    def __init__(self, cpu: bool) -> None:
        super().__init__()
        self.cpu = cpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = self._SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v, dropout, mask = a["query"], a["key"], a["value"], a["dropout_p"], a["attn_mask"]
        trained_mask = isinstance(mask, torch.Tensor) and mask.requires_grad
        if q.device.type != "meta" or (self.cpu and (dropout > 0 or trained_mask)):
            return func(*args, **kwargs)
        # The CPU kernel's meta function has the fused kernels' saved sizes (grouped key/value heads included).
        fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        mask = mask.detach() if trained_mask else mask  # a GPU plan: the mask's own bytes are its producer's
        return fused(q, k, v, dropout, a["is_causal"], attn_mask=mask, scale=a["scale"])[0]


# The experts' matmul of a mixture of experts (transformers' grouped_mm path): tokens [S, in] x experts
# [E, in, out] -> [S, out], whatever the routing.
_GROUPED_MM = torch.ops.aten._grouped_mm.default
# ``Tensor.item()``: a meta tensor has no value. The profile's batch is token 0 everywhere, every position
# attended; a forward that reads a value (GPT-2 looks for padding when no attention mask is given) reads zero.
_ITEM = torch.ops.aten._local_scalar_dense.default


class ProfileError(Exception):
    """The meta forward could not run: the model computes on its inputs' values beyond what the profile answers
    (a shape that depends on them)."""


def profile_activations(
    model: torch.nn.Module,
    micro_batch: int,
    seq_length: int,
    hidden: int | None,
    inputs_per_sample: int = 1,
    chunked: str | None = None,
    cpu: bool = True,
    target_length: int | None = None,
) -> Any:
    """Run one meta forward and count what autograd saves (see the module docstring). ``chunked``: the loss
    through the chunked output layer where it serves the model, summed (``"sum"``) or per token (``"tokens"``);
    ``cpu``: the run's device is a CPU (its attention kernel, ``FusedAttention``); ``target_length``: an
    encoder-decoder's decoder tokens (``forward_loss``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rapidlite.models.spec import find_blocks
    from rapidlite.parallel.recompute import _SAVE_OPS  # what selective checkpointing keeps

    blocks = list(find_blocks(model) or [])
    profile = ActivationProfile(
        blocks_split=[0] * len(blocks),
        blocks_whole=[0] * len(blocks),
        blocks_kept_selective=[0] * len(blocks),
        block_inputs=[0] * len(blocks),
    )
    state = {"block": None, "done_blocks": False}
    # A saved parameter (a weight a matmul keeps for its backward) is the parameter's own memory.
    seen: set[int] = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    kept_by_selective: set[int] = set()
    vocab_dims: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            vocab_dims.add(m.num_embeddings)

    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    class Producers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _GROUPED_MM and args[0].device.type == "meta":  # its meta function takes bf16 only
                out = args[0].new_empty((args[0].shape[0], args[1].shape[-1]))
            elif func is _ITEM and args[0].device.type == "meta":
                return torch.zeros((), dtype=args[0].dtype).item()
            else:
                out = func(*args, **(kwargs or {}))
            if func in _SAVE_OPS:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        kept_by_selective.add(key(t))
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        k = key(t)
        if k in seen:
            return t
        seen.add(k)
        nbytes = t.untyped_storage().nbytes()
        if getattr(t, FORWARD_GRAD, False):
            profile.forward_grad += nbytes
            return t
        if getattr(t, PASSING, False):  # a buffer the forward passes through: the largest, not kept
            if nbytes > profile.largest:
                profile.largest, profile.largest_split = nbytes, True
            return t
        last = t.shape[-1] if t.dim() else 0
        split = t.dim() > 0 and last != hidden and (state["block"] is not None or last in vocab_dims)
        i = state["block"]
        if i is None:
            if not state["done_blocks"]:
                profile.before_blocks += nbytes
            elif split:
                profile.after_blocks_split += nbytes
            else:
                profile.after_blocks += nbytes
        else:
            (profile.blocks_split if split else profile.blocks_whole)[i] += nbytes
            if k in kept_by_selective:
                profile.blocks_kept_selective[i] += nbytes
        if nbytes > profile.largest:
            profile.largest, profile.largest_split = nbytes, split
        return t

    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, kwargs, i=i):
            state["block"] = i
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                profile.block_inputs[i] = first.untyped_storage().nbytes()

        def post(module, args, output, i=i):
            state["block"] = None
            state["done_blocks"] = i == len(blocks) - 1

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    with torch.device("meta"):
        ids = torch.zeros(micro_batch, seq_length, dtype=torch.long)
    try:
        with FusedAttention(cpu), Producers(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_loss(model, ids, inputs_per_sample, chunked, target_length)
    except (RuntimeError, NotImplementedError) as e:  # an op the meta device cannot run on values it lacks
        raise ProfileError(first_line(e)) from e
    finally:
        for h in handles:
            h.remove()
    return profile


def block_bytes(settings: Sections, dims: Any, profile: ActivationProfile) -> float:
    """What one block saves, as the layout splits it (tensor parallelism; sequence parallelism for the
    hidden-size tensors)."""
    tp, sp = dims.tp, settings.parallel.sequence_parallel
    avg = lambda xs: sum(xs) / max(len(xs), 1)
    return avg(profile.blocks_split) / tp + avg(profile.blocks_whole) / (tp if sp else 1)


def stage_activations(
    settings: Sections, dims: Any, stage: int, mine: int, profile: ActivationProfile, in_flight: int
) -> tuple[int, float]:
    """This stage's saved bytes for ``in_flight`` micro-batches, and the largest saved tensor."""
    tp, sp = dims.tp, settings.parallel.sequence_parallel
    first, last = stage == 0, stage == dims.pp - 1
    avg = lambda xs: sum(xs) / max(len(xs), 1)
    per_block = block_bytes(settings, dims, profile)
    checkpointing = settings.model.checkpoint_activations
    checkpointed = min(settings.model.recompute_num_layers or mine, mine) if checkpointing else 0
    if checkpointing and settings.model.recompute_granularity == "selective":
        kept = avg(profile.blocks_kept_selective) / tp
        stack = checkpointed * kept + (mine - checkpointed) * per_block + per_block  # + one block recomputed
    elif checkpointing:
        inputs = avg(profile.block_inputs) / (tp if sp else 1)
        stack = checkpointed * inputs + (mine - checkpointed) * per_block + per_block
    else:
        stack = mine * per_block
    outside = (profile.before_blocks if first else 0) + (
        profile.after_blocks + profile.after_blocks_split / tp if last else 0
    )
    largest = profile.largest / (tp if profile.largest_split else 1) if last else per_block / 4
    return int((stack + outside) * in_flight), largest


def kept_on_device(settings: Sections, dims: Any, mine: int, profile: ActivationProfile) -> float:
    """What stays on the device under ``--offload-activations``: a block's worth (the block the backward pass is
    using, or recomputing under ``--checkpoint-activations``), and under selective recompute the outputs its
    checkpointed blocks keep (``torch.utils.checkpoint`` caches them itself, past the saved-tensor hooks)."""
    stays = block_bytes(settings, dims, profile)
    if settings.model.checkpoint_activations and settings.model.recompute_granularity == "selective":
        checkpointed = min(settings.model.recompute_num_layers or mine, mine)
        kept = profile.blocks_kept_selective
        stays += checkpointed * sum(kept) / max(len(kept), 1) / dims.tp
    return stays


def offload_activations(activations: int, stays: float, on_gpu: bool) -> tuple[int, int]:
    """``(device, host)`` bytes of a rank's saved activations under ``--offload-activations``: on a GPU all but
    ``stays`` (``kept_on_device``) wait in host memory; on a CPU host memory is the device and nothing moves."""
    if not on_gpu:
        return activations, 0
    kept = min(activations, int(stays))
    return kept, activations - kept


def context_parallel_bytes(settings: Sections, config: Any, local_tokens: int | None, width: int) -> int:
    """Context parallelism's buffers at the peak (a layer's backward) for ``local_tokens`` of each sequence on a
    rank: the ring's received key/value block beside the one it holds, and their fp32 gradient accumulators sent
    and received; Ulysses' all-to-all buffers of q, k and v, sent and received. 0 without context parallelism."""
    dims = settings.topology
    if dims.cp <= 1 or config is None or not local_tokens:
        return 0
    hidden = config.hidden_size // dims.tp
    tokens = settings.batching.micro_batch_size * local_tokens
    if settings.parallel.cp_comm_type == "a2a":
        return 2 * 3 * tokens * hidden * width
    heads = config.num_attention_heads
    kv_hidden = hidden * (getattr(config, "num_key_value_heads", None) or heads) // heads
    block = 2 * tokens * kv_hidden  # keys and values
    return block * width + 2 * block * 4
