"""Settings resolved once (``rapidlite.resolve.settings``): the parsed flags checked, every value derived, frozen."""

from rapidlite.resolve.settings import (
    FrozenConfigError,
    RunConfig,
    parse_args,
    resolve,
    resolve_command,
    with_embedded_demo,
)

__all__ = ["FrozenConfigError", "RunConfig", "parse_args", "resolve", "resolve_command", "with_embedded_demo"]
