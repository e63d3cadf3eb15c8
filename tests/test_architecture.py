"""The shape figures docs/dev/architecture.md states, measured on the source, so they stay true.

Each figure is measured the way the page says; a change that moves one past its target fails here with the
places that did it.
"""

from __future__ import annotations

import ast
import re

from helpers import REPO

PACKAGE = REPO / "rapidlite"
# Names under which code holds the run's settings (``config`` is a model's Hugging Face config here).
SETTINGS_NAMES = {"args", "cfg", "settings", "namespace"}
# What the resolved settings offer besides the flat flag view: reading these is not reading the Namespace.
NOT_FLAGS = {"sections", "given", "notices", "deepspeed_notices"}
# Separate programs with their own small parsers (rapidlite-preprocess, rapidlite-eval, rapidlite-bench peak,
# rapidlite env, rapidlite plot): their ``args`` is their own command line, not the run's settings.
OWN_COMMAND_LINES = {
    "rapidlite/cli/preprocess.py",
    "rapidlite/cli/evaluate.py",
    "rapidlite/cli/bench.py",
    "rapidlite/cli/env.py",
    "rapidlite/observe/curves.py",
}


def sources() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(REPO)): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))
    }


def _holds_settings(node: ast.expr) -> bool:
    """``args``, ``self.args``, ``engine.args``, ``get_args()``."""
    if isinstance(node, ast.Name):
        return node.id == "args"
    if isinstance(node, ast.Attribute):
        return node.attr == "args"
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_args"


def namespace_readers() -> dict[str, int]:
    """Modules that read the flat settings namespace (``args.micro_batch_size``), with how many reads."""
    found: dict[str, int] = {}
    for name, tree in sources().items():
        if name in OWN_COMMAND_LINES:
            continue
        reads = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _holds_settings(node.value) and node.attr not in NOT_FLAGS
        ]
        if reads:
            found[name] = len(reads)
    return found


def settings_guards() -> list[str]:
    """``getattr(args, "name", default)`` on the run's settings: a guard for a value that may be missing."""
    found = []
    for name, tree in sources().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) == 3
                and isinstance(node.args[1], ast.Constant)
                and _holds_settings(node.args[0])
            ):
                found.append(f"{name}:{node.lineno}")
    return found


def any_settings_parameters() -> list[str]:
    """Parameters that hold settings and are typed ``Any``."""
    found = []
    for name, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    annotation = arg.annotation
                    if arg.arg in SETTINGS_NAMES and isinstance(annotation, ast.Name) and annotation.id == "Any":
                        found.append(f"{name}:{node.lineno} {node.name}({arg.arg})")
    return found


def long_modules(limit: int = 500) -> dict[str, int]:
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    return {name: n for name, n in sorted(lengths.items()) if n > limit}


# A task compared by its name: ``task == "causal_lm"``, ``args.task != 'pretraining'``, ``task in ("a", "b")``.
TASK_NAME_COMPARISON = r"\btask\s*(==|!=)\s*[\"']|\btask\s+in\s*\(\s*[\"']"


def task_name_comparisons() -> list[str]:
    """Code that asks which task runs by its name instead of asking its TaskSpec."""
    pattern = re.compile(TASK_NAME_COMPARISON)
    return [
        f"{path.relative_to(REPO)}:{i}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_getattr_guards_on_the_settings():
    assert settings_guards() == []


def test_settings_parameters_are_typed():
    assert len(any_settings_parameters()) <= 10, any_settings_parameters()


def test_few_modules_read_the_namespace():
    assert len(namespace_readers()) <= 8, namespace_readers()


def test_no_module_over_500_lines():
    assert long_modules() == {}


def test_the_training_loop_reads_in_one_screen():
    """``trainer/base.py``, the loop every trainer shares, stays at most 350 lines (what it calls lives beside it)."""
    lines = len((PACKAGE / "trainer" / "base.py").read_text().splitlines())
    assert lines <= 350, f"trainer/base.py has {lines} lines"


def test_no_task_is_recognised_by_its_name():
    assert task_name_comparisons() == []


def test_the_measures_see_what_they_measure(tmp_path):
    """The measures are not vacuous: each finds its pattern in a module written for the purpose."""
    tree = ast.parse('def f(args: Any):\n    return getattr(args, "lr", 1.0) + args.micro_batch_size\n')
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    assert _holds_settings(call.args[0]) and isinstance(call.args[1], ast.Constant)
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _holds_settings(n.value)]
    assert [r.attr for r in reads] == ["micro_batch_size"]
    assert re.search(TASK_NAME_COMPARISON, 'if args.task == "causal_lm":')
    assert re.search(TASK_NAME_COMPARISON, "if task in ('pretraining', 'causal_lm'):")
    assert not re.search(TASK_NAME_COMPARISON, "if task == MULTIPLE_CHOICE:")  # rapidlite-eval's own item kinds
    assert namespace_readers()  # the command line and resolve read the namespace on purpose


def root_modules() -> list[str]:
    """The modules at the package root, besides the layer packages."""
    return sorted(path.name for path in PACKAGE.glob("*.py"))


def logic_in_package_inits() -> list[str]:
    """``__init__.py`` files that define something instead of handing names on."""
    return [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("__init__.py"))
        if path.parent != PACKAGE  # the facade's lazy ``__getattr__`` keeps ``import rapidlite`` free of torch
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]


def test_the_package_root_holds_few_modules():
    assert len(root_modules()) - 1 <= 8, root_modules()  # besides __init__.py


def test_package_inits_only_hand_names_on():
    assert logic_in_package_inits() == []
