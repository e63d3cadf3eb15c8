"""``Topology`` and ``Batching``: how the world is split and how a step is batched, as ``resolve`` derives them once.

Declared here, below everything that reads them (the process group and its mesh, the strategies, the data
loaders, the planner), so that none of those imports ``resolve``; built only by ``rapidlite.resolve.topology``,
where every spelling of a layout (Megatron's and Rapidformer's flags, ``--use-distributed-optimizer``, a
DeepSpeed file's keys) maps onto them in one table. Nothing below ``resolve`` reads the ZeRO flags or works out a
stage, a data-parallel size or an accumulation again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidlite.errors import ConfigError

# The mesh's dimensions, outermost first, in torchtitan's order (pp, dp, cp, tp): tensor-parallel ranks are
# neighbours, so rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index. Expert parallelism borrows
# its ranks from dp x cp (as torchtitan's does), so it is not a dimension of the world's mesh.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")

BACKENDS = ("torch", "deepspeed")


@dataclass(frozen=True)
class Topology:
    """The world split into pipeline stages, data-parallel replicas, context- and tensor-parallel shards, with the
    data-parallel layout: the ZeRO stage (0: DDP, 1: sharded optimizer state, 2: + gradients, 3: + parameters),
    optimizer offload to host memory, and which engine runs it (``torch``: PyTorch's own, ``deepspeed``)."""

    world_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks, which share the replica's batch
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp x cp ranks
    zero_stage: int = 0
    cpu_offload: bool = False
    backend: str = "torch"

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)}: every parallel size must be at least 1")
        if self.pp * self.dp * self.cp * self.tp != self.world_size:
            raise ConfigError(
                f"the world of {self.world_size} process{'es' if self.world_size > 1 else ''} is not pipeline x data "
                f"x context x tensor parallel size {self.pp} x {self.dp} x {self.cp} x {self.tp}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"--expert-model-parallel-size {self.ep} does not divide the {self.dp * self.cp} data-parallel ranks "
                "whose experts it splits: give a divisor of them"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage {self.zero_stage}: must be 0, 1, 2 or 3")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: must be one of {', '.join(BACKENDS)}")

    @classmethod
    def split(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, **layout: object) -> Topology:
        """The world split by tensor, pipeline and context parallelism, the rest data parallel (refused, one
        line, where ``world_size`` is not a multiple of tp x pp x cp)."""
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            sizes = f"tensor x pipeline parallel size {tp} x {pp}"
            if cp > 1:
                sizes = f"tensor x pipeline x context parallel size {tp} x {pp} x {cp}"
            raise ConfigError(
                f"the world of {world_size} process{'es' if world_size > 1 else ''} is not divisible by {sizes}: "
                f"set --nproc-per-node (x --nnodes) to a multiple of {model_parallel}"
            )
        return cls(world_size=world_size, dp=world_size // model_parallel, tp=tp, pp=pp, cp=cp, **layout)  # type: ignore[arg-type]

    @property
    def deepspeed(self) -> bool:
        """The ZeRO stages run by DeepSpeed's engine instead of PyTorch's machinery."""
        return self.backend == "deepspeed"

    @property
    def fully_sharded(self) -> bool:
        """Gradients (stage 2) and parameters (stage 3) sharded: FSDP2 on PyTorch's machinery."""
        return self.zero_stage >= 2

    @property
    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The named dimensions of the world's mesh, outermost first; those of size 1 are left out, except dp
        (what DDP and FSDP average over)."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        return tuple((name, sizes[name]) for name in MESH_DIMS if sizes[name] > 1 or name == "dp")

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension of the mesh (all of them, size 1 included)."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        index: dict[str, int] = {}
        for name in reversed(MESH_DIMS):
            index[name] = rank % sizes[name]
            rank //= sizes[name]
        return index

    @property
    def reduce_size(self) -> int:
        """The ranks whose gradients are averaged, dp x cp: context-parallel ranks hold different tokens of the
        same samples, so their gradients are summed like data-parallel ones."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        """The data-parallel layout as the logs name it (``ZeRO-2 (FSDP2) + CPU offload``)."""
        offload = " + CPU offload" if self.cpu_offload else ""
        if self.deepspeed:
            return f"DeepSpeed ZeRO-{self.zero_stage}{offload}"
        return {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2 (FSDP2)", 3: "ZeRO-3 (FSDP2)"}[self.zero_stage] + offload


def check_context_parallel(
    topology: Topology, seq_length: int | None, sequence_parallel: bool = False, comm_type_given: bool = False
) -> None:
    """One line for a layout context parallelism does not compose with (yet), a sequence it cannot split, or its
    attention chosen without it."""
    cp = topology.cp
    if cp <= 1:
        if comm_type_given:
            raise ConfigError("--cp-comm-type chooses context parallelism's attention: add --context-parallel-size N")
        return
    flag = f"--context-parallel-size {cp}"
    others = [
        (topology.deepspeed, "--deepspeed", "DeepSpeed's engine"),
        (topology.ep > 1, "--expert-model-parallel-size", "expert parallelism"),
        (sequence_parallel, "--sequence-parallel", "tensor parallelism's sequence split"),
    ]
    for given, other, what in others:
        if given:
            raise ConfigError(
                f"{flag} with {other}: context parallelism does not combine with {what} yet; combine it with data "
                "parallelism (DDP or ZeRO-1/2/3) and tensor parallelism"
            )
    if seq_length is not None and seq_length % (2 * cp):
        raise ConfigError(
            f"{flag}: --seq-length {seq_length} is not divisible by 2 x {cp} (each rank holds two of 2 x {cp} "
            f"equal chunks): use a multiple of {2 * cp}"
        )


@dataclass(frozen=True)
class Batching:
    """One optimizer step's batch: ``micro_batch_size`` samples per forward pass on each data-parallel rank,
    ``gradient_accumulation_steps`` of them per step, ``global_batch_size`` = micro x accumulation x dp samples
    in all; ``seq_length`` (None where the task leaves it to the data) gives the tokens."""

    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    global_batch_size: int = 1
    seq_length: int | None = None

    @property
    def samples_per_rank(self) -> int:
        """The samples one data-parallel rank reads per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def tokens_per_rank(self) -> int | None:
        """The tokens one data-parallel rank reads per optimizer step (None without a fixed sequence length)."""
        return None if self.seq_length is None else self.samples_per_rank * self.seq_length
