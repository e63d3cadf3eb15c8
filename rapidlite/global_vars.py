"""``get_args()``, ``get_logger()``, ``get_timers()`` for user scripts written in Rapidformer's style.

Library code never reads these: it takes its configuration explicitly. The engine sets them when it
is created.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rapidlite.logging import LOGGER_NAME, Timers

_ARGS: argparse.Namespace | None = None
_TIMERS: Timers | None = None
_TOKENIZER = None
_DIST = None  # the engine's DistributedContext, for rapidlite.mpu


def set_global_args(args: argparse.Namespace, timers: Timers) -> None:
    global _ARGS, _TIMERS, _TOKENIZER
    _ARGS, _TIMERS, _TOKENIZER = args, timers, None


def set_distributed_context(context: Any) -> None:
    global _DIST
    _DIST = context


def get_distributed_context() -> Any:
    """The running engine's topology (``rapidlite.distributed.DistributedContext``)."""
    if _DIST is None:
        raise RuntimeError("rapidlite.mpu used before RapidliteEngine() was created")
    return _DIST


def get_args() -> argparse.Namespace:
    """The parsed flags of the running engine."""
    if _ARGS is None:
        raise RuntimeError("get_args() called before RapidliteEngine() was created")
    return _ARGS


def args_or_none() -> argparse.Namespace | None:
    """The flags of the engine created last, or None before any (``get_args`` raises then)."""
    return _ARGS


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def get_timers() -> Timers:
    if _TIMERS is None:
        raise RuntimeError("get_timers() called before RapidliteEngine() was created")
    return _TIMERS


def get_tokenizer():
    """The tokenizer the flags name (``--tokenizer-type`` and its files, else the tokenizer of
    ``--pretrained-model-name-or-path``), built once: Megatron's ``get_tokenizer()``."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from rapidlite.data.tokenizers import tokenizer_of

        _TOKENIZER = tokenizer_of(get_args().sections)
    return _TOKENIZER
