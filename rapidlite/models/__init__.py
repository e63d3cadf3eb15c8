"""Models and their families. Importing the package registers the built-in families (``families/``), so every
``spec_of`` lookup sees them whichever module is imported first."""

from rapidlite.models import families  # noqa: F401 (registers the built-in families)
