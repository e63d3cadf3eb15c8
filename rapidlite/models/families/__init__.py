"""The built-in model families, one module each, registered with ``rapidlite.models.spec`` on import (the
``rapidlite.models`` package imports this). A new family is a module here plus its import below."""

from rapidlite.models.families import bert, gpt, gpt2, llama, moe, vision  # noqa: F401 (registers them)
