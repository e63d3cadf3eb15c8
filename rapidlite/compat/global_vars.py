"""``get_args()``, ``get_logger()``, ``get_timers()``, ``get_tokenizer()`` for user scripts written in Rapidformer's
style: each reads the engine created last (``rapidlite.engine.current_engine``).

Library code never calls these: it takes its configuration explicitly.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rapidlite.engine import RapidliteEngine, current_engine
from rapidlite.observe.logging import LOGGER_NAME, Timers

_TOKENIZER: tuple[RapidliteEngine, Any] | None = None  # the engine and the tokenizer its flags name, built once


def _engine(what: str) -> RapidliteEngine:
    engine = current_engine()
    if engine is None:
        raise RuntimeError(f"{what} called before RapidliteEngine() was created")
    return engine


def get_distributed_context() -> Any:
    """The running engine's topology (``rapidlite.runtime.distributed.DistributedContext``)."""
    return _engine("rapidlite.mpu").dist


def get_args() -> argparse.Namespace:
    """The parsed flags of the running engine."""
    return _engine("get_args()").args


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def get_timers() -> Timers:
    return _engine("get_timers()").timers


def get_tokenizer() -> Any:
    """The tokenizer the flags name (``--tokenizer-type`` and its files, else the tokenizer of
    ``--pretrained-model-name-or-path``), built once: Megatron's ``get_tokenizer()``."""
    global _TOKENIZER
    engine = _engine("get_tokenizer()")
    if _TOKENIZER is None or _TOKENIZER[0] is not engine:
        from rapidlite.data.tokenizers import tokenizer_of

        _TOKENIZER = (engine, tokenizer_of(engine.settings))
    return _TOKENIZER[1]
