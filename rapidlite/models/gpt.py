"""The built-in GPT: a Megatron-style decoder-only transformer in plain PyTorch.

The model is four separate stages, so later tensor or pipeline parallelism can split it::

    embedding   (word embeddings + learned absolute positions, dropout)
    layers      nn.ModuleList of pre-norm TransformerBlocks: x + attention(norm(x)), then x + mlp(norm(x))
    final_norm  LayerNorm or RMSNorm
    output      Linear(hidden, padded vocab), its weight tied to the word embeddings unless untied

Blocks hold no state across layers and take tensors only (``hidden, rope, attention_mask``; the last two may
be None), so activation checkpointing and FSDP can wrap each block (both find them as the largest
``ModuleList``). Attention has separate q/k/v projections, each of which tensor parallelism can shard
column-wise, and runs through ``F.scaled_dot_product_attention``: causal, or with an explicit boolean mask
(``True`` = attend, as ``rapidlite.data.gpt_dataset.gpt_batch`` builds it for ``--reset-attention-mask``).
With ``--position-embedding-type rope`` the rotation angles are computed once per forward from
``position_ids`` and rotate q and k in every layer (half-split channel pairs, as GPT-NeoX and LLaMA).

Megatron semantics kept: the vocabulary is padded up to a multiple of ``make_vocab_size_divisible_by``
(the padded rows get logits too); weights are drawn from normal(0, ``init_method_std``) and the residual
output projections (attention ``out_proj``, MLP ``down_proj``) from normal(0, std / sqrt(2 * num_layers));
biases start at zero and norms at one. The MLP is GELU with ``ffn_hidden_size`` 4h by default, or SwiGLU
with int(8h/3) rounded up to a multiple of 64 (LLaMA's rule, keeping the parameter count near the GELU MLP).
With ``--num-experts`` it is a mixture of such MLPs (``rapidlite.models.gpt_moe``); the architecture is
``GPTConfig`` (``rapidlite.models.gpt_config``).

LayerNorm is NVIDIA Apex's ``FusedLayerNorm`` when the model is built on CUDA with Apex installed; built on the
CPU, as rapidlite builds it before moving it, it is torch's (see ``_apex_layer_norm``).

With ``labels`` the forward returns ``(loss_sum, num_tokens)``: fp32 cross-entropy summed over the kept
positions, so gradient accumulation can weight every token the same. A model built Megatron's way
(``GPTModel()``, its architecture from the flags) returns Megatron's per-token losses ``[b, s]`` instead.
``save_pretrained`` and ``from_pretrained`` use ``config.json`` + ``model.safetensors``, storing a tied output
weight once.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidlite.errors import CheckpointError, ConfigError
from rapidlite.models.apex import nvidia_apex
from rapidlite.models.gpt_config import GPTConfig
from rapidlite.models.gpt_moe import MoELayer
from rapidlite.models.head import chunked_head_loss, chunks_loss, kept_tokens
from rapidlite.models.losses import maybe_loss_parallel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "rapidlite-gpt"


def _norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return _apex_layer_norm(config) or nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon, bias=config.bias)


def _apex_layer_norm(config: GPTConfig) -> nn.Module | None:
    """NVIDIA Apex's FusedLayerNorm for a model built on CUDA (under ``torch.device("cuda")``), when Apex is
    installed and the norm has a bias (Apex's has no bias-free form); else None.

    A model built on the CPU and moved later keeps torch's LayerNorm, and so do rapidlite's own runs, which
    build on the CPU: torch's CUDA ``layer_norm`` is a fused kernel as well, and it also takes the DTensors of
    sequence parallelism and compiles without graph breaks, which Apex's does not. Swapping modules when the
    model moves would change its module types under whoever holds it, for no measurable gain."""
    if torch.get_default_device().type != "cuda" or not config.bias:
        return None
    apex = nvidia_apex()
    if apex is None:
        return None
    try:
        return apex.fused_layer_norm(config.hidden_size, eps=config.layernorm_epsilon)
    except (RuntimeError, ImportError):  # an Apex built without its CUDA extensions
        return None


def rope_angles(position_ids: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """Rotation angles ``[b, 1, s, head_dim / 2]`` (fp32) for ``position_ids`` ``[b, s]``."""
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = base**-exponents
    return (position_ids.float()[..., None] * inv_freq)[:, None]


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of ``x`` ``[b, heads, s, d]`` by ``angles``, in fp32."""
    cos, sin = angles.cos(), angles.sin()
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class Embedding(nn.Module):
    """Word embeddings plus (for ``learned_absolute``) position embeddings, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        return self.dropout(x)


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections (each shardable column-wise)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(h, h, bias=config.bias)
        self.k_proj = nn.Linear(h, h, bias=config.bias)
        self.v_proj = nn.Linear(h, h, bias=config.bias)
        self.out_proj = nn.Linear(h, h, bias=config.bias)
        # Context parallelism's attention (``rapidlite.parallel.context_parallel``), set on the running model:
        # called on this rank's shard of the sequence as ``context_parallel(q, k, v, causal, segment_ids)``.
        self.context_parallel: Any = None

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in self.qkv)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        dropout = self.dropout if self.training else 0.0
        if self.context_parallel is not None:
            y = self.context_parallel(q, k, v, True, segment_ids)
        elif attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU MLP, or SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.up_proj = nn.Linear(h, f, bias=config.bias)
        self.gate_proj = nn.Linear(h, f, bias=config.bias) if config.swiglu else None
        self.down_proj = nn.Linear(f, h, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + dropout(attention(norm(x)))``, then ``x + dropout(mlp(norm(x)))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_norm = _norm(config)
        self.attention = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MoELayer(config) if config.num_experts else MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_norm(x), rope, attention_mask, segment_ids))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """Decoder-only transformer: ``embedding`` → ``layers`` → ``final_norm`` → ``output``.

    ``GPTModel(config)``: with ``labels`` the forward returns ``(loss_sum, num_tokens)``, rapidlite's
    token-exact loss; with ``per_token_loss=True`` it returns the per-token fp32 losses ``[b, s]``, as
    Megatron's GPT does. Megatron's keyword arguments (``num_tokentypes=0, parallel_output=True,
    pre_process=True, post_process=True``) are accepted. ``GPTModel()`` built from the running engine's flags
    is ``rapidlite.compat.megatron.GPTModel`` (``from rapidlite import GPTModel``): library code is handed its
    config.
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        *,
        per_token_loss: bool | None = None,
        num_tokentypes: int = 0,
        parallel_output: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        if num_tokentypes:
            raise ConfigError("GPTModel: token types (num_tokentypes > 0) are not supported; pass 0")
        if not (pre_process and post_process):
            raise ConfigError(
                "GPTModel: build the whole model (pre_process=True, post_process=True); with "
                "--pipeline-model-parallel-size rapidlite splits it into stages itself"
            )
        if config is None:
            raise ConfigError(
                "GPTModel() from the flags is Megatron's construction: import it as 'from rapidlite import GPTModel' "
                "(rapidlite.compat.megatron), or pass a GPTConfig"
            )
        self.config = config
        self.per_token_loss = bool(per_token_loss)
        self.chunked_loss = True  # --no-chunked-loss: the whole logits and torch's cross-entropy
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = _norm(config)
        self.output = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        if not config.untie_embeddings_and_output_weights:
            self.output.weight = self.embedding.word_embeddings.weight
        self.reset_parameters()

    @property
    def tied(self) -> bool:
        return not self.config.untie_embeddings_and_output_weights

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's init: normal(0, std) weights, std / sqrt(2L) residual projections, zero biases, unit norms."""
        std = self.config.init_method_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif hasattr(module, "normalized_shape") and module.weight is not None:  # torch's norms or Apex's
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        residual_std = std / math.sqrt(2.0 * self.config.num_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attention.out_proj.weight, mean=0.0, std=residual_std)
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.reset_parameters(std, residual_std)
            else:
                nn.init.normal_(layer.mlp.down_proj.weight, mean=0.0, std=residual_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, int]:
        """Logits ``[b, s, padded_vocab]`` (in the compute dtype); with ``labels``, ``(loss_sum, num_tokens)``.

        ``position_ids`` ``[b, s]``: default 0..s-1 (reset per document for ``--reset-position-ids``).
        ``attention_mask``: bool, broadcastable to ``[b, heads, s, s]``, True where a query may attend a key;
        it replaces the causal mask, so it must be causal itself. ``labels`` ``[b, s]``: next-token ids, -100
        ignored. ``loss_mask`` ``[b, s]`` (float or bool): positions with 0 are left out. ``loss_sum`` is the
        fp32 0-dim sum of token cross-entropies, ``num_tokens`` the Python int count of the tokens summed.
        ``segment_ids`` ``[b, s]``: under context parallelism (where this rank holds a shard of each sequence),
        the document number of each token, for the mask that ``attention_mask`` gives in one process.
        """
        b, s = input_ids.shape
        c = self.config
        if position_ids is None:
            if c.position_embedding_type == "learned_absolute" and s > c.max_position_embeddings:
                raise ConfigError(f"input length {s} exceeds --max-position-embeddings {c.max_position_embeddings}")
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be bool (True = attend), got {attention_mask.dtype}")
        rope = rope_angles(position_ids, c.head_dim, c.rotary_base) if c.position_embedding_type == "rope" else None
        x = self.embedding(input_ids, position_ids)
        for layer in self.layers:
            x = layer(x, rope, attention_mask, segment_ids)
        hidden = self.final_norm(x)
        if chunks_loss(self.output, labels, self.chunked_loss):
            return chunked_head_loss(self.output, hidden, labels, loss_mask, self.per_token_loss)
        return self.head_output(self.output(hidden), labels, loss_mask)

    def head_output(
        self, logits: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None = None
    ) -> Any:
        """What the forward returns for these logits: the logits without ``labels``; with them the per-token
        losses (``per_token_loss``, Megatron's convention) or ``(loss_sum, num_tokens)``."""
        if labels is None:
            return logits
        if self.per_token_loss:
            return self.token_losses(logits, labels)
        return self.loss(logits, labels, loss_mask)

    @staticmethod
    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 cross-entropy of every position, ``[b, s]`` (0 where the label is -100)."""
        with maybe_loss_parallel(logits):
            losses = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none"
            )
        if hasattr(losses, "full_tensor"):
            losses = losses.full_tensor()
        return losses.view(labels.shape)

    @staticmethod
    def loss(
        logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(sum of fp32 cross-entropies over kept positions, their count)``."""
        labels = labels.flatten()
        keep = kept_tokens(labels, None if loss_mask is None else loss_mask.flatten())
        # Vocabulary-sharded logits (tensor parallelism) take the parallel cross-entropy on their shards.
        with maybe_loss_parallel(logits):
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.masked_fill(~keep, -100), ignore_index=-100, reduction="sum"
            )
        if hasattr(loss_sum, "full_tensor"):
            loss_sum = loss_sum.full_tensor()
        return loss_sum, int(keep.sum().item())

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, a tied weight counted once; ``exclude_embeddings`` leaves out the word and position
        embeddings (and with them a tied output layer)."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in self.embedding.parameters():
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_length``: ``6 N + 12 L h s``, rapidlite's
        count for every model (``rapidlite.models.flops``)."""
        from rapidlite.models.flops import ModelFlops  # here: flops looks up the family, whose module imports this one

        return ModelFlops.of(self).per_token(self.config.seq_length)

    def save_pretrained(
        self, save_directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None, **_: Any
    ) -> None:
        """Write ``config.json`` and ``model.safetensors``; ``state_dict`` overrides the module's own weights
        (e.g. full weights gathered from shards). A tied output weight is stored once, as the embedding.
        Other keyword arguments (``safe_serialization``...) are accepted for Hugging Face compatibility."""
        from safetensors.torch import save_file

        state = dict(self.state_dict() if state_dict is None else state_dict)
        if self.tied:
            output = state.pop("output.weight", None)
            if output is not None:
                state.setdefault("embedding.word_embeddings.weight", output)
        tensors = {}
        for key, value in state.items():
            if hasattr(value, "full_tensor"):  # a DTensor shard of an FSDP model
                value = value.full_tensor()
            tensors[key] = value.detach().cpu().contiguous()
        os.makedirs(save_directory, exist_ok=True)
        save_file(tensors, os.path.join(save_directory, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(save_directory, CONFIG_FILE), "w") as f:
            json.dump({"model_type": MODEL_TYPE, **self.config.to_dict()}, f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, per_token_loss: bool = False, **_: Any) -> GPTModel:
        """Load a model written by ``save_pretrained``, or exported in Hugging Face's layout by rapidlite
        (weights in the config's fp32 parameters)."""
        kwargs = {"per_token_loss": per_token_loss}
        from safetensors.torch import load_file

        config_path, weights_path = (os.path.join(directory, name) for name in (CONFIG_FILE, WEIGHTS_FILE))
        for path in (config_path, weights_path):
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: not found; expected a directory written by GPTModel.save_pretrained")
        with open(config_path) as f:
            saved = json.load(f)
        from rapidlite.models import gpt_hf

        if gpt_hf.CONFIG_KEY in saved:  # exported in Hugging Face's layout (see rapidlite.models.gpt_hf)
            model = cls(GPTConfig.from_dict(saved[gpt_hf.CONFIG_KEY]), **kwargs)
            state = gpt_hf.gpt_state_dict(model.config, load_file(weights_path))
        else:
            model = cls(GPTConfig.from_dict(saved), **kwargs)
            state = load_file(weights_path)
        if model.tied:
            state["output.weight"] = state["embedding.word_embeddings.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}")
        return model
