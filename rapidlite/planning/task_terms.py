"""What a task adds to a rank's planned memory beyond the policy's training step: a preference or online-RL task's
frozen reference model, and online RL's sampling between steps (``TaskSpec.reference`` and ``.generation``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rapidlite.config.settings import Sections


def count_reference(
    settings: Sections, dims: Any, ranks: list[Any], total: int, precision: Any, deepspeed: bool, task: Any
) -> list[str]:
    """A preference task's reference model in each rank's bytes: a frozen copy holds the base's weights split
    as the policy's are (tensor parallel; ZeRO-2/3 shard it over data parallel, in host memory with
    --cpu-offload); disabled adapters and precomputed scores hold nothing."""
    kind = task.reference(settings) if task is not None and task.reference is not None else None
    if kind is None:
        return []
    if kind != "copy":
        what = {
            "none": "--beta 0: no KL term"
            if getattr(settings.task_options, "beta", None) == 0
            else f"--loss-type {settings.task_options.loss_type} has none",
            "precomputed": "its scores are computed before training (--precompute-ref-logprobs), no model kept",
            "adapters": "the policy with its LoRA adapters disabled, no second copy",
        }[kind]
        return [f"reference model: 0 MiB ({what})"]
    topology = settings.topology
    # DeepSpeed casts the frozen engine's weights to bf16/fp16; FSDP2 and DDP keep the copy's fp32 weights.
    width = 2 if deepspeed and precision.dtype is not None else 4
    sharded = topology.zero_stage >= (3 if deepspeed else 2)  # strategies' prepare_frozen
    per_rank = total * width // (dims.tp * (dims.dp if sharded else 1))
    offloaded = sharded and topology.cpu_offload
    for r in ranks:
        if offloaded:
            r.host += per_rank
        else:
            r.reference = per_rank
    where = "host memory (--cpu-offload)" if offloaded else "the device"
    return [f"reference model: a frozen copy, {per_rank / 2**20:.2f} MiB per rank in {where} (counted in the peak)"]


def count_generation(
    settings: Sections, dims: Any, ranks: list[Any], total: int, precision: Any, task: Any, config: Any
) -> list[str]:
    """Online RL's sampling (``TaskSpec.generation``): the key/value cache of the completions a rank samples
    together at their longest, each step's fp32 logits (and the sampler's copies of them), and under ZeRO-3 the
    parameters gathered whole for the rollout."""
    rows, tokens = task.generation(settings)
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", heads) // heads
    width = 4 if precision.dtype is None else torch.finfo(precision.dtype).bits // 8
    cache = 2 * layers * rows * tokens * kv_heads * head_dim * width // dims.tp
    logits = 3 * rows * getattr(config, "vocab_size", 0) * 4
    gathered = 0
    if settings.topology.zero_stage >= 3 and dims.dp > 1:
        gathered = total * width * (dims.dp - 1) // (dims.dp * dims.tp)
    for r in ranks:
        r.generation = cache + logits + gathered
    whole = f", and the ZeRO-3 parameters gathered whole ({gathered / 2**20:.2f} MiB)" if gathered else ""
    return [
        f"generation: the key/value cache of {rows} completions x {tokens} tokens, {cache / 2**20:.2f} MiB per rank"
        f"{whole}, held while sampling with the last step's gradients (counted in the peak)"
    ]
