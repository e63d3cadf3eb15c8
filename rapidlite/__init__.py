"""rapidlite: Megatron-style speed and memory switches for training transformer models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rapidlite.errors import CheckpointError, ConfigError, DataError, RapidliteError

__version__ = "0.1.0"

# The engine and templates import torch; they load on first use so that ``rapidlite --help`` and flag
# errors answer at once.
_LAZY = {
    "RapidliteEngine": "rapidlite.engine",
    "RapidformerEngine": "rapidlite.engine",  # Rapidformer's name, so its scripts run with the import renamed
    "Finetuner": "rapidlite.trainer",
    "PreTrainer": "rapidlite.trainer",
    "Pretrainer": "rapidlite.trainer",  # Rapidformer spells it so in places
    "GRPOFinetuner": "rapidlite.tasks.grpo",  # online RL templates: reward_functions_provider beside the others
    "RLOOFinetuner": "rapidlite.tasks.rloo",
    "get_args": "rapidlite.compat.global_vars",
    "get_logger": "rapidlite.compat.global_vars",
    "get_timers": "rapidlite.compat.global_vars",
    "get_tokenizer": "rapidlite.compat.global_vars",
    "build_train_valid_test_datasets": "rapidlite.data.gpt_dataset",
    "get_ltor_masks_and_position_ids": "rapidlite.data.gpt_dataset",
    "build_train_valid_test_datasets_for_huggingface": "rapidlite.compat.megatron",
    "GPTModel": "rapidlite.compat.megatron",  # GPTModel() from the flags, as Megatron's scripts build it
    "mpu": None,  # a module: rapidlite.compat.mpu
}

if TYPE_CHECKING:
    from rapidlite.compat import mpu
    from rapidlite.compat.global_vars import get_args, get_logger, get_timers, get_tokenizer
    from rapidlite.compat.megatron import GPTModel, build_train_valid_test_datasets_for_huggingface
    from rapidlite.data.gpt_dataset import build_train_valid_test_datasets, get_ltor_masks_and_position_ids
    from rapidlite.engine import RapidformerEngine, RapidliteEngine
    from rapidlite.tasks.grpo import GRPOFinetuner
    from rapidlite.tasks.rloo import RLOOFinetuner
    from rapidlite.trainer import Finetuner, PreTrainer, Pretrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = _LAZY[name]
        value = (
            importlib.import_module(f"rapidlite.compat.{name}")
            if module is None
            else getattr(importlib.import_module(module), name)
        )
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rapidlite' has no attribute {name!r}")


__all__ = [
    "RapidliteEngine",
    "RapidformerEngine",
    "mpu",
    "build_train_valid_test_datasets_for_huggingface",
    "GPTModel",
    "Finetuner",
    "PreTrainer",
    "GRPOFinetuner",
    "RLOOFinetuner",
    "Pretrainer",
    "get_args",
    "get_logger",
    "get_timers",
    "get_tokenizer",
    "build_train_valid_test_datasets",
    "get_ltor_masks_and_position_ids",
    "RapidliteError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "__version__",
]
