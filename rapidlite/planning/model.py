"""The run's model for ``--dry-run``: built on the ``meta`` device as its task builds it, and the sequence length
the plan measures it at."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import TaskSpec, find_task
from rapidlite.errors import ConfigError

# A user script's data without --seq-length is planned at this length (a black-box task's default is its own).
SCRIPT_SEQ_LENGTH = 128


def task_spec(settings: Sections) -> TaskSpec | None:
    """The black-box task the plan is for: None for a user script (whose model the plan reads from its config)."""
    return find_task(settings.task.task) if settings.task.user_script is None else None


def plans_images(spec: TaskSpec | None, config: Any) -> bool:
    """Whether the run is planned as a vision-language one: a task that reads images, on a vision-language config
    (the tasks train such a model through its processor, images or not)."""
    from rapidlite.models.vision import is_vision_config

    return spec is not None and spec.images and is_vision_config(config)


def _auto_class(spec: TaskSpec | None, config: Any) -> Any:
    """The class the task builds from ``config`` (its ``TaskSpec``), else the config's own architecture."""
    import transformers

    if plans_images(spec, config):
        return transformers.AutoModelForImageTextToText
    name = spec.model_class_name(getattr(config, "model_type", None)) if spec is not None else None
    if name is not None:
        return getattr(transformers, name)
    architectures = getattr(config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name is not None and hasattr(transformers, name):
        return getattr(transformers, name)
    return transformers.AutoModel


def meta_model(settings: Sections) -> torch.nn.Module:
    """The run's model on the ``meta`` device: from ``--pretrained-model-name-or-path``'s config (sizes overridden
    by the flags as the tasks do), or the built-in GPT from the flags for pretraining."""
    return task_model(settings, torch.device("meta"))


def task_model(settings: Sections, device: torch.device, pretrained: bool = False) -> torch.nn.Module:
    """The run's model as its task builds it, on ``device``. ``pretrained``: a task that fine-tunes a model
    (not one that trains its config from scratch) starts from its pretrained weights, loaded here
    (``rapidlite export`` rebuilds a LoRA run's base so); otherwise the weights are the config's initialisation."""
    name, spec = settings.model.pretrained_model_name_or_path, task_spec(settings)
    if name is None and settings.checkpoint.load is not None and settings.checkpoint.load_is_pretrained_model:
        name = settings.checkpoint.load
    if name is None:
        if spec is None or not spec.from_config:
            raise ConfigError(
                "--dry-run builds the model from its config: give --pretrained-model-name-or-path (a hub name or "
                "a local model directory)"
            )
        from rapidlite.data.tokenizers import tokenizer_of
        from rapidlite.models.gpt import GPTConfig, GPTModel

        vocab_size = tokenizer_of(settings).vocab_size
        with device:
            return GPTModel(GPTConfig.of(settings, vocab_size))
    from transformers import AutoConfig

    from rapidlite.models.hf import override_sizes

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--pretrained-model-name-or-path {name}: cannot read its config ({str(e).splitlines()[0]})"
        ) from None
    from_config = spec is not None and spec.from_config
    if from_config:
        from rapidlite.data.tokenizers import tokenizer_of

        override_sizes(config, settings.model, settings.data.seq_length, tokenizer_of(settings).vocab_size)
    auto = _auto_class(spec, config)
    if pretrained and not from_config:
        from rapidlite.models.hf import load_error, load_hf_model

        try:
            return _frozen_parts(load_hf_model(auto.from_pretrained, name).to(device), settings, spec)
        except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
            raise load_error("model", name, e) from None
    # Auto classes build from a config with from_config; a model class named by the config's architectures
    # (the fallback for a task not listed above) with _from_config.
    build = getattr(auto, "from_config", None) or auto._from_config
    try:
        with device:
            return _frozen_parts(build(config), settings, spec)
    except ValueError as e:  # no class of the task's kind for this model type
        from rapidlite.models.hf import load_error

        raise load_error("model", name, e) from None


def _frozen_parts(model: torch.nn.Module, settings: Sections, spec: TaskSpec | None) -> torch.nn.Module:
    """A vision-language model's tower and projector frozen as the run freezes them (``--freeze-vision-tower``,
    ``--freeze-projector``)."""
    if plans_images(spec, getattr(model, "config", None)):
        from rapidlite.models.vision import freeze

        freeze(model, settings.vision.freeze_vision_tower, settings.vision.freeze_projector)
    return model


def forward_loss(
    model: torch.nn.Module,
    ids: torch.Tensor,
    inputs_per_sample: int = 1,
    chunked: str | None = None,
    target_length: int | None = None,
) -> torch.Tensor:
    """A training forward and loss on meta inputs: logits, then fp32 cross-entropy (as the tasks compute it);
    ``chunked``: through the chunked output layer where it serves the model, as the task then computes it (a
    preference task's pair of sequences too): a summed loss (``"sum"``) or per-token log-probabilities
    (``"tokens"``).
    ``inputs_per_sample`` > 1: each sample is that many sequences: ``[questions, choices, tokens]`` for a
    multiple-choice head, consecutive rows (``[pairs x 2, tokens]``, a preference pair) for any other.
    ``target_length``: an encoder-decoder's decoder tokens (``TaskSpec.target_length``), else the sources'."""
    from rapidlite.models.gpt import GPTModel
    from rapidlite.models.head import MIN_VOCAB, chunkable_head, output_logps

    if isinstance(model, GPTModel):
        if chunked and model.output.weight.shape[0] >= MIN_VOCAB:
            return model(ids, labels=torch.zeros_like(ids))[0]
        logits = model(ids)
    else:
        if inputs_per_sample > 1:
            ids = ids.unsqueeze(1).repeat(1, inputs_per_sample, 1)
            if "MultipleChoice" not in type(model).__name__:
                ids = ids.flatten(0, 1)
        seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
        targets = ids.new_zeros((ids.shape[0], target_length)) if seq2seq and target_length else ids
        inputs = {"input_ids": ids, "decoder_input_ids": targets} if seq2seq else {"input_ids": ids}
        if chunked and ids.dim() == 2 and chunkable_head(model) is not None:
            sum_only = chunked == "sum"
            logps = output_logps(model, inputs, torch.zeros_like(targets), shift=False, sum_only=sum_only)
            return -logps.sum()
        out = model(**inputs)
        logits = next(
            (getattr(out, k) for k in ("logits", "prediction_logits") if getattr(out, k, None) is not None), None
        )
        if logits is None:
            logits = out[0]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def sequence_length(settings: Sections, config: Any = None) -> int:
    """The run's sequence length: ``--seq-length``, else the fine-tuning task's default maximum; a default (none
    given, or one a task's defaults set) is lowered to the model's learned position table (``config``) as the tasks
    lower it. A given length beyond that table is the run's own one-line refusal, not a failed probe."""
    from rapidlite.models.hf import position_limit, within_positions

    spec = task_spec(settings)
    # A task that trains its config from scratch grows the table to the length; a script's own data without
    # --seq-length is planned at SCRIPT_SEQ_LENGTH.
    limit = position_limit(config) if config is not None and not (spec and spec.from_config) else None
    if settings.data.seq_length:
        seq_length, explicit = settings.data.seq_length, settings.given("seq_length")
    else:
        seq_length, explicit = SCRIPT_SEQ_LENGTH, False
    refusal = "the model has learned position embeddings for {limit} positions; use --seq-length {limit} or less"
    return within_positions(seq_length, limit, explicit, refusal)
