"""A GGUF file for llama.cpp from a Hugging Face causal LM of the LLaMA family or GPT-2, and its round-trip check.

The tensors are named and laid out as llama.cpp's ``convert_hf_to_gguf.py`` writes them: LLaMA's query and key
projections permuted from Hugging Face's rotary layout (``rotate_half``'s channel pairs ``(i, i + d/2)``) to
llama.cpp's interleaved pairs, GPT-2's ``Conv1D`` weights transposed to ``[out, in]``, a tied output layer left to
the token embedding (LLaMA; llama.cpp falls back to it) or written as its copy (GPT-2, as the converter does).
One-dimensional tensors (norms, biases) stay f32 in every file type, as llama.cpp keeps them; a matrix whose rows
are not a whole number of q8_0 blocks (32 values) is written f16 in a q8_0 file.

``check_gguf`` reads the file back with gguf's ``GGUFReader``, dequantises each tensor (``gguf.quants``) and
compares it with the source tensor in the layout written: f32 exactly; f16 within ``1e-3`` of each value
(relative; f16 rounds to 2**-11) plus ``6e-8`` (its subnormal spacing); q8_0 within one quantisation step of
the value's block, ``max |x| / 127`` over its 32 values (the rounding is half a step, the f16 scale's own
rounding adds at most 127 * 2**-11 of a step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidlite.errors import ConfigError, RapidliteError

GGUF_TYPES = ("f32", "f16", "q8_0")
FAMILIES = "the LLaMA family (LlamaForCausalLM) and GPT-2 (GPT2LMHeadModel)"
LLAMA, GPT2 = "llama", "gpt2"
Q8_BLOCK = 32
# GPT-2's Conv1D weights, stored [in, out]: llama.cpp reads [out, in].
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class ExportCheckFailed(RapidliteError):
    """The file written does not read back as the model it was written from: the export is not kept."""

    exit_code = 1


def require_gguf() -> Any:
    """The ``gguf`` package, or one line naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "--format gguf needs the gguf package: pip install 'rapidlite[export]' (or pip install gguf)"
        ) from None
    return gguf


@dataclass
class SourceTensor:
    """One tensor as it goes into the file: its GGUF name, its values in the layout written (float32) and the
    type it is stored as."""

    name: str
    data: np.ndarray
    gguf_type: str


def family(model: torch.nn.Module) -> str | None:
    """``"llama"``, ``"gpt2"`` or None: the llama.cpp architecture of a Hugging Face causal LM."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in (LLAMA, GPT2) else None


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection's rows (or bias) from Hugging Face's rotary layout to llama.cpp's (``heads``: the
    key/value heads for the key projection, as grouped-query attention shares them)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _stored_type(data: np.ndarray, gguf_type: str) -> str:
    if data.ndim < 2:
        return "f32"
    if gguf_type == "q8_0" and data.shape[-1] % Q8_BLOCK:
        return "f16"
    return gguf_type


def source_tensors(model: torch.nn.Module, gguf_type: str) -> list[SourceTensor]:
    """The model's tensors under llama.cpp's names, in the layout and types the file holds."""
    gguf = require_gguf()
    arch = family(model)
    config = model.config
    layers = config.num_hidden_layers if arch == LLAMA else config.n_layer
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == LLAMA else gguf.MODEL_ARCH.GPT2, layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: list[SourceTensor] = []
    for key, value in model.state_dict().items():
        if key.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")) or (
            key == "lm_head.weight" and tied
        ):
            continue  # buffers llama.cpp computes itself; a tied output layer is the embedding
        value = value.detach().float().cpu()
        if arch == LLAMA and key.endswith(("q_proj.weight", "q_proj.bias")):
            value = rope_permute(value, config.num_attention_heads)
        elif arch == LLAMA and key.endswith(("k_proj.weight", "k_proj.bias")):
            value = rope_permute(value, config.num_key_value_heads or config.num_attention_heads)
        elif arch == GPT2 and key.endswith(_CONV1D):
            value = value.t()
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"--format gguf: the model's tensor {key} has no llama.cpp name ({arch})")
        data = value.contiguous().numpy()
        out.append(SourceTensor(name, data, _stored_type(data, gguf_type)))
        if arch == GPT2 and tied and name == "token_embd.weight":
            out.append(SourceTensor("output.weight", data, _stored_type(data, gguf_type)))
    return out


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}  # transformers 5
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_type(config: Any) -> str:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


def _hyperparameters(writer: Any, config: Any, arch: str) -> None:
    if arch == LLAMA:
        if _rope_type(config) != "default":
            raise ConfigError(
                f"--format gguf: the model's rotary scaling {_rope_type(config)!r} is not written to GGUF here; "
                "only unscaled rotary positions are"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(config.num_key_value_heads or heads)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(_rope_theta(config))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
    else:
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_vocab_size(config.vocab_size)


def _vocabulary(writer: Any, tokenizer: Any, rows: int) -> str | None:
    """The tokenizer's vocabulary (tokens, types, scores where the model has them, BPE merges, special ids) from
    its ``tokenizer.json``; or why none is written."""
    import gguf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "the tokenizer has no tokenizer.json (not a fast tokenizer): the GGUF holds no vocabulary"
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"the tokenizer is {model.get('type')}, not BPE: the GGUF holds no vocabulary"
    tokens = [f"[PAD{i}]" for i in range(rows)]  # rows past the tokenizer's (a padded vocabulary) never occur
    types = [int(gguf.TokenType.UNUSED)] * rows
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < rows:
            tokens[token_id], types[token_id] = token, int(gguf.TokenType.NORMAL)
    byte_fallback = bool(model.get("byte_fallback"))
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < rows:
            types[token_id] = int(gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED)
    if byte_fallback:  # a SentencePiece BPE (LLaMA's): llama.cpp's "llama" vocabulary, byte tokens, rank scores
        for i, token in enumerate(tokens):
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                types[i] = int(gguf.TokenType.BYTE)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(rows)])
    else:
        writer.add_tokenizer_model("gpt2")
        pre = spec.get("pre_tokenizer") or {}
        writer.add_tokenizer_pre(
            "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "default"
        )
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if merges:
        writer.add_token_merges(merges)
    for what, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):  # fmt: skip
        token_id = getattr(tokenizer, f"{what}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < rows:
            add(token_id)
    return None


def write_gguf(
    model: torch.nn.Module, tokenizer: Any, path: Path, gguf_type: str, name: str
) -> tuple[list, str | None]:
    """Write ``model`` (a LLaMA-family or GPT-2 Hugging Face causal LM) and its ``tokenizer`` (or None) to ``path``.
    Returns the tensors as written (for ``check_gguf``) and a note when no vocabulary could be written."""
    gguf = require_gguf()
    arch = family(model)
    if arch is None:
        raise ConfigError(f"--format gguf supports {FAMILIES}; this run's model is {type(model).__name__}")
    tensors = source_tensors(model, gguf_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _hyperparameters(writer, model.config, arch)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
    writer.add_file_type(int(file_type.get(gguf_type, gguf.LlamaFileType.MOSTLY_Q8_0)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rows = tensors[0].data.shape[0] if tensors else 0
    rows = next((t.data.shape[0] for t in tensors if t.name == "token_embd.weight"), rows)
    note = (
        _vocabulary(writer, tokenizer, rows) if tokenizer is not None else "no tokenizer: the GGUF holds no vocabulary"
    )
    for tensor in tensors:
        qtype = _qtype(tensor.gguf_type)
        writer.add_tensor(tensor.name, gguf.quants.quantize(tensor.data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors, note


def _qtype(gguf_type: str) -> Any:
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16}.get(
        gguf_type, gguf.GGMLQuantizationType.Q8_0
    )


def _excess(read: np.ndarray, source: np.ndarray, gguf_type: str) -> tuple[np.ndarray, np.ndarray]:
    """``(|difference|, tolerance)`` per value."""
    diff = np.abs(read.astype(np.float64) - source)
    if gguf_type == "f32":
        return diff, np.zeros_like(diff)
    if gguf_type == "f16":
        return diff, 1e-3 * np.abs(source) + 6e-8
    blocks = np.abs(source).reshape(-1, Q8_BLOCK).max(axis=1, keepdims=True) / 127.0
    return diff, np.broadcast_to(blocks, (blocks.shape[0], Q8_BLOCK)).reshape(source.shape) + 1e-12


def check_gguf(path: Path, written: list[SourceTensor]) -> str:
    """Read ``path`` back and compare every tensor with its source; one line of what was checked, or
    ``ExportCheckFailed`` naming the first tensor that differs beyond its type's tolerance."""
    gguf = require_gguf()
    reader = gguf.GGUFReader(str(path))
    found = {t.name: t for t in reader.tensors}
    missing = [t.name for t in written if t.name not in found]
    extra = sorted(set(found) - {t.name for t in written})
    if missing or extra:
        raise ExportCheckFailed(f"gguf round trip: {path.name} lacks tensors {missing[:3]}, has extra {extra[:3]}")
    worst: dict[str, float] = {}
    for tensor in written:
        stored = found[tensor.name]
        if stored.tensor_type != _qtype(tensor.gguf_type):
            raise ExportCheckFailed(
                f"gguf round trip: tensor {tensor.name} is stored as {stored.tensor_type.name}, not {tensor.gguf_type}"
            )
        values = gguf.quants.dequantize(stored.data, stored.tensor_type)
        if values.size != tensor.data.size:
            raise ExportCheckFailed(
                f"gguf round trip: tensor {tensor.name} holds {values.size} values, the source {tensor.data.size}"
            )
        diff, tolerance = _excess(values.reshape(tensor.data.shape), tensor.data, tensor.gguf_type)
        bad = ~(diff <= tolerance)  # NaN counts as beyond
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), bad.shape)
            raise ExportCheckFailed(
                f"gguf round trip: tensor {tensor.name} ({tensor.gguf_type}) differs from the source by "
                f"{diff[at]:.3g} at {tuple(int(i) for i in at)} (tolerance {tolerance[at]:.3g}); the export is not kept"
            )
        worst[tensor.gguf_type] = max(worst.get(tensor.gguf_type, 0.0), float(diff.max(initial=0.0)))
    by_type = ", ".join(f"{kind} {value:.3g}" for kind, value in sorted(worst.items()))
    return f"gguf round trip: {len(written)} tensors read back and dequantised, max |difference| by type: {by_type}"
