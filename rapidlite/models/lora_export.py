"""A LoRA run's export: the adapter in peft's format (``save_adapter``) and, with ``--merge-lora``, the base
model's weights with the adapters merged in (``merged_state_dict``), from the gathered state dict of the peft
model. The adapters of linear layers merge as ``W + scaling x B A`` (DoRA: times the trained magnitude over
the row norms); those of an MoE's 3-D expert tensors (peft's ``target_parameters``) expert by expert."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rapidlite.models.lora import ADAPTER_NAME, _dequantized_weight, _is_bnb_linear


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """The adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``):
    ``PeftModel.from_pretrained(base, directory)`` loads it. ``state_dict``: the model's full trainable
    tensors, gathered. Adapters started from the weights' decomposition (``--lora-init pissa|olora``, whose base
    holds the residual) are saved as peft converts them, a plain LoRA of twice the rank on the original base."""
    model.save_pretrained(str(directory), state_dict=state_dict, safe_serialization=True)
    initial = getattr(model, "rapidlite_initial_adapter", None)
    if initial is not None:
        _as_plain_lora(directory, initial)


def _as_plain_lora(directory: Path, initial: dict[str, torch.Tensor]) -> None:
    """A PiSSA/OLoRA adapter (``B A`` on the residual ``W - B0 A0``) as a plain LoRA on the original weights:
    ``W + [B | -B0] [A ; A0]``, rank and alpha doubled (rsLoRA: alpha times sqrt 2), as peft converts them."""
    import json

    from safetensors.torch import load_file, save_file

    weights = directory / "adapter_model.safetensors"
    trained = load_file(str(weights))
    for key, value in trained.items():
        if "lora_A" in key:
            trained[key] = torch.cat([value, initial[key].to(value.dtype)], dim=0)
        elif "lora_B" in key:
            trained[key] = torch.cat([value, -initial[key].to(value.dtype)], dim=1)
    save_file(trained, str(weights), metadata={"format": "pt"})
    config_file = directory / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["r"], config["init_lora_weights"] = 2 * config["r"], True
    config["lora_alpha"] *= 2**0.5 if config.get("use_rslora") else 2
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights with every adapter merged in (``W + scaling * B @ A``), keyed as the base
    model's own state dict, from ``state_dict`` (the peft model's full tensors, gathered). Quantised base
    layers are dequantised first (they are whole on every rank: quantised runs do not shard the model)."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    float_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and not p.requires_grad), None)
    out: dict[str, torch.Tensor] = {}
    skip: list[str] = []
    for name, layer in layers.items():
        base = layer.get_base_layer()
        if ADAPTER_NAME not in layer.lora_A:
            continue
        if hasattr(layer, "parameter_name"):  # peft's ParamWrapper: an expert tensor
            key, merged = _merged_experts(name, layer, state_dict)
            out[_base_key(key[len(prefix) :])] = merged
            continue
        a = state_dict[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = state_dict[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        delta = (b @ a) * layer.scaling[ADAPTER_NAME]
        weight_key = f"{name}.base_layer.weight"
        weight = _dequantized_weight(base) if _is_bnb_linear(base) else state_dict[weight_key].float()
        flip = getattr(layer, "fan_in_fan_out", False)  # Conv1D: the weight is [in, out]
        merged = (weight.T if flip else weight) + delta  # [out, in]
        magnitude = state_dict.get(f"{name}.lora_magnitude_vector.{ADAPTER_NAME}.weight")
        if magnitude is not None:  # DoRA: the trained magnitude times each output row's direction
            merged = merged * (magnitude.float() / torch.linalg.norm(merged, dim=1))[:, None]
        dtype = state_dict[weight_key].dtype if state_dict[weight_key].is_floating_point() else float_dtype
        out[_base_key(name[len(prefix) :] + ".weight")] = (merged.T if flip else merged).to(dtype or torch.float32)
        skip.append(weight_key + ".")  # bitsandbytes' quantisation state
    for key, value in state_dict.items():
        if ".lora_" in key or ".original_module." in key or any(key.startswith(s) for s in skip):
            continue
        if key.endswith((".SCB", ".weight_format")):
            continue
        short = _base_key(key[len(prefix) :] if key.startswith(prefix) else key)
        out.setdefault(short, value)
    return out


def _merged_experts(name: str, layer: nn.Module, state_dict: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """``(key, W + delta)`` of the 3-D expert tensor a peft ``ParamWrapper`` adapts: expert ``e``'s delta is
    ``B_e A_e x scaling``, with ``A`` ``[experts x rank, in]`` and ``B`` ``[out, rank x experts]`` split into
    experts as peft splits them; transposed where the tensor is ``[experts, in, out]``. Wrappers of one module's
    tensors nest, so the tensor's key has a ``base_layer`` per level."""
    depth, inner = 1, layer.base_layer
    while hasattr(inner, "parameter_name"):
        depth, inner = depth + 1, inner.base_layer
    key = f"{name}{'.base_layer' * depth}.{layer.parameter_name}"
    experts = layer.num_experts
    a = state_dict[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
    b = state_dict[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
    a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
    delta = torch.einsum("ore,eri->eoi", b, a) * layer.scaling[ADAPTER_NAME]  # [experts, out, in]
    if not layer._did_swap_in_out_features:
        delta = delta.transpose(1, 2)
    weight = state_dict[key]
    return key, (weight.float() + delta).to(weight.dtype)


def restore_conv1d_layout(model: nn.Module, target: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """transformers quantises GPT-2-style ``Conv1D`` layers (weight ``[in, out]``) into bitsandbytes linear layers
    (``[out, in]``): the merged weights of those layers are turned back for ``target``, the unquantised model
    they are saved as."""
    from transformers.pytorch_utils import Conv1D

    for name, module in target.named_modules():
        if not isinstance(module, Conv1D) or f"{name}.weight" not in weights:
            continue
        source = model.get_submodule(name)
        source = source.get_base_layer() if hasattr(source, "get_base_layer") else source
        if _is_bnb_linear(source):
            weights[f"{name}.weight"] = weights[f"{name}.weight"].T.contiguous()


def _base_key(key: str) -> str:
    while ".base_layer." in key:  # nested wrappers (an expert tensor's) leave one per level
        key = key.replace(".base_layer.", ".")
    return key.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
