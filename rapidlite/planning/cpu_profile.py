"""``--device-profile cpu``: this machine measured in a few seconds, then cached.

Timed on one thread, as each process of a multi-process CPU run computes: the matrix-multiply peak at fp32
(and its efficiency at sizes from 128 to 2048) and at bf16 (``rapidlite.flops.measure_matmul_peak``), causal
attention's speed, the memory bandwidth (a large copy) and the speed of an AdamW step, each times the cores for
the machine; and gloo's loopback all-reduce bandwidth and latency between two processes. The processes of a CPU
run share the machine's cores (``DeviceProfile.shared_by_node``). The result is kept in the cache
(``rapidlite.cache``) under the CPU's model name, core count and torch version, so later plans read it; delete
the file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from rapidlite.cache import cache_root, make_cache_dir
from rapidlite.planning.devices import DeviceProfile

_PORT_BASE = 29600
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
    key = f"{_cpu_name()}-{os.cpu_count()}-torch{torch.__version__}"
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
    from rapidlite.flops import measure_matmul_peak

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
    bandwidth, latency = _gloo_loopback()
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


def _gloo_loopback() -> tuple[float, float]:
    """gloo's all-reduce between two local processes: (bus bandwidth in bytes/s, seconds per small message)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _PORT_BASE + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return result


def _gloo_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    big, small = torch.ones(8 * 2**20), torch.ones(1)  # 32 MiB
    seconds = _timed(lambda: dist.all_reduce(big), repeats=5)
    latency = _timed(lambda: dist.all_reduce(small), repeats=20)
    if rank == 0:
        n = 2
        queue.put((2 * (n - 1) / n * big.nbytes / seconds, latency / (2 * (n - 1))))
    dist.barrier()
    dist.destroy_process_group()
