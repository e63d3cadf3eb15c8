"""``rapidlite env``: the machine, the libraries and which kernels and backends a run here can use (and why not),
in plain text to paste into a bug report, or as JSON with ``--json``.

Fast and side-effect free: library versions come from the installed distributions' metadata, without importing
them (DeepSpeed, bitsandbytes, transformers and datasets take seconds to import, and some print as they do); only
torch is imported, and Apex when a package of that name is installed (to tell NVIDIA's from the unrelated PyPI
one). Where rapidlite decides something itself (bf16 on the CPU, Apex's fused kernels), the report asks the same
function the run asks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import rapidlite
from rapidlite.errors import ConfigError, first_line
from rapidlite.runtime.cache import cache_root

# (distribution name, what it is for); reported whether installed or not.
PACKAGES: tuple[tuple[str, str], ...] = (
    ("torch", "required"),
    ("transformers", "required"),
    ("datasets", "required"),
    ("tokenizers", "required"),
    ("safetensors", "required"),
    ("peft", "required: --lora-rank"),
    ("numpy", "required"),
    ("tqdm", "required: progress bars"),
    ("deepspeed", "[deepspeed]: --deepspeed"),
    ("bitsandbytes", "[quant]: --load-in-4bit/--load-in-8bit"),
    ("apex", "optional: NVIDIA Apex fused kernels"),
    ("matplotlib", "required: curves.png, rapidlite plot"),
    ("wandb", "[wandb]: --report-to wandb"),
    ("mlflow-skinny", "[mlflow]: --report-to mlflow"),
    ("tensorboard", "required: --report-to tensorboard"),
    ("accelerate", "[bench]"),
    ("lm_eval", "[test]: rapidlite-eval's scores are tested equal to it (not imported)"),
    ("triton", "torch.compile on GPUs"),
    ("ninja", "DeepSpeed ops, torch C++ extensions"),
)

# Variables that change what a run does; their values are shown when set (none of them holds a secret).
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "RAPIDLITE_CACHE",
    "RAPIDLITE_NO_CURVES",
    "RAPIDLITE_NO_PROGRESS",
    "TORCH_EXTENSIONS_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_DISTRIBUTED_DEBUG",
    "DS_ACCELERATOR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check(usable: bool | None, detail: str) -> dict[str, Any]:
    """A kernel or backend: usable (True/False; None when it does not apply here) and why."""
    return {"usable": usable, "detail": detail}


def _git_revision() -> str | None:
    """The commit of a source checkout rapidlite runs from (None for an installed release)."""
    root = Path(rapidlite.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def system_section() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    memory = _memory_bytes()
    revision = _git_revision()
    return {
        "rapidlite": f"{rapidlite.__version__} ({Path(rapidlite.__file__).parent}"
        + (f", git {revision})" if revision else ")"),
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": f"{os.cpu_count()} logical" + (f", {usable} usable by this process" if usable is not None else ""),
        "memory": f"{memory / 2**30:.1f} GiB" if memory else "unknown",
    }


def packages_section() -> dict[str, str | None]:
    return {name: _version(name) for name, _ in PACKAGES}


def torch_section(torch: Any) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    build = (
        f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}" if torch.version.hip else ""
    )
    info: dict[str, Any] = {
        "version": torch.__version__,
        "build": build or "CPU only",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.version.cuda else None,
        "gpus": [],
        "mps": bool(torch.backends.mps.is_available()),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "onednn": bool(torch.backends.mkldnn.is_available()),
    }
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(f"{i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB")
    return info


def _distributed_checks(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"torch.distributed": _check(False, "this torch build has no torch.distributed")}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dist.is_nccl_available():
        nccl = _check(False, "this torch build has no NCCL (a CPU build): multi-process runs use gloo")
    elif not gpus:
        nccl = _check(False, "built with NCCL, but no GPU is visible: multi-process runs use gloo")
    else:
        nccl = _check(True, f"{gpus} GPU(s): the default backend of multi-process GPU runs")
    gloo = dist.is_gloo_available()
    return {
        "gloo": _check(
            gloo, "CPU process groups (the default without GPUs)" if gloo else "this torch build has no gloo"
        ),
        "nccl": nccl,
        "mpi": _check(dist.is_mpi_available(), "built with MPI" if dist.is_mpi_available() else "not built with MPI"),
    }


def _attention_checks(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    cpu_flash = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    checks["sdpa cpu"] = _check(
        True, "fused flash-attention CPU kernel" + ("" if cpu_flash else " not in this build: math kernel")
    )
    if not torch.cuda.is_available():
        checks["sdpa flash (gpu)"] = _check(None, "no GPU")
        checks["sdpa memory-efficient (gpu)"] = _check(None, "no GPU")
        return checks
    cuda = torch.backends.cuda
    major, minor = torch.cuda.get_device_capability(0)
    sm = f"sm_{major}{minor}"
    if not cuda.flash_sdp_enabled():
        flash = _check(False, "switched off (torch.backends.cuda.enable_flash_sdp(False))")
    elif major < 8:
        flash = _check(False, f"GPU 0 is {sm}; flash attention needs sm_80 (Ampere) or newer")
    else:
        flash = _check(True, f"GPU 0 is {sm}; fp16/bf16 inputs")
    checks["sdpa flash (gpu)"] = flash
    checks["sdpa memory-efficient (gpu)"] = (
        _check(True, f"GPU 0 is {sm}")
        if cuda.mem_efficient_sdp_enabled()
        else _check(False, "switched off (torch.backends.cuda.enable_mem_efficient_sdp(False))")
    )
    cudnn_enabled = getattr(cuda, "cudnn_sdp_enabled", None)
    if cudnn_enabled is not None:
        checks["sdpa cudnn (gpu)"] = _check(
            bool(cudnn_enabled()) and major >= 8, f"GPU 0 is {sm}; cuDNN attention needs sm_80 or newer"
        )
    return checks


def _precision_checks(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    from rapidlite.precision import cpu_bf16_is_fast

    cpu = torch.cpu
    avx512_bf16 = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    amx = bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    fast = cpu_bf16_is_fast()
    isa = ", ".join(n for n, has in (("AVX-512 BF16", avx512_bf16), ("AMX", amx)) if has) or "no AVX-512 BF16 or AMX"
    checks = {
        "bf16 on cpu": _check(
            fast,
            f"{isa}: --mixed-precision trains bf16 on this CPU"
            if fast
            else f"{isa}: bf16 would be emulated (slower than fp32), so --mixed-precision keeps fp32 on this CPU",
        )
    }
    if torch.cuda.is_available():
        bf16 = torch.cuda.is_bf16_supported()
        checks["bf16 on gpu"] = _check(
            bf16, "--mixed-precision trains bf16" if bf16 else "--mixed-precision trains fp16 with loss scaling"
        )
    return checks


def _compiler(environ: dict[str, str]) -> str | None:
    for name in (environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compile_check(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    try:
        import torch._dynamo

        supported = torch._dynamo.is_dynamo_supported()
    except Exception as e:  # a torch build without dynamo, or one that fails to set it up
        return {"torch.compile": _check(False, f"torch._dynamo does not load: {first_line(e)}")}
    if not supported:
        return {"torch.compile": _check(False, f"not supported on Python {platform.python_version()} by this torch")}
    cache = environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_root(), "inductor")  # as runs set it
    compiler = _compiler(environ)
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        return {"torch.compile": _check(False, "GPU code generation needs triton, which is not installed")}
    if compiler is None:
        return {"torch.compile": _check(False, "Inductor's CPU code needs a C++ compiler (g++ or clang++); none found")}
    return {"torch.compile": _check(True, f"Inductor with {compiler}; cache {cache}")}


def _apex_check(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    if importlib.util.find_spec("apex") is None:
        return {"apex fused kernels": _check(False, "NVIDIA Apex is not installed (never required)")}
    from rapidlite.models.apex import nvidia_apex

    if nvidia_apex() is None:
        return {
            "apex fused kernels": _check(
                False, "a package named apex is installed but has no FusedAdam/FusedLayerNorm (not NVIDIA's Apex)"
            )
        }
    if not torch.cuda.is_available():
        return {"apex fused kernels": _check(False, "NVIDIA Apex imports; its kernels run on CUDA only")}
    return {"apex fused kernels": _check(True, "FusedAdam for AdamW on CUDA (plain tensors), FusedLayerNorm")}


def _deepspeed_check(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    version = _version("deepspeed")
    if version is None:
        return {"deepspeed ops": _check(False, "DeepSpeed is not installed: pip install 'rapidlite[deepspeed]'")}
    from torch.utils.cpp_extension import is_ninja_available

    ninja, compiler = is_ninja_available(), _compiler(environ)
    where = environ.get("TORCH_EXTENSIONS_DIR") or "torch's default extensions directory"
    missing = [name for name, found in (("ninja", ninja), ("a C++ compiler", compiler)) if not found]
    if torch.cuda.is_available() and not (environ.get("CUDA_HOME") or shutil.which("nvcc")):
        missing.append("nvcc (CUDA_HOME)")
    if missing:
        return {"deepspeed ops": _check(False, f"DeepSpeed {version} cannot build its ops: no {', '.join(missing)}")}
    return {
        "deepspeed ops": _check(
            True, f"DeepSpeed {version} builds its ops on first use with ninja and {compiler}, into {where}"
        )
    }


def _bitsandbytes_check(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    version = _version("bitsandbytes")
    if version is None:
        return {"bitsandbytes": _check(False, "not installed: pip install 'rapidlite[quant]'")}
    if torch.cuda.is_available():
        return {"bitsandbytes": _check(True, f"{version}: 4-bit/8-bit weights on the GPU")}
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor >= (0, 48):
        return {"bitsandbytes": _check(True, f"{version}: 4-bit/8-bit weights on the CPU backend")}
    return {"bitsandbytes": _check(False, f"{version}: its CPU backend needs 0.48 or newer")}


def kernels_section(torch: Any, environ: dict[str, str]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for part in (
        _distributed_checks,
        _attention_checks,
        _precision_checks,
        _compile_check,
        _apex_check,
        _deepspeed_check,
        _bitsandbytes_check,
    ):
        try:
            checks.update(part(torch, environ))
        except Exception as e:  # a report must come out whole: one broken probe is a line of it
            checks[part.__name__.strip("_")] = _check(None, f"could not check: {first_line(e)}")
    return checks


def collect() -> dict[str, Any]:
    """The whole report as JSON-able sections."""
    environ = dict(os.environ)  # as the user set it: importing torch's compiler sets TORCHINDUCTOR_CACHE_DIR
    report: dict[str, Any] = {"system": system_section(), "packages": packages_section()}
    try:
        import torch
    except Exception as e:  # a broken torch install is what the report must show, not die of
        report["torch"] = {"error": f"torch does not import: {first_line(e)}"}
    else:
        report["torch"] = torch_section(torch)
        report["kernels and backends"] = kernels_section(torch, environ)
    report["environment"] = {name: environ[name] for name in ENV_VARS if name in environ}
    return report


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return "; ".join(value) if value else "none"
    return str(value)


def render(report: dict[str, Any]) -> str:
    """Plain text: one ``name: value`` line per entry under each section."""
    lines = ["rapidlite env (paste all of it into a bug report)"]
    notes = dict(PACKAGES)
    for section, entries in report.items():
        lines += ["", f"[{section}]"]
        width = max((len(k) for k in entries), default=0) + 2
        for name, value in entries.items():
            if section == "packages":
                text = f"{value or 'not installed':<16} {notes.get(name, '')}".rstrip()
            elif isinstance(value, dict) and "usable" in value:
                text = f"{_text_value(value['usable']) if value['usable'] is not None else 'n/a':<4} {value['detail']}"
            else:
                text = _text_value(value)
            lines.append(f"{name + ':':<{width}}{text}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite env --help')")


def main(argv: Sequence[str]) -> int:
    """``rapidlite env [--json]``."""
    parser = _Parser(
        prog="rapidlite env",
        description="Versions, hardware and the kernels and backends a run here can use: paste it into a bug report.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object, for machines")
    args = parser.parse_args(list(argv))
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
