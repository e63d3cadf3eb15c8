"""Device profiles for ``--dry-run --device-profile``: what the step-time model (``rapidlite.planning.timing``)
knows of a device and its cluster.

A profile is a handful of numbers: the dense peak FLOP/s per precision, the memory bandwidth, how much of the
peak large matrix multiplies and attention reach, and the bandwidth and latency of the links between devices
(within a node: NVLink or PCIe; across nodes: InfiniBand/RoCE, per device), the host link (PCIe, for CPU
offload) and the host's optimizer speed. The built-in GPU profiles take their peaks from the datasheet table
``rapidlite.models.flops.GPU_PEAKS``; ``FILE`` (JSON or YAML) gives the same fields for another device (a built-in
profile's name under ``base`` fills what the file leaves out); ``cpu`` is measured on this machine
(``cpu_profile``, below).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rapidlite.errors import ConfigError
from rapidlite.runtime.cache import cache_root, make_cache_dir

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One device and its cluster's links. Bandwidths are bytes/s per device (a collective's bus bandwidth),
    latencies seconds per message."""

    name: str
    flops: dict[str, float]  # dense peak FLOP/s by precision name ("bf16", "fp16", "fp32", "tf32")
    memory_bandwidth: float  # device memory, bytes/s
    matmul_efficiency: float  # the fraction of the peak large matrix multiplies reach
    attention_efficiency: float  # the fraction fused attention (forward and backward) reaches
    devices_per_node: int
    intra_node_bandwidth: float  # NVLink (or PCIe without it)
    intra_node_latency: float
    inter_node_bandwidth: float  # the node's network bandwidth per device
    inter_node_latency: float
    host_bandwidth: float  # device <-> host (CPU offload)
    optimizer_rate: float  # parameters per second an AdamW step updates on the device
    host_optimizer_rate: float  # parameters per second an AdamW step updates on the host (CPU offload)
    # The node's processes share one device's compute and memory (a CPU: each process gets its share of cores).
    shared_by_node: bool = False
    # Collectives run beside the compute (a GPU's streams); on a CPU they take the same cores, so nothing hides.
    overlaps_communication: bool = True
    source: str = ""  # where the numbers come from
    # Measured matmul efficiency by the size n of an n x n x n multiply (a CPU's, whose small multiplies fall far
    # below its peak); matmul_efficiency is taken where this is absent.
    matmul_efficiency_by_size: dict[str, float] | None = None
    # An all-gather's and a reduce-scatter's time into one tensor (FSDP2's, and sequence parallelism's) over the
    # ring formula at the all-reduce's bus bandwidth. NCCL runs the three at one bus bandwidth (1.0); gloo copies
    # through per-rank lists and runs them 1.5-4x slower than its all-reduce, measured by the cpu profile.
    all_gather_slowdown: float = 1.0
    reduce_scatter_slowdown: float = 1.0
    # Seconds tensor parallelism's DTensor dispatch adds on the host to a block's forward and backward of one
    # micro-batch. A GPU's kernels run behind the host's dispatch, so the built-in profiles have none; the cpu
    # profile measures it.
    tensor_parallel_overhead: float = 0.0

    def matmul_efficiency_at(self, size: int) -> float:
        """The efficiency of multiplies whose smallest side is ``size`` (log-linear between measured sizes)."""
        table = sorted((int(k), v) for k, v in (self.matmul_efficiency_by_size or {}).items())
        if not table:
            return self.matmul_efficiency
        if size <= table[0][0]:
            return table[0][1]
        for (n0, e0), (n1, e1) in zip(table, table[1:], strict=False):
            if size <= n1:
                w = math.log(size / n0) / math.log(n1 / n0)
                return e0 + w * (e1 - e0)
        return table[-1][1]

    def peak(self, precision: str) -> float:
        """The dense peak at a run's precision (``fp32`` on a GPU counts TF32 when the profile has it)."""
        key = "bf16" if precision in ("bf16", "fp16") and "bf16" in self.flops else precision
        if key not in self.flops:
            key = "fp32"
        return self.flops[key]


def _gpu(name: str, datasheet: str, memory_tbs: float, nvlink_gbs: float, network_gbs: float, **extra: Any) -> Any:
    from rapidlite.models.flops import GPU_PEAKS

    half, tf32, fp32 = next((h, t, f) for key, h, t, f in GPU_PEAKS if key == datasheet)
    flops = {"bf16": half, "fp16": half, "fp32": fp32, **({"tf32": tf32} if tf32 else {})}
    fields = {
        "name": name,
        "flops": flops,
        "memory_bandwidth": memory_tbs * 1e12,
        "matmul_efficiency": 0.70,
        "attention_efficiency": 0.45,
        "devices_per_node": 8,
        "intra_node_bandwidth": nvlink_gbs * GB,
        "intra_node_latency": 10e-6,
        "inter_node_bandwidth": network_gbs * GB,
        "inter_node_latency": 20e-6,
        "host_bandwidth": 25 * GB,
        # AdamW reads a parameter, its gradient and two moments and writes three of them: 28 bytes in fp32.
        "optimizer_rate": memory_tbs * 1e12 / 28,
        "host_optimizer_rate": 1.5e9,
        "source": f"datasheet peaks ({datasheet}), {memory_tbs} TB/s memory, {nvlink_gbs} GB/s bus bandwidth in a "
        f"node, {network_gbs} GB/s per device across nodes",
    }
    return fields | extra


# Bus bandwidths are what NCCL's tests reach (about 80% of the links' unidirectional rate): H100/H200 NVLink 4
# 450 GB/s -> 360, A100 NVLink 3 300 -> 240; across nodes one 400 Gb/s NIC per H100 (50 GB/s -> 40), 200 Gb/s per
# A100 (25 -> 20); L40S has no NVLink: PCIe 4.0 x16 (32 GB/s -> 25).
BUILT_IN: dict[str, dict[str, Any]] = {
    "h100-sxm": _gpu("h100-sxm", "H100 SXM", 3.35, 360, 40),
    "h200": _gpu("h200", "H200", 4.8, 360, 40),
    "a100-80g": _gpu("a100-80g", "A100", 2.0, 240, 20),
    "l40s": _gpu("l40s", "L40S", 0.864, 25, 20, devices_per_node=8),
}


def device_profile(spec: str) -> DeviceProfile:
    """The profile ``--device-profile`` names: a built-in name, ``cpu`` (measured here, cached), or a file."""
    if spec in BUILT_IN:
        return DeviceProfile(**BUILT_IN[spec])
    if spec == "cpu":
        return cpu_profile()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--device-profile {spec}: not a profile name ({', '.join([*BUILT_IN, 'cpu'])}) nor a file; "
            "give one of these or a JSON/YAML file with the fields of rapidlite.planning.devices.DeviceProfile"
        )
    return _from_file(path)


def _from_file(path: Path) -> DeviceProfile:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) if path.suffix in (".yaml", ".yml") else json.loads(path.read_text())
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"--device-profile {path}: cannot read it ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--device-profile {path}: expected a mapping of the profile's fields")
    base = data.pop("base", None)
    if base is not None and base not in BUILT_IN:
        raise ConfigError(f"--device-profile {path}: base {base!r} is not one of {', '.join(BUILT_IN)}")
    names = [f.name for f in dataclasses.fields(DeviceProfile)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"--device-profile {path}: unknown fields {', '.join(unknown)}; the fields: {sorted(names)}")
    data = {key: _number(path, key, value) for key, value in data.items()}
    fields = {**(BUILT_IN[base] if base else {}), "name": path.stem, "source": str(path), **data}
    required = {f.name for f in dataclasses.fields(DeviceProfile) if f.default is dataclasses.MISSING}
    missing = sorted(required - set(fields))
    if missing:
        raise ConfigError(f"--device-profile {path}: missing {', '.join(missing)} (or name a built-in under base)")
    return DeviceProfile(**fields)


def _number(path: Path, key: str, value: Any) -> Any:
    """A numeric field as a number (YAML reads ``1.0e10`` as a string), ``flops`` as numbers by precision."""
    if key in ("name", "source", "shared_by_node", "overlaps_communication"):
        return value
    if key == "matmul_efficiency_by_size":
        if not isinstance(value, dict):
            raise ConfigError(f"--device-profile {path}: {key} maps a multiply's size to its efficiency, e.g. 512: 0.4")
        return {str(k): _number(path, f"{key}.{k}", v) for k, v in value.items()}
    if key == "flops":
        if not isinstance(value, dict):
            raise ConfigError(f"--device-profile {path}: flops is a mapping of precision to FLOP/s, e.g. bf16: 989e12")
        return {str(k): _number(path, f"flops.{k}", v) for k, v in value.items()}
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--device-profile {path}: {key} is {value!r}, not a number") from None
    if key == "tensor_parallel_overhead":  # none is a valid overhead
        if number < 0:
            raise ConfigError(f"--device-profile {path}: {key} is {value!r}; it must be 0 or more")
        return number
    if number <= 0:
        raise ConfigError(f"--device-profile {path}: {key} is {value!r}; it must be positive")
    return int(number) if key == "devices_per_node" else number


# ------------------------------------------------------------------------------------------------ cpu
# ``--device-profile cpu``: this machine measured in a few seconds, then cached.
#
# Timed on one thread, as each process of a multi-process CPU run computes: the matrix-multiply peak at fp32
# (and its efficiency at sizes from 128 to 2048) and at bf16 (``rapidlite.models.flops.measure_matmul_peak``), causal
# attention's speed, the memory bandwidth (a large copy) and the speed of an AdamW step, each times the cores for
# the machine; and gloo's loopback all-reduce bandwidth between two processes, its latency as a training step
# sees it (a small all-reduce between multiplies costs several times what back-to-back ones do: the ranks
# wake and meet again), how much slower its all-gather and reduce-scatter into one tensor run than that
# bandwidth says, and what DTensor's dispatch adds to a tensor-parallel block. The processes of a CPU
# run share the machine's cores (``DeviceProfile.shared_by_node``). The result is kept in the cache
# (``rapidlite.runtime.cache``) under the CPU's model name, core count and torch version, so later plans read it; delete
# the file to measure again.
_PORT_BASE = 29600
_CACHE_VERSION = 3  # raised when the profile measures something new: an older file is measured again
SIZES = (128, 256, 512, 1024, 2048)  # the multiplies timed: a CPU's efficiency falls steeply below 1024


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    key = f"{_cpu_name()}-{os.cpu_count()}-torch{torch.__version__}-v{_CACHE_VERSION}"
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    return Path(cache_root()) / "device-profiles" / f"cpu-{safe}.json"


def cpu_profile() -> DeviceProfile:
    """The cached measurement of this CPU, measured now if there is none."""
    path = _cache_file()
    if path.is_file():
        return DeviceProfile(**json.loads(path.read_text()))
    profile = measure()
    make_cache_dir(path.parent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.__dict__, indent=1))
    tmp.replace(path)
    return profile


def _timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure() -> DeviceProfile:
    """Timed on one thread, as each process of a multi-process CPU run computes (``OMP_NUM_THREADS`` = cores /
    processes); the machine's peak is one thread's times the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure()
    finally:
        torch.set_num_threads(threads)


def _measure() -> DeviceProfile:
    from rapidlite.models.flops import measure_matmul_peak

    cores = os.cpu_count() or 1
    by_size = {n: measure_matmul_peak(torch.float32, sizes=(n,), repeats=3 if n > 512 else 9)[0] for n in SIZES}
    fp32 = max(by_size.values())
    bf16, _ = measure_matmul_peak(torch.bfloat16, sizes=(512,), repeats=3)  # some CPUs run bf16 40x slower
    big = torch.empty(32 * 2**20, dtype=torch.float32)  # 128 MiB
    out = torch.empty_like(big)
    copy = _timed(lambda: out.copy_(big))
    memory_bandwidth = 2 * big.nbytes / copy  # read and write
    params = [torch.nn.Parameter(torch.randn(2**20)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW(params, lr=1e-4)
    optimizer_rate = 4 * 2**20 / _timed(adam.step)
    bandwidth, latency, gather_slowdown, scatter_slowdown, tp_overhead = _gloo_loopback()
    attention = _attention_flops() / fp32
    return DeviceProfile(
        name="cpu",
        flops={"fp32": fp32 * cores, "bf16": bf16 * cores, "fp16": bf16 * cores},
        memory_bandwidth=memory_bandwidth * cores,
        matmul_efficiency=1.0,  # the measured peak is what large matrix multiplies reach
        matmul_efficiency_by_size={str(n): flops / fp32 for n, flops in by_size.items()},
        attention_efficiency=attention,
        devices_per_node=cores,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=latency,
        inter_node_bandwidth=bandwidth,
        inter_node_latency=latency,
        host_bandwidth=memory_bandwidth * cores,
        optimizer_rate=optimizer_rate * cores,
        host_optimizer_rate=optimizer_rate * cores,
        shared_by_node=True,
        overlaps_communication=False,
        all_gather_slowdown=gather_slowdown,
        reduce_scatter_slowdown=scatter_slowdown,
        tensor_parallel_overhead=tp_overhead,
        source=f"measured on {_cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}",
    )


def _attention_flops() -> float:
    """FLOP/s of causal scaled-dot-product attention, forward and backward (``12 T^2 d`` per sequence and head
    counted as the model counts it, not halved for the mask)."""
    import torch.nn.functional as F

    heads, tokens, dim = 4, 512, 64
    q, k, v = (torch.randn(1, heads, tokens, dim, requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 12 * tokens**2 * dim * heads / _timed(step)


def _gloo_loopback() -> tuple[float, ...]:
    """gloo between two local processes (``_gloo_worker``): the all-reduce's bus bandwidth (bytes/s) and
    latency (seconds a message), the all-gather's and reduce-scatter's slowdowns, and the tensor-parallel
    overhead a block."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _PORT_BASE + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    return result


def _gloo_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    n = 2
    big = torch.ones(8 * 2**20)  # 32 MiB
    seconds = _timed(lambda: dist.all_reduce(big), repeats=5)
    bandwidth = 2 * (n - 1) / n * big.nbytes / seconds
    between = statistics.median(_latency_between_compute(bandwidth) for _ in range(5))  # it varies 2x run to run
    latency = between / (2 * (n - 1))
    # FSDP2's calls (their older names before torch 2.13), at a transformer block's size: 8 MiB gathered.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    block = big[: 2 * 2**20]
    shard = torch.ones(block.numel() // n)
    reduced = _timed(lambda: dist.all_reduce(block), repeats=7)
    gather = _timed(lambda: all_gather(block, shard), repeats=7)
    scatter = _timed(lambda: reduce_scatter(shard, block), repeats=7)
    tp_overhead = _tensor_parallel_overhead(rank)
    if rank == 0:
        ring = reduced / 2  # an all-gather or reduce-scatter at the all-reduce's bus bandwidth moves half its bytes
        slowdowns = max(1.0, gather / ring), max(1.0, scatter / ring)
        queue.put((bandwidth, latency, *slowdowns, tp_overhead))
    dist.barrier()
    dist.destroy_process_group()


def _latency_between_compute(bandwidth: float, rounds: int = 16) -> float:
    """Seconds a small all-reduce adds beyond its bytes when it follows a multiply on both ranks, as tensor
    parallelism's do, less the bytes' time at ``bandwidth``."""
    import torch.distributed as dist

    a, b, small = torch.randn(512, 512), torch.randn(512, 512), torch.ones(16 * 2**10)  # 64 KiB

    def rounds_of(reduce: bool) -> None:
        for _ in range(rounds):
            a @ b
            if reduce:
                dist.all_reduce(small)

    dist.barrier()
    alone = _timed(lambda: rounds_of(False), repeats=3)
    dist.barrier()
    paired = _timed(lambda: rounds_of(True), repeats=3)
    return max(0.0, (paired - alone) / rounds - small.nbytes / bandwidth)


def _tensor_parallel_overhead(rank: int) -> float:
    """Seconds DTensor adds to a built-in GPT block's forward and backward: the block sharded on a one-rank
    mesh (the dispatch, without the collectives the model costs apart) less the plain block, at a size whose
    compute is small beside it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rapidlite.models.gpt import GPTConfig, GPTModel
    from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

    groups = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in one order
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    x = torch.randn(1, 16, 64, requires_grad=True)
    times = []
    for sharded in (False, True):
        model = GPTModel(GPTConfig(vocab_size=96, num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16))
        if sharded:
            apply_tensor_parallel(model, mesh, sequence_parallel=False)
        block = model.layers[0]
        times.append(_timed(lambda block=block: block(x).sum().backward(), repeats=15))
    return max(0.0, times[1] - times[0])
