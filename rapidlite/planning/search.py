"""``--dry-run --search``: the fastest layouts that fit ``--memory-budget``, by the step-time model.

The layouts are the choices the command line leaves open (a flag given is kept): tensor and pipeline parallel
sizes (data parallelism takes the rest of the world), for a mixture of experts the expert-parallel size (a
divisor of the data-parallel ranks and of the experts), for a sequence of at least ``LONG`` tokens the
context-parallel size (with a task that splits its sequences), the data-parallel strategy (DDP, ZeRO-1, FSDP2's ZeRO-2
and ZeRO-3), the micro-batch (the global batch stays; accumulation follows), activation checkpointing (off,
selective, full) and, with ZeRO-2/3, CPU offload. Layouts the run would refuse (a size that does not divide the
heads, a strategy that does not combine with tensor parallelism) are left out.

Planning a layout's memory builds its model and strategy on ``meta``, a second or so each, so the search goes
in two passes: every layout's step time from the whole model's parameter counts split as the layout splits
them (cheap), then the real plan, memory and step time of the fastest ones in that order until ``TOP`` fit
(at most ``MAX_PLANS`` plans).
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from rapidlite.errors import ConfigError
from rapidlite.planning.devices import DeviceProfile
from rapidlite.planning.timing import Throughput, step_time

TOP = 5
MAX_PLANS = 40
LONG = 8192  # tokens: from this --seq-length on, the search tries context parallelism
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
STRATEGIES = {  # name: flags
    "DDP": [],
    "ZeRO-1": ["--zero-1-memory-optimization"],
    "ZeRO-2": ["--zero-2-memory-optimization"],
    "ZeRO-3": ["--zero-3-memory-optimization"],
}
CHECKPOINTING = {"off": [], "selective": ["--checkpoint-activations", "--recompute-granularity", "selective"]}
CHECKPOINTING["full"] = ["--checkpoint-activations", "--recompute-granularity", "full"]
# The flags a layout sets, which the user's command loses where the search chooses them.
LAYOUT_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
    "--zero-1-memory-optimization", "--zero-2-memory-optimization", "--zero-3-memory-optimization",
    "--fsdp-memory-optimization", "--checkpoint-activations", "--recompute-granularity", "--cpu-offload",
    "--expert-model-parallel-size", "--context-parallel-size",
)  # fmt: skip
# Flags only a dry run reads: not in the printed command of the run.
PLAN_ONLY = ("--dry-run", "--search", "--device-profile", "--memory-budget")


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    strategy: str
    micro: int
    checkpointing: str
    offload: bool
    ep: int = 1
    cp: int = 1

    def flags(self) -> list[str]:
        out = ["--tensor-model-parallel-size", str(self.tp)] if self.tp > 1 else []
        out += ["--pipeline-model-parallel-size", str(self.pp)] if self.pp > 1 else []
        out += ["--context-parallel-size", str(self.cp)] if self.cp > 1 else []
        out += ["--expert-model-parallel-size", str(self.ep)] if self.ep > 1 else []
        out += STRATEGIES[self.strategy] + ["--micro-batch-size", str(self.micro)] + CHECKPOINTING[self.checkpointing]
        return out + (["--cpu-offload"] if self.offload else [])

    def describe(self) -> str:
        data = f"DP {self.dp} {self.strategy}" if self.dp > 1 else "one data-parallel replica"
        parts = [f"TP {self.tp}" if self.tp > 1 else "", f"PP {self.pp}" if self.pp > 1 else "", data]
        parts += [f"CP {self.cp}"] if self.cp > 1 else []
        parts += [f"EP {self.ep}"] if self.ep > 1 else []
        parts += [f"micro-batch {self.micro}", f"checkpointing {self.checkpointing}"]
        parts += ["CPU offload"] if self.offload else []
        return ", ".join(p for p in parts if p)


@dataclass
class Result:
    layout: Layout
    argv: list[str]
    throughput: Throughput
    peak: int | None = None  # bytes, the largest rank's, from the real plan


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the flags ``names`` (and the values of those that take one)."""
    from rapidlite.config.parser import build_parser

    takes_value = {
        opt: action.nargs != 0 for action in build_parser()._actions for opt in action.option_strings
    }  # fmt: skip
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in names:
            skip = takes_value.get(name, False) and "=" not in token
            continue
        out.append(token)
    return out


def _settings(argv: list[str]) -> Any:
    """The settings a command line resolves to, as the CLI resolves them."""
    from rapidlite.config.parser import parse_known
    from rapidlite.resolve import resolve_command

    return resolve_command(parse_known(argv)[0]).sections


def _open_choices(
    settings: Any, argv: list[str], world: int, layers: int, heads: int, experts: int = 0
) -> list[Layout]:
    """Every layout the command line's flags leave open (an embedded demo's chosen values stay open)."""
    from rapidlite.config.parser import build_parser

    dests = {opt: action.dest for action in build_parser()._actions for opt in action.option_strings}
    on_line = {dests.get(token.split("=", 1)[0]) for token in argv}

    def given(dest: str) -> bool:
        return dest in on_line

    from rapidlite.resolve.topology import ZERO_STAGE_FLAGS

    model = settings.model
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if world % n == 0]
    tps = [settings.topology.tp] if given("tensor_model_parallel_size") else sizes
    pps = [settings.topology.pp] if given("pipeline_model_parallel_size") else sizes
    strategy_given = any(given(f) for f in ZERO_STAGE_FLAGS)
    strategies = [_STRATEGY_OF_STAGE[settings.topology.zero_stage]] if strategy_given else list(STRATEGIES)
    micros = [settings.batching.micro_batch_size] if given("micro_batch_size") else MICRO_BATCHES
    if given("checkpoint_activations"):
        checkpointing = [model.recompute_granularity if model.checkpoint_activations else "off"]
    else:
        checkpointing = list(CHECKPOINTING)
    offloads = [settings.topology.cpu_offload] if given("cpu_offload") else [False, True]
    eps = [settings.topology.ep] if given("expert_model_parallel_size") or not experts else sizes
    seq = settings.data.seq_length or 0
    cps = [settings.topology.cp] if given("context_parallel_size") or seq < LONG else sizes
    global_batch = settings.batching.global_batch_size
    layouts = []
    for tp, pp, strategy, micro, ckpt, offload, ep, cp in itertools.product(
        tps, pps, strategies, micros, checkpointing, offloads, eps, cps
    ):
        dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
        if not dp or heads % tp or pp > layers or global_batch % (micro * dp):
            continue
        if ep > 1 and (dp % ep or experts % ep or tp > 1):
            continue  # what expert parallelism does not divide or combine with
        if dp * cp == 1 and strategy != "DDP":  # nothing to shard over
            continue
        if offload and strategy not in ("ZeRO-2", "ZeRO-3"):
            continue
        layouts.append(Layout(tp, pp, dp, strategy, micro, ckpt, offload, ep, cp))
    return layouts


def _heads_and_layers(settings: Any, base: Any) -> tuple[int, int]:
    """What tensor parallelism must divide (the attention heads and the key/value heads' greatest common
    divisor) and the blocks pipeline stages split, from the model's config."""
    import math

    from rapidlite.planning.model import meta_model

    config = getattr(meta_model(settings), "config", None)
    heads = getattr(config, "num_attention_heads", None) or settings.model.num_attention_heads or 1
    kv = getattr(config, "num_key_value_heads", None) or heads
    layers = base.flops.num_layers or settings.model.num_layers or 1
    return math.gcd(heads, kv), layers


def _num_experts(settings: Any) -> int:
    from rapidlite.models.spec import moe_layout
    from rapidlite.planning.model import meta_model

    model = meta_model(settings)
    return moe_layout(model).num_experts(model.config)


_STRATEGY_OF_STAGE = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _estimate(base: Any, settings: Any, profile: DeviceProfile, per_node: int) -> Throughput:
    """A layout's step time from the whole model's counts, split as the layout splits them."""
    topology = settings.topology
    tp, pp, dp, zero = topology.tp, topology.pp, topology.dp, topology.zero_stage
    split_experts = base.expert_params - base.expert_params // topology.ep  # the experts other ranks hold
    trainable = base.trainable_params // (tp * pp) - split_experts
    rank = SimpleNamespace(  # the last stage's (the output layer's): the slowest where the stages are even
        rank=0,
        stage=pp - 1,
        compute_params=base.total_params // (tp * pp) - split_experts,
        trainable_params=trainable,
        stepped_params=trainable // (dp * topology.cp if zero >= 1 else 1),
        expert_params=base.expert_params // topology.ep if topology.ep > 1 else 0,
        trainable_expert_params=base.expert_params // topology.ep if topology.ep > 1 else 0,
    )
    return step_time(replace(base, settings=settings, ranks=[rank]), profile, per_node)


def search(argv: list[str], settings: Any, profile: DeviceProfile, per_node: int, base: Any) -> list[Result]:
    """The ``TOP`` fastest layouts whose planned peak fits ``--memory-budget`` (``base``: the given layout's plan,
    for the model's counts)."""
    from rapidlite.planning import GiB, plan

    budget = settings.training.memory_budget
    if budget is None:
        raise ConfigError("--search keeps the layouts that fit a device: give --memory-budget GIB")
    if settings.topology.deepspeed:
        raise ConfigError("--search chooses among PyTorch's layouts: drop --deepspeed")
    heads, layers = _heads_and_layers(settings, base)
    experts = base.expert_params and _num_experts(settings)
    stem = _strip(_strip(argv, PLAN_ONLY), LAYOUT_FLAGS)
    estimates = []
    for layout in _open_choices(settings, argv, base.world_size, layers, heads, experts):
        candidate = [*stem, *layout.flags()]
        try:
            parsed = _settings([*candidate, "--dry-run"])
        except ConfigError:
            continue  # a layout the run would refuse
        estimates.append(Result(layout, candidate, _estimate(base, parsed, profile, per_node)))
    estimates.sort(key=lambda r: r.throughput.step.seconds)
    fitting, planned = [], 0
    for result in estimates:
        if len(fitting) >= TOP or planned >= MAX_PLANS:
            break
        planned += 1
        parsed = _settings([*result.argv, "--dry-run"])
        try:
            the_plan = plan(parsed, gpu=not profile.shared_by_node)
        except ConfigError:
            continue
        result.peak = max(r.peak for r in the_plan.ranks)
        if result.peak <= budget * GiB:
            result.throughput = step_time(the_plan, profile, per_node)
            fitting.append(result)
    fitting.sort(key=_rank_key)
    return fitting


def _rank_key(result: Result) -> tuple[float, int]:
    """Faster first; among step times within 0.5% of each other, the smaller peak (more room to spare)."""
    import math

    return round(math.log(result.throughput.step.seconds) / math.log(1.005)), result.peak or 0


def format_search(results: list[Result], budget: float, considered: int | None = None) -> list[str]:
    from rapidlite.planning import GiB
    from rapidlite.planning.timing import format_time

    if not results:
        return [
            f"--search: no layout fits --memory-budget {budget:g} GiB; raise the budget, add devices, or lower "
            "--global-batch-size or --seq-length"
        ]
    lines = [f"--search: the {len(results)} fastest layouts that fit --memory-budget {budget:g} GiB"]
    for i, r in enumerate(results, 1):
        t = r.throughput
        lines.append(
            f"  {i}. {r.layout.describe()}: {format_time(t.step.seconds)} a step, "
            f"{t.tokens_per_second_per_device:,.0f} tokens/s per device, MFU {100 * t.mfu:.1f}%, "
            f"peak {r.peak / GiB:.1f} GiB"
        )
        lines.append(f"     rapidlite {shlex.join(r.argv)}")
    if len(results) > 1:
        lines.append("  " + why_first(results))
    return lines


def why_first(results: list[Result]) -> str:
    """One line: which layouts tie with the best, and how much faster it is than the next slower one, with the
    terms that make the difference."""
    best = results[0].throughput.step
    slower = [(i, r) for i, r in enumerate(results[1:], 2) if r.throughput.step.seconds > 1.005 * best.seconds]
    ties = len(results) - len(slower)
    tie = ""
    if ties > 1:
        tie = f"1-{ties} are predicted as fast (within 0.5%), listed by peak memory (1: the most to spare); "
    if not slower:
        return f"why 1 wins: {tie.rstrip('; ')}"
    k, other = slower[0]
    b = other.throughput.step
    diffs = sorted(((b.terms.get(t, 0) - best.terms.get(t, 0), t) for t in {*best.terms, *b.terms}), reverse=True)
    saved = [f"{t} {1e3 * d:.1f} ms" for d, t in diffs if d > 0][:2]
    reason = f" (it spends less on: {', '.join(saved)})" if saved else ""
    return f"why 1 wins: {tie}{100 * (b.seconds / best.seconds - 1):.1f}% faster a step than {k}{reason}"
