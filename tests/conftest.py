import fcntl
import functools
import logging
import os
import re
import tempfile
from pathlib import Path

import pytest

# Tests never touch a network: everything is built from configs and files they write.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAPIDLITE_NO_PROGRESS"] = "1"
# No curves.png at the end of the suite's --save runs (half a second of CPU each, most of it importing
# matplotlib); the tests of the picture lift it with the ``curves`` fixture.
os.environ["RAPIDLITE_NO_CURVES"] = "1"
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
    from rapidlite.observe.logging import LOGGER_NAME

    handler = _Records()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


@pytest.fixture
def curves(monkeypatch):
    """The suite's RAPIDLITE_NO_CURVES lifted: runs draw curves.png at their end, as they do for users."""
    monkeypatch.delenv("RAPIDLITE_NO_CURVES", raising=False)


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """W&B offline, quiet and local: runs under tmp_path/wandb, nothing read from or written to the home directory."""
    wandb = pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    root = tmp_path / "wandb-home"
    root.mkdir()
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_CONFIG_DIR": str(root / "config"),
        "WANDB_CACHE_DIR": str(root / "cache"),
        "WANDB_DATA_DIR": str(root / "data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB__DISABLE_STATS": "true",
        "WANDB__DISABLE_META": "true",
        "WANDB__SAVE_REQUIREMENTS": "false",
    }.items():
        monkeypatch.setenv(name, value)
    wandb.teardown()  # W&B reads its settings once per process: each test's start afresh
    yield root
    wandb.teardown()


OPT_IN = ("soak", "slurm", "docker", "exclusive")


_SHARED_FIXTURE = re.compile(r"^@pytest\.fixture\(scope=\"(module|session)\"", re.MULTILINE)


@functools.cache
def _shares_a_fixture(path: Path) -> bool:
    """Whether the test module at ``path`` defines a module- or session-scoped fixture of its own."""
    try:
        return bool(_SHARED_FIXTURE.search(path.read_text()))
    except OSError:
        return False


def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` (``--dist load``, the default), tests are handed out one at a time, except the tests of a
    module that defines a module- or session-scoped fixture (a reference run, the runs of several layouts): those
    go to one worker together, so that fixture is computed once. Handed out one by one, each worker that got one
    of them computed it again (the memory plan's eleven task runs were trained on both workers). pytest-xdist's
    ``--dist loadgroup`` would do this from markers, but it renames test ids, which pytest 9 no longer allows; the
    scheduler sees test ids only, so the module's file says. Another ``--dist`` keeps xdist's own scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _shares_a_fixture(config.rootpath / module) else nodeid

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Opt-in tests are deselected unless the ``-m`` expression names their marker: ``soak`` (a scenario the default
    suite runs once, repeated for statistics), ``slurm`` (a private Slurm, 2-3 minutes), ``docker`` (builds the
    image, 5-6 minutes) and ``exclusive`` (times the machine with nothing else running: 3-5 minutes in which the
    other workers wait; a timing is a benchmark's to print, not the default suite's to assert). ``pytest -m slurm``
    runs those; ``-m "docker or not docker"`` runs everything else too. A ``-m 'not soak'`` in addopts would be
    replaced by any ``-m`` given on the command line (``-m distributed`` would then run them too)."""
    expression = config.option.markexpr or ""
    skipped = [name for name in OPT_IN if name not in expression]
    chosen = [item for item in items if not any(item.get_closest_marker(name) for name in skipped)]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        items[:] = chosen


@pytest.fixture(autouse=True)
def _machine_turn(request):
    """A test marked ``exclusive`` (one that times the machine: tests/test_step_time.py) runs while no other test
    does: under pytest-xdist every test holds a shared lock on a file of the session, an exclusive test takes it
    exclusively, so the other workers finish their current test and wait. A second file is a turnstile: a
    waiting exclusive test holds it, so tests arriving after it queue behind it instead of starving it."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if session is None:  # one process: nothing runs beside the test
        yield
        return
    base = Path(tempfile.gettempdir()) / f"rapidlite-tests-{session}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        exclusive = request.node.get_closest_marker("exclusive") is not None
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
