"""Sampling with vLLM colocated on the training GPU (``--use-vllm``), and the weight sync after each step.

The engine is ``vllm.LLM`` in the training process (colocate mode: no server), built once from the policy's
starting weights. A rollout's completions are one ``LLM.generate`` call over token-id prompts, each with its own
``SamplingParams`` (the run's temperature, top-p, top-k, min-p, repetition penalty and length, and the
completion's key as its seed, so a completion still depends on its prompt and key only). Before each rollout whose
policy has moved, the policy's weights (LoRA adapters merged in) are loaded into the engine's model by their
Hugging Face names (``load_weights``) and its prefix cache is reset, so the engine samples from the policy being
trained.

This path is written from vLLM's documented API; it has not run on a GPU here (no machine here has one). Its
dispatch and weight-sync calls are tested on CPU through a stand-in engine (``tests/test_grpo.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rapidlite.generation.sampling import Completions, SamplingSettings

# vLLM's seeds are 32-bit: a completion key is folded into that range.
SEED_RANGE = 2**31 - 1


def make_llm(model: str, gpu_memory_utilization: float, max_model_len: int, dtype: str, seed: int) -> Any:
    """The colocated engine (``vllm.LLM``), built from the policy's starting weights in ``model`` (a directory)."""
    from vllm import LLM

    return LLM(
        model=model, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, dtype=dtype,
        seed=seed, enable_prefix_caching=True, tensor_parallel_size=1,
    )  # fmt: skip


def sampling_params(settings: SamplingSettings, key: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k or -1,
        min_p=settings.min_p or 0.0, repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_completion_length, seed=key % SEED_RANGE,
    )  # fmt: skip


class VllmSampler:
    """A colocated vLLM engine that samples rollouts and takes the policy's weights before each one."""

    def __init__(self, llm: Any, params: Callable[[SamplingSettings, int], Any] | None = None) -> None:
        self.llm = llm
        self.params = params or sampling_params

    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], settings: SamplingSettings) -> Completions:
        """One completion of ``prompts[i]`` for ``keys[i]`` (up to and including its EOS; truncated when it ended
        at the length limit)."""
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=[self.params(settings, k) for k in keys], use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        truncated = [o.outputs[0].finish_reason == "length" for o in outputs]
        return Completions(ids, truncated)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The policy's weights (Hugging Face names) into the engine's model, then a fresh prefix cache."""
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(weights)
        self.llm.reset_prefix_cache()


def hf_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s weights by their Hugging Face names, as its checkpoint would hold them: a PEFT model's base
    weights with its adapters merged in by the caller (``lora_`` tensors left out, PEFT's prefixes removed)."""
    for name, tensor in module.state_dict().items():
        if "lora_" in name or ".original_module." in name:  # adapters (merged), a saved module's frozen original
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        name = name.replace(".modules_to_save.default.", ".")
        if hasattr(tensor, "full_tensor"):  # tensor parallelism's shards
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def sync_weights(sampler: VllmSampler, strategy: Any, model: Any) -> None:
    """The policy's weights into the engine (LoRA adapters merged in for the copy, then unmerged; parameters the
    strategy shards gathered)."""
    from rapidlite.models import lora

    module = strategy.module(model)
    with strategy.gathered_for_generation(model), torch.no_grad():
        merged = lora.is_peft_model(module)
        if merged:
            module.merge_adapter()
        try:
            sampler.load_weights(hf_weights(module))
        finally:
            if merged:
                module.unmerge_adapter()
