"""Activation offloading (``--offload-activations``): what autograd saves in the forward pass of a micro-batch
waits in host memory for the backward pass instead of on the device.

The saved tensors pass through ``torch.autograd.graph.saved_tensors_hooks``: the pack hook copies a tensor to
host memory and lets the device copy go, the unpack hook copies it back when the backward pass needs it (the
design of torchtune's ``OffloadActivations``). On CUDA the host buffers are pinned and the copies run on a side
stream: the copies to the host overlap the forward's compute; a copy back is issued when the backward asks for
the tensor and the compute stream waits for it before use (the next block's tensors are not prefetched).
Parameters (the optimizer's tensors, on the device anyway) and tensors below ``min_bytes`` (where a copy costs
more than it saves) stay where they are, as do tensor subclasses (DTensor shards, quantised weights).

On a CPU host memory is the device: nothing is saved, but the hooks still copy every saved tensor to a separate
host tensor and back, so a CPU run exercises the same pack and unpack path as a GPU run.

Activation checkpointing composes: a checkpointed block's inputs, which ``torch.utils.checkpoint`` saves for the
recompute, go through the same hooks; what the recompute saves in the backward pass is not offloaded (it is used
at once).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

MIN_BYTES = 2**20  # a copy of a smaller tensor costs more than the memory it frees


@dataclass
class _Offloaded:
    host: torch.Tensor
    device: torch.device


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """A context: the tensors autograd saves inside it are kept in host memory until the backward pass.

    ``packed`` and ``packed_bytes`` count what the pack hook moved (the run's log and the tests read them)."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES) -> None:
        self.cuda = device.type == "cuda"
        # On a CPU every tensor goes through the hooks: nothing to save, the path is what is exercised.
        self.min_bytes = min_bytes if self.cuda else 0
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.packed = 0
        self.packed_bytes = 0
        # A tensor saved by several ops (a residual stream, y in y * y) moves once per forward pass.
        self._moved: dict[int, tuple[weakref.ref, int, _Offloaded]] = {}
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc: object) -> None:
        self._moved.clear()  # the autograd graph holds what was moved; ids may be reused after this forward
        super().__exit__(*exc)

    def _kept(self, t: torch.Tensor) -> bool:
        """Tensors that stay where they are: parameters, subclasses, and small ones."""
        if isinstance(t, torch.nn.Parameter) or type(t) is not torch.Tensor:
            return True
        if t.device.type == "meta" or (t.is_leaf and t.requires_grad):
            return True
        return t.numel() * t.element_size() < self.min_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        if self._kept(t):
            return t
        seen = self._moved.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        packed = self._copy_to_host(t)
        self._moved[id(t)] = (weakref.ref(t), t._version, packed)
        self.packed += 1
        self.packed_bytes += t.numel() * t.element_size()
        return packed

    def _copy_to_host(self, t: torch.Tensor) -> _Offloaded:
        if not self.cuda:
            return _Offloaded(t.detach().clone(memory_format=torch.preserve_format), t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        compute = torch.cuda.current_stream(t.device)
        self.stream.wait_stream(compute)  # t is written by the compute stream
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # the allocator keeps t's memory until the copy has read it
        return _Offloaded(host, t.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if not self.cuda:
            return packed.host.clone(memory_format=torch.preserve_format)
        compute = torch.cuda.current_stream(packed.device)
        t = torch.empty_like(packed.host, device=packed.device)
        self.stream.wait_stream(compute)  # t's memory may have been in use by the compute stream
        with torch.cuda.stream(self.stream):
            t.copy_(packed.host, non_blocking=True)
        t.record_stream(self.stream)
        compute.wait_stream(self.stream)  # the backward uses t only once it is back
        return t
