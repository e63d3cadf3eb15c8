"""LoRA and QLoRA on any model: peft adapters over frozen base weights, optionally held in 4-bit or 8-bit by
bitsandbytes.

``prepare(model, settings, ...)`` is what ``engine.compose`` applies first when ``--lora-rank`` is given:

1. ``--load-in-4bit`` / ``--load-in-8bit``: a model whose linear layers are still full precision (a user
   script's own model) has them replaced by bitsandbytes layers, quantised on the run's device. The black-box
   tasks load the base quantised already (``load_kwargs``: ``from_pretrained(quantization_config=...)``,
   which never holds the whole model in full precision), and such a model is left as it is. Output heads
   (the language-model head, a classifier) stay in full precision, as transformers keeps them.
2. ``peft.get_peft_model`` with a ``LoraConfig`` from the flags; the target modules default to the model
   family's (``ModelSpec.lora_targets``; "all-linear": every linear layer but the output heads). A model
   that is a peft model already (a user's provider built it) is respected as it is.
3. Every trainable parameter is kept in fp32 (the adapters, ``--lora-modules-to-save`` copies), whatever
   dtype the frozen base was loaded in, so fp16/bf16 autocast updates fp32 weights.
4. Each adapted linear layer adds its update to the base output in one ``addmm`` (``rapidlite.models.lora_addmm``:
   one output-sized tensor where peft's forward makes three).

Checkpoints of a peft model hold its trainable tensors only (``trainable_only``); the export writes the
adapter in peft's own format and, with ``--merge-lora``, the merged model (``rapidlite.models.lora_export``).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rapidlite.config.sections import LoraConfig
from rapidlite.errors import ConfigError
from rapidlite.models.spec import EXPERTS

# bitsandbytes logs a warning on import on AVX-512 BF16 CPUs when an optional hub-fetched kernel for its packed
# inference path is missing; rapidlite keeps the training kernel in evaluation (keep_training_kernel) and never
# uses that path.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"
QUANT_INSTALL = "pip install 'rapidlite[quant]'"
# Output heads keep full precision and are not adapted by "all-linear" (transformers keeps its output
# embeddings unquantised too); a classification head is usually trained in full (--lora-modules-to-save).
# (GPT-NeoX's language-model head is embed_out; the built-in GPT's is output.)
HEAD_NAMES = ("lm_head", "embed_out", "output", "classifier", "score", "qa_outputs")
# What transformers leaves unquantised when it loads a base quantised: the heads by name, which it matches as a
# suffix of a module's name, so not "output" (a BERT layer's attention.output would match).
# Masked-LM heads too: their decoder is tied to the input embeddings, which stay unquantised (BERT's "cls",
# DistilBERT's "vocab_projector", ELECTRA's "generator_lm_head"; RoBERTa's is "lm_head").
SKIP_ON_LOAD = (*(name for name in HEAD_NAMES if name != "output"), "cls", "vocab_projector", "generator_lm_head")
# peft's task types by the Hugging Face head class: the type decides which heads peft trains in full
# (a sequence classifier's "classifier"/"score") and the forward signature of the wrapper.
_TASK_TYPES = {
    "ForCausalLM": "CAUSAL_LM",
    "ForSequenceClassification": "SEQ_CLS",
    # peft has no multiple-choice type; its sequence classifier trains the scoring head ("classifier") in full
    # and passes the [batch, choices, length] inputs through unchanged
    "ForMultipleChoice": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
}


MUTATING_INITS = ("pissa", "olora")  # --lora-init values that rewrite the base weights (to their residual)


def split_names(values: Iterable[str] | None) -> tuple[str, ...]:
    """Module names given as separate words or comma-separated (``q_proj,v_proj``); none for ``None``."""
    return tuple(name for value in values or () for name in value.replace(",", " ").split())


def require_bitsandbytes(flag: str) -> None:
    """One line naming the install command when bitsandbytes is missing (checked without importing it)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{flag} needs bitsandbytes, which is not installed: {QUANT_INSTALL}")


def require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora-rank needs peft, which is not installed: pip install peft")


# ------------------------------------------------------------------------------------------- loading
def load_kwargs(settings: LoraConfig, compute_dtype: torch.dtype | None, device: torch.device) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for the base model of a black-box task.

    Full fine-tuning loads fp32 weights (transformers 5 would otherwise keep a bf16 checkpoint in bf16, and
    AdamW on bf16 weights loses small updates); with LoRA the frozen base is loaded in the compute dtype
    (half the memory under bf16/fp16) and, with ``--load-in-4bit``/``--load-in-8bit``, quantised while it is
    read, onto this rank's device."""
    if not settings.enabled:
        return {"dtype": torch.float32}
    kwargs: dict[str, Any] = {"dtype": compute_dtype or torch.float32}
    if settings.quantized:
        require_bitsandbytes(settings.quant_flag)
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=settings.load_in_4bit,
            load_in_8bit=settings.load_in_8bit,
            bnb_4bit_quant_type=settings.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=settings.bnb_4bit_use_double_quant,
            bnb_4bit_compute_dtype=compute_dtype or torch.float32,
            # transformers' own guess keeps only the last module; a classifier head is trained in full
            llm_int8_skip_modules=[*SKIP_ON_LOAD, *split_names(settings.lora_modules_to_save)],
        )
        kwargs["device_map"] = {"": str(device)}
    return kwargs


# ------------------------------------------------------------------------------------- quantisation
def _is_bnb_linear(module: nn.Module) -> bool:
    if "bitsandbytes" not in sys.modules:  # a model holding its layers has imported it
        return False
    import bitsandbytes as bnb

    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes 4-bit or 8-bit layers."""
    return any(_is_bnb_linear(m) for m in model.modules())


def _linear_like(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D)) or _is_bnb_linear(module)


def output_heads(model: nn.Module) -> set[str]:
    """Qualified names of the model's output heads: the language-model head (Hugging Face's output
    embeddings, or a linear layer sharing the input embedding's weight or giving one output per token of its
    vocabulary) and the usual classifier names."""
    heads = {name for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in HEAD_NAMES and _linear_like(m)}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    tied = {id(m.weight) for m in embeddings}
    vocab = {m.num_embeddings for m in embeddings if m.num_embeddings > 2}
    for name, module in model.named_modules():
        if module is output:
            heads.add(name)
        elif isinstance(module, nn.Linear) and (id(module.weight) in tied or module.out_features in vocab):
            heads.add(name)  # a language-model head: tied to the input embedding, or one logit per token
    return heads


def quantize(model: nn.Module, settings: LoraConfig, compute_dtype: torch.dtype | None, device: torch.device) -> int:
    """Replace the full-precision linear layers (not the output heads or the modules trained in full) by
    bitsandbytes 4-bit or 8-bit layers holding the same weights, quantised on ``device``. Returns how many."""
    require_bitsandbytes(settings.quant_flag)
    import bitsandbytes as bnb

    keep = output_heads(model)
    saved = set(settings.lora_modules_to_save or ())
    replaced = 0
    for name, module in list(model.named_modules()):
        # Subclasses too (Falcon's FalconLinear), which transformers' own quantisation on load leaves alone.
        plain = isinstance(module, nn.Linear) and not _is_bnb_linear(module)
        if not plain or name in keep or name.rsplit(".", 1)[-1] in saved:
            continue
        has_bias = module.bias is not None
        weight = module.weight.data
        if settings.load_in_4bit:
            layer = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=has_bias,
                compute_dtype=compute_dtype or torch.float32,
                quant_type=settings.bnb_4bit_quant_type,
                compress_statistics=settings.bnb_4bit_use_double_quant,
                device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                weight.float().cpu(),
                requires_grad=False,
                quant_type=settings.bnb_4bit_quant_type,
                compress_statistics=settings.bnb_4bit_use_double_quant,
            )
        else:
            layer = bnb.nn.Linear8bitLt(
                module.in_features, module.out_features, bias=has_bias, has_fp16_weights=False, device="meta"
            )
            layer.weight = bnb.nn.Int8Params(weight.float().cpu(), requires_grad=False, has_fp16_weights=False)
        if has_bias:
            layer.bias = nn.Parameter(module.bias.data.clone(), requires_grad=False)
        layer = layer.to(device)  # bitsandbytes quantises a weight when it is moved to its device
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        replaced += 1
    return replaced


def keep_training_kernel(model: nn.Module) -> None:
    """bitsandbytes repacks a 4-bit weight for a bf16 inference kernel the first time a layer runs in evaluation
    on a CPU with AVX-512 BF16: evaluation would then compute in bf16 whatever the compute dtype, and the repacked
    weight is inverted for saving only approximately. The layers keep the training kernel instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The full-precision weight a bitsandbytes layer computes with."""
    import bitsandbytes as bnb

    weight = layer.weight
    if getattr(weight, "quant_state", None) is not None:  # 4-bit
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    scb = getattr(weight, "SCB", None)
    if scb is None:
        scb = getattr(layer.state, "SCB", None)
    return weight.data.float() * (scb.float().unsqueeze(1) / 127.0)


# -------------------------------------------------------------------------------------------- adapters
def is_peft_model(model: Any) -> bool:
    # A peft model exists only once peft is imported; importing it to ask (peft brings bitsandbytes and
    # transformers' model classes: seconds) would slow the start of every run without adapters.
    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None)
    return peft_model is not None and isinstance(model, peft_model)


def unwrap(model: nn.Module) -> nn.Module:
    """The model a peft wrapper adapts (itself for other models)."""
    return model.get_base_model() if is_peft_model(model) else model


def _task_type(model: nn.Module) -> str | None:
    name = type(model).__name__
    task = next((task for suffix, task in _TASK_TYPES.items() if name.endswith(suffix)), None)
    if task is None and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        # T5ForConditionalGeneration, MarianMTModel, ...: no one suffix (vision-language models share
        # "ForConditionalGeneration" but are decoder-only).
        task = "SEQ_2_SEQ_LM" if hasattr(model, "generate") else None
    return task


def linear_module_names(model: nn.Module) -> list[str]:
    """The short names of the model's linear layers (what ``--lora-target-modules`` chooses from), output
    heads excluded."""
    heads = output_heads(model)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _linear_like(m) and n not in heads}
    return sorted(names)


def target_modules(model: nn.Module, settings: LoraConfig) -> list[str]:
    """The qualified names of the layers to adapt: the flags' names, else the family's defaults, else every
    linear layer; one line naming the choices when a name matches no linear layer."""
    from rapidlite.models.spec import spec_of

    heads = output_heads(model)
    linears = [n for n, m in model.named_modules() if _linear_like(m) and n]
    requested = split_names(settings.lora_target_modules)
    if not requested:
        requested = spec_of(model).lora_targets or (ALL_LINEAR,)
        defaulted = True
    else:
        defaulted = False
    if spec_of(model).moe is not None:  # the experts are parameters (expert_parameters), not layers
        requested = tuple(r for r in requested if r != EXPERTS)
        if not requested:
            return []
    if ALL_LINEAR in requested:
        return [n for n in linears if n not in heads]
    chosen = [n for n in linears if n.rsplit(".", 1)[-1] in requested or n in requested]
    vision = spec_of(model).vision
    if vision is not None and defaulted:  # the family's default adapts the language model, not the image encoder
        chosen = [n for n in chosen if vision.part(n) == "language"]
    missing = [r for r in requested if not any(n.rsplit(".", 1)[-1] == r or n == r for n in linears)]
    if missing and not defaulted:
        raise ConfigError(
            f"--lora-target-modules: no linear layer named {', '.join(missing)} in the model; its linear layers "
            f"are {', '.join(linear_module_names(model)) or 'none'} (or pass all-linear)"
        )
    if not chosen:  # a family default that this model (a variant) does not have
        return [n for n in linears if n not in heads]
    return chosen


def expert_parameters(model: nn.Module, settings: LoraConfig) -> list[str]:
    """peft's ``target_parameters`` of the experts' 3-D tensors (``mlp.experts.gate_up_proj``, ...) when the
    targets (the flags', else the family's default) name ``experts`` in a mixture-of-experts model; else none.
    peft adapts such a tensor without dropout or DoRA: those are one line."""
    from rapidlite.models.spec import moe_layout, spec_of

    spec, layout = spec_of(model), moe_layout(model)
    requested = split_names(settings.lora_target_modules) or spec.lora_targets
    if layout is None or EXPERTS not in requested:
        return []
    for on, flag in ((settings.lora_dropout > 0, "--lora-dropout"), (settings.use_dora, "--use-dora")):
        if on:
            raise ConfigError(
                f"{flag}: peft adapts the experts' 3-D tensors without it; drop {flag}, or leave the experts out "
                "(--lora-target-modules with the attention and MLP layers only)"
            )
    wanted = [f"{layout.experts}.{t}" for t in layout.expert_parameters]
    return sorted({w for n, _ in model.named_parameters() for w in wanted if n.endswith(f".{w}")})


def _check_modules_to_save(model: nn.Module, names: tuple[str, ...]) -> None:
    short = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n} | {n for n, _ in model.named_modules()}
    missing = [name for name in names if name not in short]
    if missing:
        heads = sorted(h.rsplit(".", 1)[-1] for h in output_heads(model))
        raise ConfigError(
            f"--lora-modules-to-save: no module named {', '.join(missing)} in the model"
            + (f" (its output heads: {', '.join(heads)})" if heads else "")
        )


def prepare(
    model: nn.Module,
    settings: LoraConfig,
    compute_dtype: torch.dtype | None,
    device: torch.device,
    logger: logging.Logger | None = None,
) -> nn.Module:
    """The model with the LoRA and quantisation flags applied (see the module docstring); ``model`` itself
    when no adapters are asked for and it is not a peft model."""
    if is_peft_model(model):
        _keep_trainable_fp32(model)
        keep_training_kernel(model)
        _fuse_updates(model)
        if logger is not None:
            logger.info(f"LoRA: the model is a peft model already, trained as it is; {trainable_summary(model)}")
        return model
    if not settings.enabled:
        return model
    require_peft()
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    quantized = 0
    if settings.quantized and not is_quantized(model):
        quantized = quantize(model, settings, compute_dtype, device)
        if not quantized:
            raise ConfigError(
                f"{settings.quant_flag}: {type(model).__name__} has no linear layer to quantise besides its output "
                f"heads (its layers are {', '.join(linear_module_names(model)) or 'none'}); drop the flag"
            )
    keep_training_kernel(model)
    modules_to_save = split_names(settings.lora_modules_to_save)
    _check_modules_to_save(model, modules_to_save)
    targets, experts = target_modules(model, settings), expert_parameters(model, settings)
    if experts and settings.quantized:
        raise ConfigError(
            f"{settings.quant_flag}: bitsandbytes quantises linear layers only, and a mixture of experts keeps its "
            "experts (most of its weights) as 3-D tensors it cannot hold in 4 or 8 bits; drop the flag (LoRA on "
            "the experts trains without it)"
        )
    config = PeftLoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha if settings.lora_alpha is not None else 2 * settings.lora_rank,
        lora_dropout=settings.lora_dropout,
        target_modules=targets,
        target_parameters=experts or None,
        modules_to_save=list(modules_to_save) or None,
        task_type=_task_type(model),
        use_dora=settings.use_dora,
        use_rslora=settings.use_rslora,
        init_lora_weights=True if settings.lora_init == "default" else settings.lora_init,
    )
    with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in transformers 5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    if settings.lora_init in MUTATING_INITS:  # the adapters' start, to export them as a plain LoRA later
        from peft import get_peft_model_state_dict

        initial = get_peft_model_state_dict(peft_model)
        peft_model.rapidlite_initial_adapter = {k: v.detach().to("cpu", copy=True) for k, v in initial.items()}
    _keep_trainable_fp32(peft_model)
    _fuse_updates(peft_model)
    if logger is not None:
        bits = settings.quant_flag[len("--load-in-") :]
        what = f"; {quantized} linear layers quantised to {bits}" if quantized else ""
        variants = [n for n, on in (("DoRA", config.use_dora), ("rsLoRA", config.use_rslora)) if on]
        variants += [f"{settings.lora_init} initialisation"] if settings.lora_init != "default" else []
        logger.info(
            f"LoRA{' (' + ', '.join(variants) + ')' if variants else ''}: rank {config.r}, alpha "
            f"{config.lora_alpha:g}, dropout {config.lora_dropout:g} on "
            f"{len(targets)} layers ({', '.join(sorted({t.rsplit('.', 1)[-1] for t in targets}))})"
            f"{_experts_line(peft_model, experts)}{what}; {trainable_summary(peft_model)}"
        )
    return peft_model


def _fuse_updates(model: nn.Module) -> None:
    from rapidlite.models.lora_addmm import fuse_lora_updates

    fuse_lora_updates(model)


def _experts_line(model: nn.Module, experts: list[str]) -> str:
    """What the adapters on the experts add to the LoRA line: the tensors and the trainable split."""
    if not experts:
        return ""
    module = f".{experts[0].rsplit('.', 1)[0]}."  # the experts' module, as the family names it
    on_experts = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and module in n)
    others = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) - on_experts
    names = ", ".join(e.rsplit(".", 1)[-1] for e in experts)
    return f" and the experts' {names} (trainable: {others:,d} outside the experts, {on_experts:,d} on them)"


def _keep_trainable_fp32(model: nn.Module) -> None:
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def trainable_summary(model: nn.Module) -> str:
    """peft's ``print_trainable_parameters`` line (4-bit weights counted by their unpacked size)."""
    if is_peft_model(model):
        trainable, total = model.get_nb_trainable_parameters()
    else:
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    share = 100.0 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}"


def adapter_directory(path: str) -> Path | None:
    """The peft adapter directory ``path`` names, or None: ``path`` itself (``adapter_config.json`` and no model
    ``config.json``), or its ``adapter/`` (rapidlite's export of a LoRA run without ``--merge-lora``)."""
    directory = Path(path)
    if not directory.is_dir() or (directory / "config.json").is_file():
        return None
    return next((d for d in (directory, directory / "adapter") if (d / "adapter_config.json").is_file()), None)


def adapter_base(directory: Path) -> str:
    """The base model an adapter directory was trained on (its ``adapter_config.json``), or one line."""
    import json

    with open(directory / "adapter_config.json", encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"--pretrained-model-name-or-path {directory}: a LoRA adapter whose adapter_config.json names no "
            "base_model_name_or_path; write the base model's directory or hub name there"
        )
    return base


def load_adapter(base: nn.Module, directory: Path) -> nn.Module:
    """``base`` with the adapter in ``directory``, its adapters trainable (a run from an adapter goes on training
    it, or evaluates it)."""
    require_peft()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(directory), is_trainable=True)


# --------------------------------------------------------------------------------------- saving
def trainable_only(model: nn.Module) -> bool:
    """Checkpoints of this model hold its trainable tensors only (the adapters; the base is loaded again)."""
    return is_peft_model(model)
