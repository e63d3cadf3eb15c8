"""What ``--dry-run`` prints (``format_plan``) and records (``plan_records``)."""

from __future__ import annotations

from typing import Any

from rapidlite.planning import GiB, MiB, Plan, largest_micro_batch
from rapidlite.planning.model import sequence_length
from rapidlite.runtime.allocator import COMPACT_MEMALIGN, MMAP_THRESHOLD, glibc_version


def _mib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def describe_mesh(dims: Any) -> list[str]:
    """Which ranks do what: rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index."""
    lines = []
    for s in range(dims.pp):
        for d in range(dims.dp):
            first = (s * dims.dp + d) * dims.cp * dims.tp
            ranks = list(range(first, first + dims.cp * dims.tp))
            where = f"stage {s}, " if dims.pp > 1 else ""
            kinds = [kind for kind, size in (("context", dims.cp), ("tensor", dims.tp)) if size > 1]
            shards = f"{'- and '.join(kinds)}-parallel shards {ranks}" if kinds else f"rank {ranks[0]}"
            lines.append(f"  {where}replica {d}: {shards}")
    if len(lines) > 8:
        lines = [*lines[:6], f"  ... ({len(lines)} groups in all)"]
    return lines


def format_plan(p: Plan) -> str:
    from rapidlite.runtime.world import num_nodes

    s = p.settings
    model, run, parallel = s.model, s.training, s.parallel
    dims, batch = s.topology, s.batching
    nodes = num_nodes(parallel)
    checkpointing = (
        f"{model.recompute_granularity}"
        + (f", first {model.recompute_num_layers} blocks" if model.recompute_num_layers else ", every block")
        if model.checkpoint_activations
        else "off"
    )
    lines = [
        "rapidlite dry run: nothing is trained",
        f"world: {p.world_size} process{'es' if p.world_size > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''}) "
        f"= data parallel {dims.dp} x "
        + (f"context parallel {dims.cp} x " if dims.cp > 1 else "")
        + f"tensor parallel {dims.tp} x pipeline parallel {dims.pp}",
        *describe_mesh(dims),
        f"batch: micro {batch.micro_batch_size} x accumulation {batch.gradient_accumulation_steps} x data parallel "
        f"{dims.dp} = global {batch.global_batch_size}; sequence length {p.seq_length or sequence_length(s)}"
        + ("" if s.given("seq_length") else " (the task's default; the longest a batch is padded to)"),
        f"strategy: {p.strategy} | precision: {p.precision} | activation checkpointing: {checkpointing}",
        f"model: {p.total_params / 1e6:.2f}M parameters, {p.trainable_params / 1e6:.2f}M trainable",
        "predicted memory per rank (peak of a training step):",
    ]
    # Every column right-aligned at its own width; reference, host and runtime only where some rank has them.
    columns = [("params", 11), ("grads", 11), ("optimizer", 11), ("activations", 12), ("transient", 11)]
    columns += [(name, 11) for name in ("reference", "host", "runtime") if any(getattr(r, name) for r in p.ranks)]
    columns.append(("peak", 11))
    lines.append(f"  {'rank':>6} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for r in p.ranks:
        lines.append(f"  {r.rank:>6} " + " ".join(f"{_mib(getattr(r, name)):>{width}}" for name, width in columns))
    r = max(p.ranks, key=lambda r: r.peak)
    grads = _mib(r.forward_grads).strip()
    lines.append(
        f"  (the peak is at the forward pass's end: params + optimizer + activations + transient + the {grads} of "
        "gradients there by then; after the backward pass, every gradient and no activation is less)"
        if r.with_activations >= r.grads
        else "  (the peak is after the backward pass: params + optimizer + every gradient; the forward pass's end, "
        "with the activations, is less)"
    )
    if any(r.runtime for r in p.ranks):
        lines.append(
            "  (CPU: the peak is the process's own memory, so it includes the runtime: Python, torch and the run's "
            "libraries, without their file-backed pages; rapidlite fixes glibc's mmap threshold so freed tensors of "
            f"{MMAP_THRESHOLD // MiB} MiB or more are given back, and the holes glibc's heap keeps between smaller "
            "ones are not counted: docs/guides/dry-run.md measures them)"
        )
        glibc = glibc_version()
        if glibc is not None and glibc < COMPACT_MEMALIGN:
            lines.append(
                f"  (this machine's glibc {glibc[0]}.{glibc[1]} keeps more of those holes than glibc "
                f"{COMPACT_MEMALIGN[0]}.{COMPACT_MEMALIGN[1]} and later, where freed aligned blocks merge (glibc bug "
                "30723): expect the run's peak a few percent above this plan, most on models of small tensors)"
            )
    budget = run.memory_budget
    if budget:
        worst = max(p.ranks, key=lambda r: r.peak)
        fits = largest_micro_batch(worst, budget * GiB, s.batching.micro_batch_size)
        verdict = "fits" if worst.peak <= budget * GiB else "does NOT fit"
        lines.append(
            f"--memory-budget {budget:g} GiB: this layout {verdict} (peak {_mib(worst.peak)} on rank {worst.rank}); "
            + (
                f"the largest micro-batch that fits is {fits}"
                if fits
                else "no micro-batch fits: shard more (ZeRO-3, --cpu-offload, tensor/pipeline parallelism)"
            )
        )
    lines.extend(f"note: {n}" for n in p.notes)
    return "\n".join(lines)


def plan_records(p: Plan) -> list[dict[str, Any]]:
    """The per-rank prediction as plain numbers (bytes), for scripts and tests."""
    return [
        {
            "rank": r.rank,
            "stage": r.stage,
            "param_bytes": r.params,
            "grad_bytes": r.grads,
            "optimizer_bytes": r.optimizer,
            "activation_bytes": r.activations,
            "transient_bytes": r.transient,
            "host_bytes": r.host,
            "runtime_bytes": r.runtime,
            "reference_bytes": r.reference,
            "forward_grad_bytes": r.forward_grads,
            "peak_bytes": r.peak,
        }
        for r in p.ranks
    ]
