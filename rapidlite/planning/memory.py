"""``--dry-run``: the plan of a run and a per-rank memory prediction, printed without training.

The plan resolves every flag as a real launch would, then measures instead of guessing where it can:

- **Model states** come from the real code: the model is built on the ``meta`` device (no memory), and each
  distinct rank of the layout (one per pipeline stage) sets it up with the run's own strategy under a fake
  process group of the target world size (``torch.testing``'s ``FakeStore`` backend, the one torchtitan's
  memory estimator uses). Tensor-parallel shards, pipeline pruning, FSDP shards and LoRA adapters are
  therefore exactly what the run will hold. Gradients and optimizer state follow from the trainable local
  parameters (AdamW: two fp32 moments; 8-bit AdamW: bitsandbytes' layout, ``optim.optimizer_state_bytes``;
  ZeRO-1: sharded over data parallelism; ``--cpu-offload``: on the host).
- **Activations** come from one forward pass of the model on ``meta`` tensors of the run's micro-batch and
  sequence length: every tensor autograd saves for the backward is counted (``saved_tensors_hooks``),
  attributed to the transformer block that saved it. The layout then scales them the way it changes them:
  tensors whose last dimension is not the hidden size (heads, MLP intermediates, vocabulary logits) are split
  by tensor parallelism, hidden-size tensors by sequence parallelism only; a pipeline stage holds its own
  blocks for the micro-batches its schedule keeps in flight (1F1B: ``pp - stage``; GPipe: all);
  ``--checkpoint-activations`` keeps block inputs (``full``) or the matrix-multiply and attention outputs
  (``selective``) and recomputes one block at a time in the backward pass; ``--offload-activations`` moves
  what a GPU rank keeps to host memory but a block's worth (the block the backward pass is using) and
  selective recompute's kept outputs.
- **Transient memory** at the peak: the backward pass's gradient buffers of the largest saved tensors (the
  logits) and the full parameters FSDP gathers (one block at a time for ZeRO-3, the
  whole model between forward and backward for ZeRO-2).
- On a CPU the logged peak is the process's own memory (its resident set without the libraries' file-backed
  pages), which also holds the Python runtime and libraries: the plan adds it as "runtime"
  (``rapidlite.planning.runtime``: this process's, which has imported the same libraries and loaded the run's
  tokenizer). A CPU run fixes glibc's mmap threshold (``rapidlite.runtime.allocator``), so that memory follows
  the live tensors rather than what glibc keeps of freed ones.

DeepSpeed configs get the same accounting with ZeRO's rules (``rapidlite.planning.deepspeed``: its engine cannot be
built on meta).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.models.chunked_loss import planned_share
from rapidlite.models.flops import ModelFlops
from rapidlite.optim import eight_bit, optimizer_state_bytes
from rapidlite.planning.activations import (
    ActivationProfile,
    ProfileError,
    context_parallel_bytes,
    kept_on_device,
    offload_activations,
    profile_activations,
    stage_activations,
)
from rapidlite.planning.deepspeed import deepspeed_states
from rapidlite.planning.experts import dispatch_bytes, expert_counts, gathered_bytes, rank_counts
from rapidlite.planning.model import meta_model, sequence_length, task_spec
from rapidlite.planning.quantised import quantisable_bytes, quantised_bytes
from rapidlite.planning.runtime import runtime_bytes
from rapidlite.planning.task_terms import count_generation, count_reference
from rapidlite.planning.vision import count_images

GiB = 2**30
MiB = 2**20


# ------------------------------------------------------------------------------------------------ model states
@dataclass
class RankPlan:
    """One rank's predicted bytes. ``host``: what ``--cpu-offload`` (model states) and ``--offload-activations``
    (saved activations, on a GPU) keep in host memory instead."""

    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    host: int = 0
    runtime: int = 0
    reference: int = 0  # a preference task's frozen reference model, laid out as the policy
    generation: int = 0  # online RL's sampling between steps: the key/value cache and gathered ZeRO-3 parameters
    step: int = 0  # the optimizer step's temporaries (bitsandbytes' CPU 8-bit step), with every gradient held
    activation_per_sample: float = 0.0  # how activations and transients grow with the micro-batch
    forward_grads: int = 0  # the gradients there at the forward pass's end (see ``peak``)
    # Elements the rank computes with (its tensor/pipeline share, whole over data parallelism), trains, and steps.
    compute_params: int = 0
    trainable_params: int = 0
    stepped_params: int = 0
    # Of which the experts under expert parallelism (the rank's own, reduced over ``edp`` only).
    expert_params: int = 0
    trainable_expert_params: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The device's peak; on a CPU (``runtime`` set) the process's, host memory included. The gradients are
        freed after each step (``zero_grad(set_to_none=True)``): the peak is at the forward pass's end, with the
        activations, its transients and the gradients there then (``forward_grads``: those kept across
        micro-batches or in DDP's buckets, and the chunked loss's output-layer gradient), or after the
        backward pass, with every gradient and no activations; online RL samples with the gradients still held
        (``generation``)."""
        return self.held + max(self.with_activations, self.grads + max(self.generation, self.step))

    @property
    def held(self) -> int:
        """What the peak holds at any point of a step: parameters, optimizer state, a frozen reference and, on a
        CPU, the runtime and host memory."""
        device = self.params + self.optimizer + self.reference
        return device + self.runtime + self.host if self.runtime else device

    @property
    def with_activations(self) -> int:
        """The rest of the peak at the forward pass's end (it grows with the micro-batch)."""
        return self.activations + self.transient + self.forward_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    """A process group that exists for planning only: collectives do nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _strategy_for(settings: Sections, rank: int, precision: Any) -> Any:
    from rapidlite.runtime.distributed import DistributedContext
    from rapidlite.strategies import StrategyContext, select

    topology = settings.topology
    world_size = topology.world_size
    cpu = torch.device("cpu")
    ctx = DistributedContext(rank=rank, local_rank=rank, world_size=world_size, topology=topology, device=cpu)
    if world_size > 1:  # split as the run splits it (rapidlite.runtime.distributed)
        ctx.build_meshes("cpu")
    quiet = logging.getLogger("rapidlite.planning")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    return select(StrategyContext(settings, ctx, precision, quiet))


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class Plan:
    settings: Sections
    world_size: int
    strategy: str
    precision: str
    total_params: int
    trainable_params: int
    ranks: list[RankPlan]
    notes: list[str] = field(default_factory=list)
    seq_length: int | None = None  # the length the activations were measured at
    flops: Any = None  # the model's FLOPs per token (rapidlite.models.flops.ModelFlops, adapters' frozen base counted)
    image_patches: int = 0  # a vision-language run's planned image patches a sample (the vision encoder's FLOPs)
    # A mixture of experts: its routed layers, the router's top-k and the experts' parameters (whole model).
    moe_layers: int = 0
    moe_top_k: int = 0
    expert_params: int = 0


def _stage_rank(stage: int, dims: Any) -> int:
    return stage * dims.dp * dims.cp * dims.tp


def _in_flight(settings: Sections, stage: int, pp: int) -> int:
    m = settings.batching.gradient_accumulation_steps
    if pp == 1:
        return 1
    if settings.parallel.pipeline_schedule == "gpipe":
        return m
    return min(pp - stage, m)


def plan(settings: Sections, gpu: bool | None = None) -> Plan:
    """The plan and memory prediction of the run ``settings`` describe (see the module docstring), on this
    machine's device, or (``gpu``) on a GPU or a CPU whatever this machine has (``--device-profile``)."""
    from rapidlite.models import lora
    from rapidlite.models.spec import spec_of
    from rapidlite.precision import DTYPES, Precision, resolve_precision
    from rapidlite.strategies.base import set_dropout

    dims = settings.topology
    world_size = dims.world_size
    gpu = torch.cuda.is_available() if gpu is None else gpu
    device = torch.device("cuda" if gpu else "cpu")
    if gpu and not torch.cuda.is_available():  # planned for GPUs elsewhere: mixed precision is bf16 there
        name = {"auto": "bf16"}.get(settings.precision.precision, settings.precision.precision)
        precision = Precision(DTYPES[name], "cuda")
    else:
        precision, _ = resolve_precision(settings.precision.precision, device)
    adapters = settings.lora
    notes: list[str] = []

    # Activations: one meta forward of the whole model, in the compute dtype.
    model = meta_model(settings)
    total = sum(p.numel() for p in model.parameters())
    moe = expert_counts(model)
    spec = spec_of(model)
    layers, hidden = spec.layers_and_hidden(getattr(model, "config", None))
    seq = sequence_length(settings, getattr(model, "config", None))
    probe = model.to(precision.dtype) if precision.dtype is not None else model
    set_dropout(probe, settings.model.hidden_dropout, settings.model.attention_dropout)  # as the run sets it
    task = task_spec(settings)
    per_sample = task.inputs_per_sample if task is not None else 1
    # The chunked output layer's mode where the run takes it ("sum" or "tokens", TaskSpec.chunked_loss).
    chunked = task.chunked_loss if settings.model.chunked_loss and task is not None else None
    micro = settings.batching.micro_batch_size
    cpu = device.type == "cpu"
    target = task.target_length(settings) if task is not None and task.target_length is not None else None
    # Context parallelism: a rank holds seq / cp tokens of each sequence, and what it saves is what the model
    # saves at that length (the ring's q/k/v/output/log-sum-exp, Ulysses' head shards of the whole sequence).
    local = seq // dims.cp if seq is not None else None
    if dims.cp > 1:
        notes.append(
            f"context parallelism {dims.cp}: activations of {local} of the {seq} tokens of each sequence per rank"
        )
    share = task.scored_share(settings) if task is not None and task.scored_share is not None else 1.0
    try:
        with planned_share(share):
            profile = profile_activations(probe, micro, local, hidden, per_sample, chunked, cpu, target)
            profile_next = profile_activations(probe, micro + 1, local, hidden, per_sample, chunked, cpu, target)
    except ProfileError as e:  # the model states are still planned: said in one line, the peak without them
        profile = profile_next = ActivationProfile()
        notes.append(
            f"activations NOT counted: {type(model).__name__}'s forward could not run on meta tensors ({e}); the "
            "peak below holds the model states and the runtime only"
        )
    n_blocks = len(profile.blocks_split) or 1

    deepspeed = settings.topology.deepspeed
    on_gpu = device.type == "cuda"
    if settings.model.offload_activations:
        notes.append(
            "--offload-activations: saved activations wait in host memory (the host column) but a block's worth, "
            "which the backward pass uses on the device (and selective recompute's kept outputs)"
            if on_gpu
            else "--offload-activations: on a CPU host memory is the device, so the activations stay counted there"
        )
    ranks: list[RankPlan] = []
    strategy_name = "DeepSpeed"
    trainable_total = None
    for stage in range(dims.pp):
        rank = _stage_rank(stage, dims)
        model = meta_model(settings)
        # Quantisation needs real weights: the plan adapts the full-precision base and counts the quantised
        # bytes afterwards (planning.quantised).
        unquantised = dataclasses.replace(adapters, load_in_4bit=False, load_in_8bit=False)
        model = lora.prepare(model, unquantised, precision.dtype, torch.device("meta"), None)
        trainable_total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if stage == 0:
            flops = ModelFlops.of(model)  # the whole model, before a pipeline prunes it
        optimizer = None
        if deepspeed:
            module, strategy_name = model, "DeepSpeed"
        else:
            ctx = _fake_world(rank, world_size) if world_size > 1 else contextlib.nullcontext()
            with ctx:
                strategy = _strategy_for(settings, rank, precision)
                model.to = lambda *a, _m=model, **k: _m  # the meta model stays on meta
                composed, optimizer = strategy.setup(model, None, None)
                strategy_name = strategy.name
                module = strategy.module(composed)
        ranks.append(
            _rank_plan(
                settings,
                dims,
                rank,
                stage,
                module,
                optimizer,
                (profile, profile_next),
                n_blocks,
                deepspeed,
                on_gpu,
                precision.dtype.itemsize if precision.dtype is not None else 4,
            )
        )
        if adapters.quantized:
            ranks[-1].params -= quantisable_bytes(module, adapters) - quantised_bytes(module, adapters)
    if deepspeed:
        notes.append("DeepSpeed: model states follow ZeRO's sharding rules (its engine is not built for the plan)")
    if any(r.step for r in ranks):
        notes.append(
            f"8-bit AdamW on a CPU: bitsandbytes' step works on a whole tensor in fp32, {eight_bit.CPU_STEP_COPIES} "
            f"copies of the largest ({max(r.step for r in ranks) / eight_bit.CPU_STEP_COPIES / MiB:.1f} MiB) with "
            "every gradient held (counted in the peak)"
        )
    if adapters.quantized:
        notes.append("4-bit/8-bit base weights are counted at their quantised size (0.5 or 1 byte per weight)")
    notes += count_reference(settings, dims, ranks, total, precision, deepspeed, task)
    if task is not None and task.generation is not None:
        notes += count_generation(settings, dims, ranks, total, precision, task, getattr(model, "config", None))
    said, image_patches = count_images(settings, ranks, task, getattr(model, "config", None), precision.dtype)
    notes += said
    runtime = runtime_bytes(settings, task) if device.type == "cpu" else 0
    width = precision.dtype.itemsize if precision.dtype is not None else 4
    buffers = context_parallel_bytes(settings, getattr(model, "config", None), local, width)
    for r in ranks:
        r.runtime = runtime
        r.transient += buffers
    return Plan(
        **moe,
        flops=flops,
        seq_length=seq,
        image_patches=image_patches,
        settings=settings,
        world_size=world_size,
        strategy=strategy_name,
        precision=precision.name,
        total_params=total,
        trainable_params=trainable_total or 0,
        ranks=ranks,
        notes=notes,
    )


def _rank_plan(
    settings: Sections,
    dims: Any,
    rank: int,
    stage: int,
    module: torch.nn.Module,
    optimizer: Any,
    profiles: tuple[ActivationProfile, ActivationProfile],
    n_blocks: int,
    deepspeed: bool,
    on_gpu: bool,
    act_width: int = 4,
) -> RankPlan:
    from rapidlite.models.spec import find_blocks

    profile, profile_next = profiles  # at the run's micro-batch and one sample larger
    zero, dp = settings.topology.zero_stage, dims.dp
    params = list(module.parameters())
    param_bytes = sum(_bytes(p) for p in params)
    # Local elements: FSDP's and tensor parallelism's shards are already local here.
    trainable = sum(_local(p).numel() for p in params if p.requires_grad)
    grad_elems, ds = trainable, None
    if deepspeed:  # ZeRO's partitions, fp32 master copy, reduce bucket and gathers (planning.deepspeed)
        ds = deepspeed_states(settings, [_local(p) for p in params], dp)
        param_bytes, grad_elems, stepped = ds.params, ds.grad_elements, [ds.stepped]
    else:  # the optimizer this rank steps: ZeRO-1's partition of whole parameters (and, with expert parallelism,
        # the rank's own experts beside it), FSDP's shards
        inner = optimizer.optimizer
        locals_ = getattr(inner, "local_optimizers", None) or [getattr(inner, "optim", inner)]
        stepped = [_local(p).numel() for o in locals_ for g in o.param_groups for p in g["params"] if p.requires_grad]
    grads = grad_elems * 4
    optimizer = optimizer_state_bytes(settings.optim, stepped) + (ds.master if ds else 0)
    step = eight_bit.cpu_step_bytes(stepped) if settings.optim.eight_bit and not on_gpu else 0
    counts = rank_counts(module, params, trainable, stepped, dp if not deepspeed and zero >= 2 else 1, dims.ep)
    host = 0
    if settings.topology.cpu_offload:
        host, optimizer = optimizer, 0
        host += param_bytes + grads
        param_bytes = grads = 0

    # This stage's activations for the micro-batches in flight.
    blocks = find_blocks(module)
    mine = len(blocks) if blocks is not None else n_blocks
    in_flight = _in_flight(settings, stage, dims.pp)
    activations, largest = stage_activations(settings, dims, stage, mine, profile, in_flight)
    # How the peak grows with the micro-batch: the difference to a profile one sample larger (some saved
    # tensors, a causal mask or a transposed weight, do not grow with it).
    grown, grown_largest = stage_activations(settings, dims, stage, mine, profile_next, in_flight)
    if settings.model.offload_activations:
        activations, offloaded = offload_activations(activations, kept_on_device(settings, dims, mine, profile), on_gpu)
        grown, _ = offload_activations(grown, kept_on_device(settings, dims, mine, profile_next), on_gpu)
        host += offloaded
    # Gradients kept from one step's start: DDP's buckets (DeepSpeed's flat buffers), or accumulated over the
    # micro-batches; else only what the forward pass makes (the chunked loss's output-layer gradient).
    made_in_forward = int(profile.forward_grad / dims.tp) if _head_trains(module) else 0
    kept = deepspeed or (zero <= 1 and dp > 1) or settings.batching.gradient_accumulation_steps > 1
    forward_grads = (grads if kept else 0) + made_in_forward
    last = stage == dims.pp - 1
    held = 2 + (settings.batching.gradient_accumulation_steps - 1 if last and dims.pp > 1 else 0)  # see the transients
    per_sample = max(0.0, (grown - activations) + held * (grown_largest - largest))

    # The peak's transients: the largest saved tensor's gradient (and its softmax twin) in the backward and
    # FSDP's gathered parameters.
    transient = int(2 * largest)
    if last and dims.pp > 1:
        # The last stage keeps the outputs of the micro-batches it has finished until the step ends.
        transient += int((settings.batching.gradient_accumulation_steps - 1) * largest)
    # DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view): no second copy.
    # FSDP2 gathers parameters into buffers of their own, beside the shards (expert-parallel experts over edp).
    if not deepspeed and zero == 2:
        transient += sum(gathered_bytes(p, dp) for p in params)  # the unsharded parameters stay through the step
    elif not deepspeed and zero == 3 and blocks is not None and len(blocks):
        block_params = sum(gathered_bytes(p, dp) for p in blocks[0].parameters())
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = sum(gathered_bytes(p, dp) for p in params if id(p) not in in_blocks)  # embeddings, head: throughout
        transient += root + 2 * block_params  # and the gathered block and the next one (prefetch)
    transient += ds.gathered + ds.bucket if ds else 0  # the bucket is held from backward to backward: the peak
    # Expert parallelism: a layer's rows on their way to their experts and back (the all-to-all's input and
    # output), its (token, choice) rows of the hidden size.
    transient += dispatch_bytes(settings, module, act_width)
    return RankPlan(
        rank=rank,
        stage=stage,
        params=param_bytes,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        transient=transient,
        host=host,
        activation_per_sample=per_sample,
        forward_grads=forward_grads,
        step=step,
        **counts,
    )


def _head_trains(module: torch.nn.Module) -> bool:
    """Whether the output layer the chunked loss serves is trained (LoRA freezes it)."""
    from rapidlite.models.head import _bare, chunkable_head

    head = chunkable_head(module) or getattr(_bare(module), "output", None)
    weight = getattr(head, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.requires_grad


def largest_micro_batch(rank: RankPlan, budget_bytes: float, micro_batch: int) -> int:
    """The largest micro-batch whose predicted peak fits ``budget_bytes`` (activations grow linearly with it)."""
    if rank.held + rank.grads + max(rank.generation, rank.step) > budget_bytes:  # whatever the micro-batch
        return 0
    fixed = rank.held + rank.with_activations - rank.activation_per_sample * micro_batch
    if rank.activation_per_sample <= 0:
        return 0 if fixed > budget_bytes else sys.maxsize
    return max(0, math.floor((budget_bytes - fixed) / rank.activation_per_sample))
