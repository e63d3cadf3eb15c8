"""What a user's providers return, taken apart and checked before the first step: the datasets
(``train_valid_test_datasets_provider``), the model, optimizer and scheduler
(``model_optimizer_lr_scheduler_provider``), the model's vocabulary against the token ids, and the class name the
logs give the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rapidlite.data.loader import require_map_style
from rapidlite.data.streaming import TokenStream
from rapidlite.engine import require_module
from rapidlite.errors import ConfigError, DataError


def model_class_name(module: torch.nn.Module) -> str:
    """The class the user built: PyTorch's composable DDP and FSDP2 swap a module's class for a subclass
    (``DDPGPTModel``, ``FSDPLlamaForCausalLM``) defined in ``torch.distributed``."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return type(module).__name__


def split_datasets(provided: Any) -> tuple[Any, Any, Any, Callable | None]:
    """``(train, valid, test[, collate_fn])`` from a datasets provider, with a clear error otherwise."""
    if not isinstance(provided, (tuple, list)) or len(provided) not in (3, 4):
        got = f"{len(provided)} values" if isinstance(provided, (tuple, list)) else f"a {type(provided).__name__}"
        raise DataError(
            "train_valid_test_datasets_provider must return (train, valid, test) or (train, valid, test, collate_fn) "
            f"(None for a split it has not), got {got}"
        )
    train, valid, test = provided[:3]
    for name, dataset in (("train", train), ("validation", valid), ("test", test)):
        if dataset is not None and not isinstance(dataset, TokenStream):  # a stream (--streaming) keeps its position
            require_map_style(dataset, f"train_valid_test_datasets_provider's {name} dataset")
    return train, valid, test, provided[3] if len(provided) == 4 else None


def check_vocabulary(model: torch.nn.Module, needed: tuple[int, str] | None, name: str | None) -> None:
    """One line, before any step, for a model whose input embeddings have fewer rows than the token ids need (it
    was an IndexError at the first batch that held such an id). A task that grows them (causal LM fine-tuning)
    has done so in its provider."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        rows = getattr(get(), "num_embeddings", None) if callable(get) else None
    except (AttributeError, NotImplementedError):  # a model without the accessor
        rows = None
    if needed is None or not isinstance(rows, int) or rows >= needed[0]:
        return
    model_name = f"--pretrained-model-name-or-path {name}" if name else "the model"
    raise ConfigError(
        f"{model_name}: its input embeddings have {rows} rows (token ids 0-{rows - 1}) but {needed[1]}: use the "
        f"tokenizer the model was trained with, or a model whose vocabulary holds {needed[0]} tokens (grown with "
        "resize_token_embeddings and saved; --task pretraining grows a config it trains from scratch)"
    )


def split_model_provided(provided: Any) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, optimizer, lr_scheduler)`` from a model provider, with a clear error otherwise."""
    hook = "model_optimizer_lr_scheduler_provider"
    if not isinstance(provided, (tuple, list)) or len(provided) != 3:
        got = f"{len(provided)} values" if isinstance(provided, (tuple, list)) else f"a {type(provided).__name__}"
        raise ConfigError(
            f"{hook} must return (model, optimizer, lr_scheduler) (None for the optimizer or scheduler builds it "
            f"from the flags), got {got}"
        )
    require_module(provided[0], f"{hook} returned")
    return provided[0], provided[1], provided[2]
