"""rapidlite: Megatron-style speed and memory switches for training transformer models."""

from rapidlite.engine import RapidliteEngine
from rapidlite.errors import CheckpointError, ConfigError, DataError, RapidliteError
from rapidlite.global_vars import get_args, get_logger, get_timers
from rapidlite.trainer import Finetuner, PreTrainer

__version__ = "0.1.0"

# Rapidformer spells it Pretrainer in places.
Pretrainer = PreTrainer

__all__ = [
    "RapidliteEngine",
    "Finetuner",
    "PreTrainer",
    "Pretrainer",
    "get_args",
    "get_logger",
    "get_timers",
    "RapidliteError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "__version__",
]
