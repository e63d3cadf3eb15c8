import logging
import os

import pytest

# Tests never touch a network: everything is built from configs and files they write.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAPIDLITE_NO_PROGRESS"] = "1"
# One torch thread in this process and in the runs it starts, unless OMP_NUM_THREADS says otherwise (set before
# torch is imported). The test models are tiny: a second thread gains little, and on a loaded 2-core machine it
# waits at OpenMP barriers for a core (a LoRA step of the tests took 0.7 s on one thread, 5-10 s on two).
os.environ.setdefault("OMP_NUM_THREADS", "1")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    """The messages rapidlite's logger emits during the test (its console handler writes to the real stdout)."""
    from rapidlite.logging import LOGGER_NAME

    handler = _Records()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


OPT_IN = ("soak", "slurm", "docker")


def pytest_collection_modifyitems(config, items):
    """Opt-in tests are deselected unless the ``-m`` expression names their marker: ``soak`` (a scenario the default
    suite runs once, repeated for statistics), ``slurm`` (a private Slurm, 2-3 minutes) and ``docker`` (builds the
    image, 5-6 minutes). ``pytest -m slurm`` runs those; ``-m "docker or not docker"`` runs everything else too. A
    ``-m 'not soak'`` in addopts would be replaced by any ``-m`` given on the command line (``-m distributed`` would
    then run them too)."""
    expression = config.option.markexpr or ""
    skipped = [name for name in OPT_IN if name not in expression]
    chosen = [item for item in items if not any(item.get_closest_marker(name) for name in skipped)]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        items[:] = chosen
