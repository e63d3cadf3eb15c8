"""The plan's DeepSpeed terms (``rapidlite.planning.memory``): its engine cannot be built on meta tensors, so a
rank's model states follow ZeRO's rules, read from DeepSpeed's own code (``runtime/zero/stage_1_and_2.py``,
``stage3.py``) with the run's config (``parallel.deepspeed_config.build_config``: the user's file and the flags):

- **parameters**: whole under ZeRO-1/2; under ZeRO-3 a 1/dp partition of each tensor, but tensors under
  ``stage3_param_persistence_threshold`` elements (100k by default) stay whole on every rank;
- **fp32 master partition**: every stage steps an fp32 copy of its 1/dp partition (``single_partition_of_fp32_groups``,
  ``fp32_partitioned_groups_flat``), a copy even when the model trains in fp32;
- **gradients**: the 1/dp partition ZeRO-2/3 reduce into (the whole model's under ZeRO-1), kept to the step;
- **the reduce bucket**: gradients are copied into a contiguous buffer of ``reduce_bucket_size`` elements (5e8 by
  default, x2 with ``overlap_comm``) as the backward pass makes them. It is allocated whole but only its written
  pages are resident: the trained elements, up to the bucket's size. It lives from the backward pass to the
  next one, so it is held through the forward pass too;
- **ZeRO-3's gathered parameters**: the partitioned tensors, gathered whole for the forward and backward passes,
  up to ``stage3_max_live_parameters`` elements (1e9: on any model a CPU trains, all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidlite.config.settings import Sections


@dataclass
class DeepSpeedStates:
    params: int  # bytes
    grad_elements: int
    stepped: int  # elements of the fp32 partition the optimizer steps
    bucket: int  # bytes of the reduce bucket's written pages
    gathered: int  # bytes of ZeRO-3's gathered parameters at the peak

    @property
    def master(self) -> int:
        """Bytes of the fp32 copy of the partition the optimizer steps."""
        return self.stepped * 4


def _zero_config(settings: Sections) -> dict:
    from rapidlite.parallel.deepspeed_config import build_config

    topology = settings.topology
    precision = settings.precision.precision
    return build_config(settings, precision, topology.zero_stage, topology.cpu_offload)["zero_optimization"]


def deepspeed_states(settings: Sections, params: list[torch.Tensor], dp: int) -> DeepSpeedStates:
    """One rank's model-state bytes under DeepSpeed's ZeRO (see the module docstring) of the whole-model
    ``params`` (a pipeline stage's, after tensor parallelism's split)."""
    zero = settings.topology.zero_stage
    config = _zero_config(settings)
    trained = [p for p in params if p.requires_grad]
    trainable = sum(p.numel() for p in trained)
    width = trained[0].element_size() if trained else 4
    persist = int(config.get("stage3_param_persistence_threshold", config.get("param_persistence_threshold", 1e5)))
    if zero >= 3:
        whole = [p for p in params if p.numel() < persist]
        split = [p for p in params if p.numel() >= persist]
        param_bytes = sum(p.numel() * p.element_size() for p in whole)
        param_bytes += sum(-(-p.numel() // dp) * p.element_size() for p in split)
        live = int(config.get("stage3_max_live_parameters", config.get("max_live_parameters", 1e9)))
        gathered = min(sum(p.numel() for p in split), live) * width
    else:
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        gathered = 0
    buckets = 2 if config.get("overlap_comm", zero >= 3) else 1  # DeepSpeed's default: on for ZeRO-3 only
    bucket = min(buckets * int(config.get("reduce_bucket_size", 5e8)), trainable) * width
    return DeepSpeedStates(
        params=param_bytes,
        grad_elements=trainable // (dp if zero >= 2 else 1),
        stepped=trainable // (dp if zero >= 1 else 1),
        bucket=bucket,
        gathered=gathered,
    )
