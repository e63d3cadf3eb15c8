"""Process group, topology and collectives: one place that knows ranks.

``init_distributed`` joins the process group a launcher (torchrun, Slurm, Kubernetes) described through
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and builds the device mesh from the resolved
``Topology`` (``rapidlite.config.topology``): named dimensions pp, dp, cp, tp in torchtitan's order,
tensor-parallel ranks neighbours. Every other module asks the returned ``DistributedContext``; nobody
recomputes ranks.

``shutdown`` ends a worker: barrier, ``destroy_process_group``, flushed output, ``os._exit``. On torch
2.13 a gloo worker that simply returns aborts with "terminate called without an active exception" in
1 run of 3 (5 of 8 with FSDP2): the gloo run-loop thread frees pending work during interpreter
finalisation. Exiting this way was clean in every run measured.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rapidlite.config.runtime import ParallelConfig
from rapidlite.config.topology import Topology
from rapidlite.errors import ConfigError, RapidliteError
from rapidlite.runtime.allocator import bound_cpu_retention
from rapidlite.runtime.environ import env_int
from rapidlite.runtime.streams import flush_std_streams

_COLLECTIVE_TIMEOUT: datetime.timedelta | None = None  # the process group's (--distributed-timeout-minutes)


def collective_timeout() -> datetime.timedelta | None:
    """How long a collective of the process group rapidlite started waits before it fails (None: it started none)."""
    return _COLLECTIVE_TIMEOUT


def launched_world_size() -> int | None:
    """WORLD_SIZE when a launcher started this process (torchrun, srun with env, PyTorchJob), else None."""
    return env_int("WORLD_SIZE", 0) or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DistributedContext:
    """This process's place in the world. ``mesh`` is None when no process group was started."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    topology: Topology = Topology()
    device: torch.device = torch.device("cpu")
    mesh: Any = None  # DeviceMesh with dimension "dp" ("pp" before it, "cp" and "tp" after it when used)
    # With expert parallelism: the data-parallel ranks as ("edp", "ep"), each "ep" row holding one copy of every
    # layer's experts split among its ranks, "edp" the ranks that hold the same experts (their data parallelism).
    expert_mesh: Any = None
    dp_cp_mesh: Any = None  # with context parallelism: dp and cp flattened, what DDP/FSDP average over

    def build_meshes(self, device_type: str) -> None:
        """The world's mesh and the meshes derived from it, built by every rank at once (a mesh's new group is
        a collective)."""
        self.mesh = device_mesh(device_type, self.topology)
        if self.topology.cp > 1:
            self.dp_cp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        if self.topology.ep > 1:
            self.expert_mesh = expert_mesh(device_type, self.topology)

    @property
    def initialized(self) -> bool:
        return self.mesh is not None

    @property
    def dp_rank(self) -> int:
        return self.topology.coordinates(self.rank)["dp"]

    @property
    def pp_rank(self) -> int:
        return self.topology.coordinates(self.rank)["pp"]

    @property
    def pp_group(self) -> Any:
        return self.mesh.get_group("pp") if self.mesh is not None and self.topology.pp > 1 else None

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self) -> Any:
        """The data-parallel ranks: replicas that read different samples."""
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @property
    def cp_rank(self) -> int:
        return self.topology.coordinates(self.rank)["cp"]

    @property
    def cp_group(self) -> Any:
        """The context-parallel ranks that split this rank's sequences (None without context parallelism)."""
        return self.mesh.get_group("cp") if self.mesh is not None and self.topology.cp > 1 else None

    @property
    def dp_mesh(self) -> Any:
        """What DDP/FSDP shard and average over: the data-parallel (sub-)mesh, flattened with the
        context-parallel one where there is one (their ranks hold different tokens of the same model)."""
        if self.mesh is None:
            return None
        if self.topology.cp > 1:
            return self.dp_cp_mesh
        return self.mesh["dp"] if self.mesh.ndim > 1 else self.mesh

    @property
    def reduce_group(self) -> Any:
        """The ranks whose gradients, losses and token counts are summed: dp (x cp)."""
        if self.mesh is None:
            return None
        return self.dp_mesh.get_group() if self.topology.cp > 1 else self.dp_group

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"] if self.mesh is not None and self.topology.tp > 1 else None

    @property
    def ep_mesh(self) -> Any:
        return self.expert_mesh["ep"] if self.expert_mesh is not None else None

    @property
    def edp_mesh(self) -> Any:
        return self.expert_mesh["edp"] if self.expert_mesh is not None else None

    # ---------------------------------------------------------------- collectives (no-ops on one process)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) over data-parallel ranks (and context-parallel ones: their tokens differ); returns a new
        tensor on the tensor's device."""
        if not self.initialized or self.topology.reduce_size == 1:
            return tensor
        work = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(work, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.reduce_group)
        return work.to(tensor.device)

    def all_reduce_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the stages of this rank's pipeline (one process per stage; a no-op without one)."""
        if self.pp_group is None:
            return tensor
        work = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(work, group=self.pp_group)
        return work.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0 over data-parallel ranks, in rank order; sizes along dim 0 may differ."""
        if not self.initialized or self.dp_size == 1:
            return tensor
        local = tensor.detach().to(self.device).contiguous()
        size = torch.tensor([local.shape[0]], device=self.device, dtype=torch.long)
        sizes = [torch.zeros_like(size) for _ in range(self.dp_size)]
        dist.all_gather(sizes, size, group=self.dp_group)
        longest = max(int(s) for s in sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.dp_size)]
        dist.all_gather(parts, padded, group=self.dp_group)
        gathered = torch.cat([p[: int(n)] for p, n in zip(parts, sizes, strict=True)])
        return gathered.to(tensor.device)

    def barrier(self) -> None:
        if self.initialized:
            dist.barrier()


def all_reduce_world(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over every rank of the job (a copy; the input itself when no group is up)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    work = tensor.detach().clone()
    if dist.get_backend() == "nccl" and not work.is_cuda:  # nccl reduces device tensors only
        work = work.cuda()
    dist.all_reduce(work, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return work.to(tensor.device)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """Under torchrun, a store private to this attempt of the worker group. After a restart
    (``--max-restarts``) the workers would otherwise read the addresses the previous attempt's workers
    published and fail to connect (gloo, torch 2.13; plain torchrun does the same)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}  # env:// as the launcher set it up
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return {"store": dist.PrefixStore(f"rapidlite/attempt_{attempt}", store), "rank": rank, "world_size": world}


def init_distributed(
    topology: Topology, cfg: ParallelConfig, need_process_group: bool | None = None
) -> DistributedContext:
    """Join the process group the launcher described (or none for a single process that needs none), split
    as ``topology`` says; ``cfg`` gives the process group's backend and timeout.

    A single process starts a one-process group where sharding is asked for (``need_process_group``, by
    default where the topology has a ZeRO stage or DeepSpeed), so FSDP and the sharded optimizer run the same
    code on 1 rank as on N.
    """
    world = launched_world_size() or 1
    if world != topology.world_size:
        raise ConfigError(
            f"this process is one of {world}, but the run was resolved for {topology.world_size}: start it through "
            "rapidlite or torchrun, which start --nproc-per-node (x --nnodes) processes"
        )
    if need_process_group is None:
        need_process_group = topology.zero_stage > 0 or topology.deepspeed
    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    device = pick_device(local_rank)
    if device.type == "cpu":  # the resident peak follows the live tensors (what --dry-run plans on a CPU)
        bound_cpu_retention()
    ctx = DistributedContext(rank=rank, local_rank=local_rank, world_size=world, topology=topology, device=device)
    if world == 1 and not need_process_group:
        return ctx
    if not dist.is_initialized():
        backend = cfg.distributed_backend or default_backend(device)
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
        timeout = datetime.timedelta(minutes=cfg.distributed_timeout_minutes)
        if launched_world_size():
            rendezvous = _attempt_store(rank, world, timeout)  # env:// as the launcher set it up
        else:
            # A private one-process group on a free local port, described explicitly: the environment keeps
            # saying that no launcher started this process (teardown and exit codes depend on it).
            rendezvous = {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None, **rendezvous
        )
        global _COLLECTIVE_TIMEOUT
        _COLLECTIVE_TIMEOUT = timeout
    ctx.build_meshes(device.type)
    return ctx


def expert_mesh(device_type: str, topology: Topology) -> Any:
    """Expert parallelism's mesh of each pipeline stage's data-parallel ranks, ``("edp", "ep")`` (``("pp", "edp",
    "ep")`` with pipeline parallelism, its stages outermost as in the world's mesh): ``ep`` neighbouring ranks
    split the experts (tensor parallelism is refused with it)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = (topology.dp * topology.cp // topology.ep, topology.ep), ("edp", "ep")
    if topology.pp > 1:
        shape, names = (topology.pp, *shape), ("pp", *names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def device_mesh(device_type: str, topology: Topology) -> Any:
    """The world's mesh, its dimensions named (``Topology.mesh_shape``: pp, dp, cp, tp, outermost first, so
    tensor-parallel groups are neighbouring ranks). Dimensions of size 1 are left out, except dp."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = topology.mesh_shape
    return init_device_mesh(
        device_type, tuple(size for _, size in shape), mesh_dim_names=tuple(name for name, _ in shape)
    )


# -------------------------------------------------------------------------------------------- ending
def shutdown(exit_code: int = 0) -> None:
    """End a launched worker cleanly (see the module docstring); returns only when no group is up."""
    if dist.is_available() and dist.is_initialized():
        if exit_code == 0:
            try:
                dist.barrier()
            except Exception:  # a peer already gone: nothing left to wait for
                pass
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        flush_std_streams()
        os._exit(exit_code)
    if launched_world_size():
        flush_std_streams()
        os._exit(exit_code)


def _callstack(exc: BaseException) -> str:
    """A bug's traceback for the launcher to print: a ``--user-script``'s own frames where it raised
    (``cli.run_user_script``), else the whole of it."""
    own = getattr(exc, "script_traceback", None)
    return own if isinstance(own, str) else "".join(traceback.format_exception(exc))


def report_worker_error(exc: BaseException) -> int:
    """Record a worker's failure for the launcher (one line for user errors, the traceback for bugs) and
    return the exit code. Printing is left to the launcher, so N ranks never print N tracebacks."""
    user_error = isinstance(exc, RapidliteError)
    code = exc.exit_code if user_error else 1
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return code
    data = {
        "message": {
            "message": str(exc) if user_error else f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "" if user_error else _callstack(exc),
                "timestamp": str(int(time.time())),
            },
        },
        "rapidlite": {"user_error": user_error, "time_ns": time.time_ns(), "rank": env_int("RANK", 0)},
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
    return code
