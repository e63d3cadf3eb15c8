"""``--dry-run``: the plan of a run and a per-rank memory prediction, printed without training.

The plan resolves every flag as a real launch would, then measures instead of guessing where it can:

- **Model states** come from the real code: the model is built on the ``meta`` device (no memory), and each
  distinct rank of the layout (one per pipeline stage) sets it up with the run's own strategy under a fake
  process group of the target world size (``torch.testing``'s ``FakeStore`` backend, the one torchtitan's
  memory estimator uses). Tensor-parallel shards, pipeline pruning, FSDP shards and LoRA adapters are
  therefore exactly what the run will hold. Gradients and optimizer state follow from the trainable local
  parameters (AdamW: two fp32 moments; ZeRO-1: sharded over data parallelism; ``--cpu-offload``: on the
  host).
- **Activations** come from one forward pass of the model on ``meta`` tensors of the run's micro-batch and
  sequence length: every tensor autograd saves for the backward is counted (``saved_tensors_hooks``),
  attributed to the transformer block that saved it. The layout then scales them the way it changes them:
  tensors whose last dimension is not the hidden size (heads, MLP intermediates, vocabulary logits) are split
  by tensor parallelism, hidden-size tensors by sequence parallelism only; a pipeline stage holds its own
  blocks for the micro-batches its schedule keeps in flight (1F1B: ``pp - stage``; GPipe: all);
  ``--checkpoint-activations`` keeps block inputs (``full``) or the matrix-multiply and attention outputs
  (``selective``) and recomputes one block at a time in the backward pass.
- **Transient memory** at the peak: the backward pass's gradient buffers of the largest saved tensors (the
  logits), DDP's gradient buckets, and the full parameters FSDP gathers (one block at a time for ZeRO-3, the
  whole model between forward and backward for ZeRO-2).
- On a CPU the logged peak is the process's resident set, which also holds the Python runtime and libraries:
  the plan adds this process's own resident size (it has imported the same libraries) as "runtime".

DeepSpeed configs get the same accounting with ZeRO's sharding rules (its engine cannot be built on meta).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.sections import LoraConfig
from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TASKS, TaskSpec
from rapidlite.errors import ConfigError

GiB = 2**30
# A user script's data without --seq-length is planned at this length (a black-box task's default is its own).
SCRIPT_SEQ_LENGTH = 128
MiB = 2**20


# ------------------------------------------------------------------------------------------------ the model
def _task_spec(settings: Sections) -> TaskSpec | None:
    """The black-box task the plan is for: None for a user script (whose model the plan reads from its config)."""
    return TASKS.get(settings.task.task) if settings.task.user_script is None else None


def _auto_class(spec: TaskSpec | None, config: Any) -> Any:
    """The class the task builds from ``config`` (its ``TaskSpec``), else the config's own architecture."""
    import transformers

    name = spec.model_class_name(getattr(config, "model_type", None)) if spec is not None else None
    if name is not None:
        return getattr(transformers, name)
    architectures = getattr(config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name is not None and hasattr(transformers, name):
        return getattr(transformers, name)
    return transformers.AutoModel


def meta_model(settings: Sections) -> torch.nn.Module:
    """The run's model on the ``meta`` device: from ``--pretrained-model-name-or-path``'s config (sizes overridden
    by the flags as the tasks do), or the built-in GPT from the flags for pretraining."""
    name, spec = settings.model.pretrained_model_name_or_path, _task_spec(settings)
    if name is None and settings.checkpoint.load is not None and settings.checkpoint.load_is_pretrained_model:
        name = settings.checkpoint.load
    if name is None:
        if spec is None or not spec.from_config:
            raise ConfigError(
                "--dry-run builds the model from its config: give --pretrained-model-name-or-path (a hub name or "
                "a local model directory)"
            )
        from rapidlite.data.tokenizers import tokenizer_of
        from rapidlite.models.gpt import GPTConfig, GPTModel

        vocab_size = tokenizer_of(settings).vocab_size
        with torch.device("meta"):
            return GPTModel(GPTConfig.of(settings, vocab_size))
    from transformers import AutoConfig

    from rapidlite.models.hf import override_sizes

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--dry-run: cannot read the config of {name!r}: {str(e).splitlines()[0]}") from None
    if spec is not None and spec.from_config:
        override_sizes(config, settings.model, settings.data.seq_length)
    auto = _auto_class(spec, config)
    # Auto classes build from a config with from_config; a model class named by the config's architectures
    # (the fallback for a task not listed above) with _from_config.
    build = getattr(auto, "from_config", None) or auto._from_config
    with torch.device("meta"):
        return build(config)


def _forward_loss(model: torch.nn.Module, ids: torch.Tensor, inputs_per_sample: int = 1) -> torch.Tensor:
    """A training forward and loss on meta inputs: logits, then fp32 cross-entropy (as the tasks compute it).
    ``inputs_per_sample`` > 1: each sample is that many sequences (``[questions, choices, tokens]``)."""
    from rapidlite.models.gpt import GPTModel

    if isinstance(model, GPTModel):
        logits = model(ids)
    else:
        # An encoder-decoder's targets as long as its sources: an upper bound where --max-target-length is shorter.
        seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        if inputs_per_sample > 1:
            ids = ids.unsqueeze(1).repeat(1, inputs_per_sample, 1)
        out = model(input_ids=ids, decoder_input_ids=ids) if seq2seq else model(input_ids=ids)
        logits = next(
            (getattr(out, k) for k in ("logits", "prediction_logits") if getattr(out, k, None) is not None), None
        )
        if logits is None:
            logits = out[0]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


# ------------------------------------------------------------------------------------------------ activations
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


def profile_activations(
    model: torch.nn.Module, micro_batch: int, seq_length: int, hidden: int | None, inputs_per_sample: int = 1
) -> Any:
    """Run one meta forward and count what autograd saves (see the module docstring)."""
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
    seen: set[int] = set()
    kept_by_selective: set[int] = set()
    vocab_dims: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            vocab_dims.add(m.num_embeddings)

    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    class Producers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
        with Producers(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _forward_loss(model, ids, inputs_per_sample)
    finally:
        for h in handles:
            h.remove()
    return profile


# ------------------------------------------------------------------------------------------------ model states
@dataclass
class RankPlan:
    """One rank's predicted bytes. ``host``: what ``--cpu-offload`` keeps in host memory instead."""

    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    host: int = 0
    runtime: int = 0
    activation_per_sample: float = 0.0  # how activations and transients grow with the micro-batch

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The device's peak; on a CPU (``runtime`` set) the process's, host memory included."""
        device = self.model_states + self.activations + self.transient
        return device + self.runtime + self.host if self.runtime else device


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


def _strategy_for(settings: Sections, rank: int, world_size: int, precision: Any) -> Any:
    from rapidlite.distributed import DistributedContext, ParallelDims, device_mesh
    from rapidlite.parallel.data_parallel import DataParallelConfig
    from rapidlite.strategies import StrategyContext, select

    dims = ParallelDims(
        world_size, settings.parallel.tensor_model_parallel_size, settings.parallel.pipeline_model_parallel_size
    )
    ctx = DistributedContext(rank=rank, local_rank=rank, world_size=world_size, dims=dims, device=torch.device("cpu"))
    if world_size > 1:
        ctx.mesh = device_mesh("cpu", dims)
    quiet = logging.getLogger("rapidlite.planning")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    return select(StrategyContext(settings, ctx, DataParallelConfig.of(settings.parallel), precision, quiet))


def _optimizer_bytes_per_element(settings: Sections) -> int:
    if settings.optim.optimizer == "sgd":
        return 4 if settings.optim.sgd_momentum else 0
    return 8  # AdamW: exp_avg and exp_avg_sq in fp32


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


def _stage_rank(stage: int, dims: Any) -> int:
    return stage * dims.dp * dims.tp


def _in_flight(settings: Sections, stage: int, pp: int) -> int:
    m = settings.training.gradient_accumulation_steps
    if pp == 1:
        return 1
    if settings.parallel.pipeline_schedule == "gpipe":
        return m
    return min(pp - stage, m)


def plan(settings: Sections) -> Plan:
    """The plan and memory prediction of the run ``settings`` describe (see the module docstring)."""
    from rapidlite.distributed import ParallelDims
    from rapidlite.models import lora
    from rapidlite.models.spec import spec_of
    from rapidlite.precision import resolve_precision
    from rapidlite.resolve import target_world_size

    world_size = target_world_size(settings.parallel)
    dims = ParallelDims(
        world_size, settings.parallel.tensor_model_parallel_size, settings.parallel.pipeline_model_parallel_size
    )
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    precision, _ = resolve_precision(settings.precision.precision, device)
    adapters = settings.lora
    notes: list[str] = []

    # Activations: one meta forward of the whole model, in the compute dtype.
    model = meta_model(settings)
    total = sum(p.numel() for p in model.parameters())
    spec = spec_of(model)
    layers, hidden = spec.layers_and_hidden(getattr(model, "config", None))
    seq = sequence_length(settings, getattr(model, "config", None))
    probe = model.to(precision.dtype) if precision.dtype is not None else model
    per_sample = task.inputs_per_sample if (task := _task_spec(settings)) is not None else 1
    profile = profile_activations(probe, settings.training.micro_batch_size, seq, hidden, per_sample)
    profile_next = profile_activations(probe, settings.training.micro_batch_size + 1, seq, hidden, per_sample)
    n_blocks = len(profile.blocks_split) or 1

    deepspeed = settings.parallel.deepspeed
    ranks: list[RankPlan] = []
    strategy_name = "DeepSpeed"
    trainable_total = None
    for stage in range(dims.pp):
        rank = _stage_rank(stage, dims)
        model = meta_model(settings)
        # Quantisation needs real weights: the plan adapts the full-precision base and counts the quantised
        # bytes afterwards (_quantised_bytes).
        unquantised = dataclasses.replace(adapters, load_in_4bit=False, load_in_8bit=False)
        model = lora.prepare(model, unquantised, precision.dtype, torch.device("meta"), None)
        trainable_total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer = None
        if deepspeed:
            module, strategy_name = model, "DeepSpeed"
        else:
            ctx = _fake_world(rank, world_size) if world_size > 1 else contextlib.nullcontext()
            with ctx:
                strategy = _strategy_for(settings, rank, world_size, precision)
                model.to = lambda *a, _m=model, **k: _m  # the meta model stays on meta
                composed, optimizer = strategy.setup(model, None, None)
                strategy_name = strategy.name
                module = strategy.module(composed)
        ranks.append(
            _rank_plan(settings, dims, rank, stage, module, optimizer, profile, profile_next, n_blocks, deepspeed)
        )
        if adapters.quantized:
            ranks[-1].params -= _quantisable_bytes(module, adapters) - _quantised_bytes(module, adapters)
    if deepspeed:
        notes.append("DeepSpeed: model states follow ZeRO's sharding rules (its engine is not built for the plan)")
    if adapters.quantized:
        notes.append("4-bit/8-bit base weights are counted at their quantised size (0.5 or 1 byte per weight)")
    runtime = _resident_bytes() if device.type == "cpu" else 0
    for r in ranks:
        r.runtime = runtime
    return Plan(
        seq_length=seq,
        settings=settings,
        world_size=world_size,
        strategy=strategy_name,
        precision=precision.name,
        total_params=total,
        trainable_params=trainable_total or 0,
        ranks=ranks,
        notes=notes,
    )


def _quantisable(module: torch.nn.Module, settings: LoraConfig) -> list[torch.nn.Linear]:
    """The frozen linear layers bitsandbytes would quantise (heads and modules trained in full are kept)."""
    from rapidlite.models.lora import SKIP_ON_LOAD, split_names

    keep = {*SKIP_ON_LOAD, *split_names(settings.lora_modules_to_save)}
    return [
        m
        for name, m in module.named_modules()
        if type(m) is torch.nn.Linear
        and not m.weight.requires_grad
        and not any(part in keep for part in name.split("."))
    ]


def _quantisable_bytes(module: torch.nn.Module, settings: LoraConfig) -> int:
    return sum(_bytes(m.weight) for m in _quantisable(module, settings))


def _quantised_bytes(module: torch.nn.Module, settings: LoraConfig) -> int:
    """bitsandbytes' sizes: 4-bit packs two weights a byte plus an fp32 scale per block of 64 (double
    quantisation: an 8-bit scale plus an fp32 one per 256 blocks); 8-bit is a byte a weight plus an fp32 scale
    per output row."""
    total = 0
    for m in _quantisable(module, settings):
        n = m.weight.numel()
        if settings.load_in_4bit:
            blocks = math.ceil(n / 64)
            scales = blocks + 4 * math.ceil(blocks / 256) if settings.bnb_4bit_use_double_quant else 4 * blocks
            total += math.ceil(n / 2) + scales
        else:
            total += n + 4 * m.out_features
    return total


def sequence_length(settings: Sections, config: Any = None) -> int:
    """The run's sequence length: ``--seq-length``, else the fine-tuning task's default maximum; a default (none
    given, or one a task's defaults set) is lowered to the model's learned position table (``config``) as the tasks
    lower it. A given length beyond that table is the run's own one-line refusal, not a failed probe."""
    from rapidlite.models.hf import position_limit, within_positions

    spec = _task_spec(settings)
    # A task that trains its config from scratch grows the table to the length; a script's own data without
    # --seq-length is planned at SCRIPT_SEQ_LENGTH.
    limit = position_limit(config) if config is not None and not (spec and spec.from_config) else None
    if settings.data.seq_length:
        seq_length, explicit = settings.data.seq_length, settings.given("seq_length")
    else:
        seq_length, explicit = SCRIPT_SEQ_LENGTH, False
    refusal = "the model has learned position embeddings for {limit} positions; use --seq-length {limit} or less"
    return within_positions(seq_length, limit, explicit, refusal)


def _resident_bytes() -> int:
    """This process's resident set now (Linux: /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024


def _activations(
    settings: Sections, dims: Any, stage: int, mine: int, profile: ActivationProfile, in_flight: int
) -> tuple[int, float]:
    """This stage's saved bytes for ``in_flight`` micro-batches, and the largest saved tensor."""
    tp, sp = dims.tp, settings.parallel.sequence_parallel
    first, last = stage == 0, stage == dims.pp - 1
    avg = lambda xs: sum(xs) / max(len(xs), 1)
    split, whole = avg(profile.blocks_split) / tp, avg(profile.blocks_whole) / (tp if sp else 1)
    per_block = split + whole
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


def _rank_plan(
    settings: Sections,
    dims: Any,
    rank: int,
    stage: int,
    module: torch.nn.Module,
    optimizer: Any,
    profile: ActivationProfile,
    profile_next: ActivationProfile,
    n_blocks: int,
    deepspeed: bool,
) -> RankPlan:
    from rapidlite.models.spec import find_blocks
    from rapidlite.parallel.data_parallel import DataParallelConfig

    dp_cfg = DataParallelConfig.of(settings.parallel)
    zero, dp = dp_cfg.zero_stage, dims.dp
    params = list(module.parameters())
    param_bytes = sum(_bytes(p) for p in params)
    # Local elements: FSDP's and tensor parallelism's shards are already local here.
    trainable = sum(_local(p).numel() for p in params if p.requires_grad)
    grad_elems = opt_elems = trainable
    if deepspeed:  # ZeRO's partitioning: stage 1 the optimizer state, 2 also gradients, 3 also parameters
        param_bytes //= dp if zero >= 3 else 1
        grad_elems //= dp if zero >= 2 else 1
        opt_elems //= dp if zero >= 1 else 1
    else:  # the optimizer this rank steps: ZeRO-1's partition of whole parameters, FSDP's shards
        local = getattr(optimizer.optimizer, "optim", optimizer.optimizer)
        opt_elems = sum(_local(p).numel() for g in local.param_groups for p in g["params"] if p.requires_grad)
    grads = grad_elems * 4
    optimizer = opt_elems * _optimizer_bytes_per_element(settings)
    host = 0
    if dp_cfg.cpu_offload:
        host, optimizer = optimizer, 0
        host += param_bytes + grads
        param_bytes = grads = 0

    # This stage's activations for the micro-batches in flight.
    blocks = find_blocks(module)
    mine = len(blocks) if blocks is not None else n_blocks
    in_flight = _in_flight(settings, stage, dims.pp)
    activations, largest = _activations(settings, dims, stage, mine, profile, in_flight)
    # How the peak grows with the micro-batch: the difference to a profile one sample larger (some saved
    # tensors, a causal mask or a transposed weight, do not grow with it).
    grown, grown_largest = _activations(settings, dims, stage, mine, profile_next, in_flight)
    last = stage == dims.pp - 1
    held = 2 + (settings.training.gradient_accumulation_steps - 1 if last and dims.pp > 1 else 0)  # see the transients
    per_sample = max(0.0, (grown - activations) + held * (grown_largest - largest))

    # The peak's transients: the largest saved tensor's gradient (and its softmax twin) in the backward, DDP's
    # gradient buckets, FSDP's gathered parameters.
    transient = int(2 * largest)
    if last and dims.pp > 1:
        # The last stage keeps the outputs of the micro-batches it has finished until the step ends.
        transient += int((settings.training.gradient_accumulation_steps - 1) * largest)
    ddp = zero == 1 or (zero == 0 and dims.tp == 1 and dims.pp == 1)
    if not deepspeed and ddp and dp > 1:
        transient += grads  # DDP's buckets: a second copy of the gradients
    if not deepspeed and zero == 2:
        transient += param_bytes * (dp - 1)  # the unsharded parameters stay between forward and backward
    elif not deepspeed and zero == 3 and blocks is not None and len(blocks):
        block_params = sum(_bytes(p) for p in blocks[0].parameters())
        transient += 2 * block_params * dp  # the gathered block and the next one (prefetch)
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
    )


def largest_micro_batch(rank: RankPlan, budget_bytes: float, micro_batch: int) -> int:
    """The largest micro-batch whose predicted peak fits ``budget_bytes`` (activations grow linearly with it)."""
    fixed = rank.peak - rank.activation_per_sample * micro_batch
    if rank.activation_per_sample <= 0:
        return 0 if fixed > budget_bytes else sys.maxsize
    return max(0, math.floor((budget_bytes - fixed) / rank.activation_per_sample))


# ------------------------------------------------------------------------------------------------ printing
def _mib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def describe_mesh(dims: Any) -> list[str]:
    """Which ranks do what: rank = (pp_index * dp + dp_index) * tp + tp_index."""
    lines = []
    for s in range(dims.pp):
        for d in range(dims.dp):
            first = (s * dims.dp + d) * dims.tp
            ranks = list(range(first, first + dims.tp))
            where = f"stage {s}, " if dims.pp > 1 else ""
            shards = f"tensor-parallel shards {ranks}" if dims.tp > 1 else f"rank {ranks[0]}"
            lines.append(f"  {where}replica {d}: {shards}")
    if len(lines) > 8:
        lines = [*lines[:6], f"  ... ({len(lines)} groups in all)"]
    return lines


def format_plan(p: Plan) -> str:
    from rapidlite.distributed import ParallelDims
    from rapidlite.resolve import num_nodes

    s = p.settings
    model, run, parallel = s.model, s.training, s.parallel
    dims = ParallelDims(p.world_size, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size)
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
        f"tensor parallel {dims.tp} x pipeline parallel {dims.pp}",
        *describe_mesh(dims),
        f"batch: micro {run.micro_batch_size} x accumulation {run.gradient_accumulation_steps} x data parallel "
        f"{dims.dp} = global {run.global_batch_size}; sequence length {p.seq_length or sequence_length(s)}"
        + ("" if s.given("seq_length") else " (the task's default; the longest a batch is padded to)"),
        f"strategy: {p.strategy} | precision: {p.precision} | activation checkpointing: {checkpointing}",
        f"model: {p.total_params / 1e6:.2f}M parameters, {p.trainable_params / 1e6:.2f}M trainable",
        "predicted memory per rank (peak of a training step):",
    ]
    header = f"  {'rank':>6} {'params':>11} {'grads':>11} {'optimizer':>11} {'activations':>12} {'transient':>11}"
    if any(r.host for r in p.ranks):
        header += f" {'host':>11}"
    if any(r.runtime for r in p.ranks):
        header += f" {'runtime':>11}"
    lines.append(header + f" {'peak':>11}")
    for r in p.ranks:
        row = f"  {r.rank:>6} " + " ".join(
            f"{_mib(v):>11}" for v in (r.params, r.grads, r.optimizer, r.activations, r.transient)
        )
        row = row.replace(f"{_mib(r.activations):>11}", f"{_mib(r.activations):>12}", 1)
        if any(x.host for x in p.ranks):
            row += f" {_mib(r.host):>11}"
        if any(x.runtime for x in p.ranks):
            row += f" {_mib(r.runtime):>11}"
        lines.append(row + f" {_mib(r.peak):>11}")
    if any(r.runtime for r in p.ranks):
        lines.append("  (CPU: the peak is the process's resident memory, so it includes the runtime: Python, torch)")
    budget = run.memory_budget
    if budget:
        worst = max(p.ranks, key=lambda r: r.peak)
        fits = largest_micro_batch(worst, budget * GiB, run.micro_batch_size)
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
            "peak_bytes": r.peak,
        }
        for r in p.ranks
    ]
