"""The programs: ``rapidlite`` (and ``rapidformer``) with its subcommands ``env``, ``plot`` and ``export``,
``rapidlite-eval``, ``rapidlite-preprocess``, ``rapidlite-bench``, and the flags reference page."""
