"""The step-time model of ``--dry-run --device-profile``: how long one optimizer step takes on each rank of a
layout, from the plan (``rapidlite.planning.plan``) and a device profile (``rapidlite.planning.devices``).

A step is the sum of terms, each shown so a user sees what dominates:

- **compute**: the rank's share of the model's FLOPs (``rapidlite.models.flops``: ``6 N + 12 L d T`` per token, a
  LoRA base's frozen weights without their weight gradient) for the step's micro-batches, divided by tensor and
  pipeline parallelism; matrix multiplies at the profile's matmul efficiency, attention at its attention
  efficiency. Activation recomputation adds a forward pass of the recomputed blocks (``full``) or of their
  attention (``selective``).
- **pipeline bubble**: ``(pp - 1) / v`` micro-batch times (1F1B and GPipe: ``v = 1``; interleaved 1F1B: ``v``
  virtual stages per rank).
- **tensor parallel**: per block and micro-batch, two all-reduces of the activations in the forward pass and
  two in the backward (with sequence parallelism the same bytes move as all-gathers and reduce-scatters), two
  more with full recomputation; per micro-batch, the vocabulary-parallel embedding's (first stage) and output
  layer's (last stage) and the parallel cross-entropy's three of one value a token; not overlapped with compute.
- **tensor-parallel dispatch**: what DTensor's dispatch adds on the host to each block's forward and backward
  (the profile's ``tensor_parallel_overhead``: measured by the cpu profile, none on a GPU, whose kernels run
  behind the host).
- **pipeline send/receive**: each micro-batch's activations forward and their gradient backward, per stage
  boundary.
- **context parallel** (exposed): with ``p2p`` (ring attention), per layer and micro-batch, ``cp - 1`` hops of
  a rank's key/value shard forward and ``cp`` backward with its fp32 gradient accumulators, each overlapped
  with one block's attention (a ``(seq/cp)^2 / 2`` share of it): only what exceeds that is exposed; with ``a2a``
  (Ulysses) four all-to-alls of the shard's q, k, v and output forward and four backward, not overlapped.
- **expert parallel**: per routed layer and micro-batch, the all-to-alls that send each (token, choice) row of
  the hidden size to its expert's rank and back, twice in the forward pass and twice in the backward (two more
  with full recomputation); each moves ``(ep - 1) / ep`` of the rows through each rank; not overlapped.
- **data parallel** (exposed): DDP and ZeRO-1 all-reduce the gradients once a step in 25 MiB buckets, overlapped
  with the last micro-batch's backward pass but the last bucket (ZeRO-1 then all-gathers the updated
  parameters); FSDP2's ZeRO-2 gathers the parameters once per micro-batch and reduce-scatters the gradients,
  ZeRO-3 gathers them again for the backward pass; FSDP2's prefetching overlaps them with the compute, so only
  what exceeds it is exposed. With expert parallelism a rank's own experts go over their ``edp`` ranks only
  (``dp / ep``): under DDP and ZeRO-1 all-reduced in the optimizer step, after the backward pass, and not
  gathered by ZeRO-1.
- **optimizer**: the rank's stepped parameters at the profile's AdamW rate; with ``--cpu-offload`` on the host,
  plus the gradients' and parameters' trips over the host link.

Collectives are ring formulas over the link the group spans: within a node (``--nproc-per-node`` ranks) the
profile's intra-node bandwidth and latency, else the inter-node ones. ``all_reduce`` moves ``2 (n-1)/n`` of
the bytes through each rank, ``all_gather``/``reduce_scatter`` ``(n-1)/n``, times the profile's slowdown of
that collective (1 for NCCL; gloo's all-gather and reduce-scatter into one tensor run slower than its all-reduce).

What the model leaves out: kernel launch overheads (but DTensor's on a CPU) and small-kernel inefficiency, the
data loader, imbalance between stages (the slowest rank is taken), FP8 and custom kernels, and compute slowed by
communication sharing the device's memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rapidlite.planning.devices import DeviceProfile

_ACT_BYTES = {"bf16": 2, "fp16": 2}  # else 4
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb


def all_reduce(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def all_gather(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Also a reduce-scatter: ``nbytes`` is the whole (gathered) tensor."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def send(nbytes: float, bandwidth: float, latency: float) -> float:
    return nbytes / bandwidth + latency


@dataclass
class StepTime:
    """One rank's predicted step, in seconds per term (``terms``), and what follows from it."""

    rank: int
    terms: dict[str, float] = field(default_factory=dict)
    overlapped: dict[str, float] = field(default_factory=dict)  # communication hidden behind compute

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())


@dataclass
class Throughput:
    """The layout's step (its slowest rank's), tokens per second per device, MFU, and the time to train."""

    step: StepTime
    ranks: list[StepTime]
    tokens_per_step: int
    world_size: int
    model_flops_per_step: float
    peak_flops: float  # one device's
    iterations: int | None
    counted_tokens: bool = False  # the run's length was given in tokens (--train-tokens)

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step / self.step.seconds / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step.seconds * self.world_size * self.peak_flops)

    @property
    def time_to_train(self) -> float | None:
        return None if self.iterations is None else self.iterations * self.step.seconds


def _link(profile: DeviceProfile, span: int, per_node: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group whose ranks lie within ``span`` consecutive ranks."""
    if span <= per_node:
        return profile.intra_node_bandwidth, profile.intra_node_latency
    return profile.inter_node_bandwidth, profile.inter_node_latency


def step_time(plan: Any, profile: DeviceProfile, per_node: int) -> Throughput:
    """The predicted step of ``plan``'s layout on ``profile`` devices, ``per_node`` ranks a node."""
    s = plan.settings
    dims = s.topology
    micro, m, seq = s.batching.micro_batch_size, s.batching.gradient_accumulation_steps, plan.seq_length
    flops = plan.flops
    shared = min(per_node, plan.world_size) if profile.shared_by_node else 1
    peak = profile.peak(plan.precision) / shared
    memory_bandwidth = profile.memory_bandwidth / shared
    layers, hidden = flops.num_layers or 0, flops.hidden_size or 0
    act = _ACT_BYTES.get(plan.precision, 4) * micro * seq * hidden  # one block's activations, whole

    # Compute of one micro-batch on one stage (its share of the blocks and of tensor parallelism).
    matmul = 6.0 * flops.matmul_params - 2.0 * flops.frozen_params
    attention = 12.0 * layers * hidden * seq
    recompute = _recomputed_fraction(s, layers)
    if s.model.recompute_granularity == "full":
        matmul += 2.0 * flops.matmul_params * recompute
        attention += 4.0 * layers * hidden * seq * recompute
    else:
        attention += 4.0 * layers * hidden * seq * recompute
    tokens = micro * seq
    matmul_efficiency = profile.matmul_efficiency_at(hidden // dims.tp if hidden else 4096)  # a block's narrowest
    attention_time = tokens * attention / (peak * profile.attention_efficiency)
    per_micro = tokens * matmul / (peak * matmul_efficiency) + attention_time
    per_micro /= dims.tp * dims.pp * dims.cp
    images = micro * plan.image_patches * flops.per_patch()  # the vision encoder, whole on each rank
    per_micro += images / (peak * matmul_efficiency)
    virtual = _virtual_stages(s, layers, dims.pp)

    tp_link = _link(profile, dims.tp, per_node)
    cp_link = _link(profile, dims.cp * dims.tp, per_node)
    dp_link = _link(profile, dims.dp * dims.cp * dims.tp, per_node)
    pp_link = _link(profile, plan.world_size, per_node)
    ep_link = _link(profile, dims.ep, per_node)  # neighbouring ranks (runtime.distributed.expert_mesh)
    ranks = []
    for r in plan.ranks:
        t = StepTime(rank=r.rank)
        t.terms["compute"] = m * per_micro
        t.terms["pipeline bubble"] = (dims.pp - 1) / virtual * per_micro if dims.pp > 1 else 0.0
        per_layer = 4 + (2 * recompute if s.model.recompute_granularity == "full" else 0)
        if s.parallel.sequence_parallel:  # each all-reduce becomes a reduce-scatter and an all-gather
            slowdown = profile.all_gather_slowdown + profile.reduce_scatter_slowdown
            tp_collective = slowdown * all_gather(act, dims.tp, *tp_link)
        else:
            tp_collective = all_reduce(act, dims.tp, *tp_link)
        blocks = m * layers / dims.pp
        t.terms["tensor parallel"] = blocks * per_layer * tp_collective
        if dims.tp > 1:  # the vocabulary-parallel embedding, output layer and cross-entropy
            first, last = r.stage == 0, r.stage == dims.pp - 1
            token_values = all_reduce(4 * micro * seq, dims.tp, *tp_link)
            t.terms["tensor parallel"] += m * ((first + last) * tp_collective + 3 * last * token_values)
            forward_again = recompute / 3 if s.model.recompute_granularity == "full" else 0.0
            t.terms["tensor-parallel dispatch"] = blocks * profile.tensor_parallel_overhead * (1 + forward_again)
        t.terms["pipeline send/receive"] = 2 * m * send(act / dims.tp, *pp_link) if dims.pp > 1 else 0.0
        if dims.ep > 1 and plan.moe_layers:
            rows = act * plan.moe_top_k  # a layer's (token, choice) rows of one micro-batch
            trips = 4 + (2 * recompute if s.model.recompute_granularity == "full" else 0)
            t.terms["expert parallel"] = m * plan.moe_layers * trips * all_gather(rows, dims.ep, *ep_link)
        if dims.cp > 1:
            block = attention_time / (layers or 1) / dims.cp**2 if profile.overlaps_communication else 0.0
            element = _ACT_BYTES.get(plan.precision, 4)
            t.terms["context parallel"] = (
                m
                * layers
                / dims.pp
                * _context_parallel(act / dims.cp, element, dims.cp, s.parallel.cp_comm_type, block, cp_link)
            )
        overlap = per_micro if profile.overlaps_communication else 0.0
        reduce_size = dims.dp * dims.cp  # context-parallel ranks' gradients are summed like replicas'
        exposed, hidden_comm = _data_parallel(r, dims, reduce_size, m, overlap, plan.precision, dp_link, profile)
        t.terms["data parallel"], t.overlapped["data parallel"] = exposed, hidden_comm
        t.terms["optimizer"] = _optimizer(r, dims, profile, memory_bandwidth)
        ranks.append(t)
    slowest = max(ranks, key=lambda t: t.seconds)
    global_batch = s.batching.global_batch_size
    return Throughput(
        step=slowest,
        ranks=ranks,
        tokens_per_step=global_batch * seq,
        world_size=plan.world_size,
        model_flops_per_step=global_batch * (seq * flops.per_token(seq) + plan.image_patches * flops.per_patch()),
        peak_flops=peak,
        iterations=_iterations(s, global_batch),
        counted_tokens=s.training.train_tokens is not None,
    )


def _recomputed_fraction(settings: Any, layers: int) -> float:
    model = settings.model
    if not model.checkpoint_activations or not layers:
        return 0.0
    return min(model.recompute_num_layers, layers) / layers if model.recompute_num_layers else 1.0


def _virtual_stages(settings: Any, layers: int, pp: int) -> int:
    per_virtual = settings.parallel.num_layers_per_virtual_pipeline_stage
    if pp == 1 or not per_virtual or not layers:
        return 1
    return max(1, layers // (per_virtual * pp))


def _data_parallel(
    r: Any,
    dims: Any,
    dp: int,
    m: int,
    per_micro: float,
    precision: str,
    link: tuple[float, float],
    profile: DeviceProfile,
) -> tuple[float, float]:
    """(exposed, overlapped) seconds of the data-parallel collectives of one step; ``per_micro``: the compute of a
    micro-batch they can hide behind (0 where collectives take the compute's cores)."""
    if dp <= 1:
        return 0.0, 0.0
    # With expert parallelism the rank's own experts are reduced (and gathered) over edp = dp / ep only.
    edp = max(dp // dims.ep, 1)
    expert_grads = r.trainable_expert_params * 4
    grads = r.trainable_params * 4 - expert_grads  # fp32 gradients, reduced as they are kept
    expert_compute = r.expert_params
    backward = per_micro * 2 / 3  # the last micro-batch's backward pass, which the reduction overlaps
    if dims.deepspeed or dims.zero_stage <= 1:
        total = all_reduce(grads, dp, *link)
        # ZeRO-1 gathers the updated shared weights (the experts are each rank's own).
        after = all_gather((r.compute_params - expert_compute) * 4, dp, *link) if dims.zero_stage == 1 else 0.0
        # The bucket holding the first layers' gradients is reduced after the backward pass ends.
        last_bucket = all_reduce(min(grads, DDP_BUCKET_BYTES), dp, *link)
        exposed = min(total, max(total - backward, last_bucket))
        # DDP leaves the experts out: they are averaged over edp in the optimizer step, after the backward pass.
        experts = all_reduce(expert_grads, edp, *link) if expert_grads else 0.0
        return exposed + after + experts, total - exposed
    element = _ACT_BYTES.get(precision, 4)  # FSDP2 gathers in the compute dtype
    gather = profile.all_gather_slowdown * (
        all_gather((r.compute_params - expert_compute) * element, dp, *link)
        + all_gather(expert_compute * element, edp, *link)
    )
    gathers = (2 if dims.zero_stage == 3 else 1) * m * gather
    scatter = all_gather(grads, dp, *link) + all_gather(expert_grads, edp, *link)  # the summed gradients
    total = gathers + profile.reduce_scatter_slowdown * scatter
    exposed = max(0.0, total - m * per_micro)
    return exposed, total - exposed


def _context_parallel(
    shard: float, element: int, cp: int, comm_type: str, block: float, link: tuple[float, float]
) -> float:
    """Exposed seconds of one layer's context-parallel communication for one micro-batch: ``shard`` is the
    rank's bytes of one layer's activations (its tokens x hidden, ``element`` bytes each), ``block`` the time
    of one block's attention."""
    if comm_type == "a2a":  # q, k, v and the output, each way
        return 8 * all_gather(shard * cp, cp, *link)
    kv = 2 * shard  # keys and values (grouped-query attention moves less: not counted)
    accumulators = kv / element * 4  # their gradients travel in fp32
    forward = (cp - 1) * max(0.0, send(kv, *link) - block)
    backward = cp * max(0.0, send(kv + accumulators, *link) - 2 * block)  # a block's backward: about 2 forwards
    return forward + backward


def _optimizer(r: Any, dims: Any, profile: DeviceProfile, memory_bandwidth: float) -> float:
    if dims.cpu_offload:
        trips = (r.trainable_params * 4 + r.compute_params * 4) / profile.host_bandwidth
        return r.stepped_params / profile.host_optimizer_rate + trips
    rate = profile.optimizer_rate * memory_bandwidth / profile.memory_bandwidth
    return r.stepped_params / rate


def _iterations(settings: Any, global_batch: int) -> int | None:
    if settings.training.train_iters:
        return settings.training.train_iters
    samples = getattr(settings.training, "train_samples", None)
    return -(-samples // global_batch) if samples else None


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def format_time(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def format_throughput(t: Throughput, profile: DeviceProfile) -> list[str]:
    """The printed lines: the slowest rank's terms, then tokens/s per device, MFU and the time to train."""
    step = t.step
    lines = [
        f"predicted step time on {profile.name} ({profile.source}): {format_time(step.seconds)} (rank {step.rank})"
    ]
    for name, seconds in sorted(step.terms.items(), key=lambda kv: -kv[1]):
        if seconds > 0 or step.overlapped.get(name, 0.0) > 0 or name == "compute":
            share = 100 * seconds / step.seconds if step.seconds else 0
            hidden = step.overlapped.get(name, 0.0)
            extra = f" (+{format_time(hidden)} overlapped with compute)" if hidden > 0 else ""
            lines.append(f"  {name:<22} {format_time(seconds):>10} {share:5.1f}%{extra}")
    lines.append(
        f"throughput: {t.tokens_per_second_per_device:,.0f} tokens/s per device, MFU {100 * t.mfu:.1f}% "
        f"(model FLOPs over {t.world_size} x {t.peak_flops / 1e12:.3g} TFLOP/s peak)"
    )
    if t.time_to_train is not None:
        tokens = f"{_count(t.iterations * t.tokens_per_step)} tokens, " if t.counted_tokens else ""
        lines.append(f"time to train {tokens}{t.iterations:,} iterations: {format_time(t.time_to_train)}")
    return lines
