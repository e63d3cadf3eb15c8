"""The layering contract: a module imports only from its own layer or the ones below, and no import cycle
exists, counting imports inside functions too. A new module must be given a layer here on purpose."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "rapidlite"

# Top to bottom: a package is a layer (docs/dev/architecture.md draws the same picture). The package itself
# (rapidlite/__init__.py) is the public facade over every layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("api", ("rapidlite",)),
    # the programs, and the Rapidformer/Megatron facade user scripts read (get_args, mpu, GPTModel())
    ("cli and compat", ("rapidlite.cli", "rapidlite.__main__", "rapidlite.compat")),
    ("tasks", ("rapidlite.tasks",)),
    ("trainer", ("rapidlite.trainer",)),
    ("generation", ("rapidlite.generation",)),
    ("engine", ("rapidlite.engine",)),
    ("planning", ("rapidlite.planning",)),
    ("resolve", ("rapidlite.resolve",)),
    ("evaluation", ("rapidlite.evaluation",)),
    ("strategies", ("rapidlite.strategies",)),
    ("checkpoint", ("rapidlite.checkpoint",)),
    ("parallel", ("rapidlite.parallel", "rapidlite.optim", "rapidlite.precision", "rapidlite.graph")),
    ("models", ("rapidlite.models",)),
    ("data", ("rapidlite.data",)),
    ("runtime and observe", ("rapidlite.runtime", "rapidlite.observe")),
    ("config", ("rapidlite.config",)),
    ("errors", ("rapidlite.errors",)),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module → the rapidlite modules it imports (module level, inside functions, under TYPE_CHECKING)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.startswith("rapidlite")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rapidlite"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in mods else resolve(node.module))
        graph[name] = targets - {name, "rapidlite"}
    return graph


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # The facade's name covers only the package itself: a module given no layer must show up.
            if module == prefix or (prefix != "rapidlite" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_no_module_imports_from_a_higher_layer():
    violations = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) < layer_of(module)
    ]
    assert violations == []


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


# Each module imported first, in a fresh set of rapidlite modules: the settings discover the task declarations
# (importlib, which the graph above does not see), so a cycle through them breaks only some import orders.
IMPORT_FIRST = """
import importlib, sys
bad = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "rapidlite" or m.startswith("rapidlite.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(bad))
"""


def test_every_settings_module_imports_first():
    """The torch-free layers (the settings and the tasks' declarations) import in any order."""
    names = sorted(m for m in modules() if layer_of(m) in (_rank("config"), _rank("errors")) or m.endswith("_spec"))
    assert "rapidlite.config.moe" in names and "rapidlite.tasks.pretraining_spec" in names
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_FIRST, *names], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr[-2000:]


def _rank(layer: str) -> int:
    return [name for name, _ in LAYERS].index(layer)


def test_the_contract_sees_a_violation():
    """The checks above are not vacuous: the graph holds real edges, and an upward one would be caught."""
    graph = import_graph()
    assert "rapidlite.engine" in graph["rapidlite.trainer.base"]
    assert layer_of("rapidlite.trainer.base") < layer_of("rapidlite.parallel.pipeline")  # upward if reversed
    assert layer_of("rapidlite.models.gpt") > layer_of("rapidlite.parallel.tensor_parallel")


def test_model_files_import_nothing_from_parallel():
    graph = import_graph()
    assert [(m, t) for m, ts in graph.items() if m.startswith("rapidlite.models") for t in ts if ".parallel" in t] == []
