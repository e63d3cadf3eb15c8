"""Graph optimisation: ``--torch-compile`` (``--compile-mode``) and Rapidformer's ``--onnx-runtime-training``.

``torch.compile`` is applied per transformer block (``nn.Module.compile``, in place), as torchtitan does:
each block compiles once and the compiled code is reused by every block of the same shape; parameter
names stay those of the eager model (checkpoints do not change), activation checkpointing is inside the
compiled block, and FSDP/tensor/pipeline parallelism wrap or call the compiled blocks as they would the
eager ones. A model without a block stack is compiled whole. Inductor's cache is kept under
``RAPIDLITE_CACHE`` (``TORCHINDUCTOR_CACHE_DIR``), so a second run starts in seconds.

ONNX Runtime's ``ORTModule`` (``onnxruntime-training`` + ``torch-ort``) is used when it imports with the
installed torch; on torch 2.13 it does not (``cannot import name 'jit_utils' from 'torch.onnx._internal'``),
and the run says so in one line and compiles with ``torch.compile`` instead, so scripts written for
Rapidformer keep running (``rapidlite.resolve`` decides it once, into ``use_ort``/``torch_compile``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rapidlite.models.spec import find_blocks
from rapidlite.runtime.cache import cache_root


def ort_import_error() -> str | None:
    """None when ONNX Runtime's ORTModule imports, else why not (one line)."""
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception as e:  # ImportError, or errors raised while the package initialises against this torch
        text = str(e).strip().splitlines()
        return text[0][:200] if text else type(e).__name__
    return None


def set_compile_cache() -> None:
    """Inductor's compiled kernels under RAPIDLITE_CACHE unless the user chose a directory."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root(), "inductor")


def compile_model(model: torch.nn.Module, mode: str | None = None, dynamic: bool | None = None) -> int:
    """Compile each transformer block in place (or the whole model without blocks); returns how many
    modules were compiled. ``dynamic=True`` compiles shape-generic code from the start: variable-length
    fine-tuning batches then compile once instead of once per new length (and again for the last, smaller
    batch of an epoch); None specialises on the first shapes, best for fixed-length pretraining."""
    set_compile_cache()
    kwargs: dict[str, Any] = {} if mode in (None, "default") else {"mode": mode}
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    blocks = find_blocks(model)
    if not blocks:
        model.compile(**kwargs)
        return 1
    for block in blocks:
        block.compile(**kwargs)
    return len(blocks)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (each compile or recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def wrap_ort(model: torch.nn.Module) -> torch.nn.Module:
    """ONNX Runtime training (only where ``ort_import_error()`` is None)."""
    from onnxruntime.training.ortmodule import ORTModule

    return ORTModule(model)
