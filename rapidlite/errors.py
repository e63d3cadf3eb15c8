"""Errors a user can cause.

Each is one readable line that names the flag or file and the fix. The CLI (and
the engine's exception hook for ``python my_script.py`` runs) prints that line
and exits with code 2, without a traceback. Everything else is a bug and keeps
its traceback.
"""

# How torch's DataLoader re-raises a worker's exception: the worker's traceback inside the message.
WORKER_TRACEBACK = "Original Traceback (most recent call last):"


class RapidliteError(Exception):
    """Base class of errors caused by the user's input (flags, files, data)."""

    exit_code = 2

    def __str__(self) -> str:
        text = super().__str__()
        if WORKER_TRACEBACK in text:  # raised in a data loader worker: the line it was raised with
            last = text.rstrip().splitlines()[-1]
            return last.split(": ", 1)[1] if ": " in last else last
        return text


class ConfigError(RapidliteError):
    """Inconsistent or invalid flags."""


class DataError(RapidliteError):
    """Missing, unreadable or malformed data."""


class CheckpointError(RapidliteError):
    """Missing or corrupt checkpoint."""


class OutputError(RapidliteError):
    """An output the run cannot write (``metrics.jsonl`` on a full disk)."""


class TrainingDiverged(RapidliteError):
    """The loss or the gradients stayed non-finite (NaN/inf): the run stops without saving them."""

    exit_code = 3


class NotImplementedYetError(ConfigError):
    """A flag that is parsed but whose feature is not available in this version."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """An exception's first line (at most ``limit`` characters), or its type's name when it has no text: what a
    one-line error quotes of a library's long message."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
