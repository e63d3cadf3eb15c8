"""The docs are a site that builds, and every command in them is run somewhere or says why not.

``mkdocs build --strict`` fails on a broken link or a page missing from the nav. Every fenced ``bash``, ``sh``,
``console`` and ``python`` block of README.md and docs/ carries a comment on the line above it:

- ``<!-- run here -->`` (or ``<!-- run here: exit 2 -->``): cheap, so this test runs it and checks its exit code;
- ``<!-- tested: tests/test_x.py::test_name -->``: an existing test runs it; the function must exist, and every
  ``--flag`` of a command must appear in that test file (or in tests/helpers.py, which builds most commands);
- ``<!-- not run here: why -->``: it needs what a test machine lacks (the hub, a GPU, a cluster, ...).

The flags reference is generated: the committed page must equal what the generator prints.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO

CHECKED_LANGUAGES = {"bash", "sh", "console", "python"}
MARK = re.compile(r"^<!--\s*(run here|tested|not run here)\s*(?::\s*(.*?))?\s*-->$")
TESTED = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
FLAGS_PAGE = REPO / "docs" / "reference" / "flags.md"


@dataclass
class Block:
    """One fenced code block: where it is, its language, the comment above it and its text."""

    path: Path
    line: int
    language: str
    mark: str | None
    detail: str
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} ({self.language})"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, with the comment on the nearest non-blank line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})(\w*)", lines[i])
        if not opening:
            i += 1
            continue
        # An unclosed fence runs to the end of the file, as Markdown renders it.
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(opening.group(1))), len(lines))
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(above)
        found.append(
            Block(
                path=path,
                line=i + 1,
                language=opening.group(2),
                mark=mark.group(1) if mark else None,
                detail=(mark.group(2) or "") if mark else "",
                code="\n".join(lines[i + 1 : end]),
            )
        )
        i = end + 1
    return found


def checked_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path) if b.language in CHECKED_LANGUAGES]


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs not installed (it comes with the [test] and [docs] extras)")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Black box, white box, or your own loop" in home, "the home page is not the README"


def test_every_task_page_is_in_the_tasks_section():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    nav = [{"Home": "index.md"}, {"Tasks": ["tasks/b.md", "tasks/a.md"]}]
    assert hooks.with_every_task_page(nav, ["tasks/c.md", "tasks/a.md", "tasks/0.md"])[1] == {
        "Tasks": ["tasks/b.md", "tasks/a.md", "tasks/0.md", "tasks/c.md"]
    }


def test_every_command_block_is_run_or_says_why_not():
    unmarked = [str(b) for b in checked_blocks() if b.mark is None]
    assert unmarked == [], "add <!-- run here -->, <!-- tested: tests/x.py::test_y --> or <!-- not run here: why -->"
    no_reason = [str(b) for b in checked_blocks() if b.mark == "not run here" and not b.detail]
    assert no_reason == []


def test_tested_blocks_name_tests_that_exist_and_use_their_flags():
    problems = []
    helpers = (REPO / "tests" / "helpers.py").read_text()
    for block in checked_blocks():
        if block.mark != "tested":
            continue
        named = TESTED.findall(block.detail)
        if not named:
            problems.append(f"{block}: name the test as tests/test_x.py::test_name")
        sources = []
        for file, function in named:
            source = (REPO / file).read_text() if (REPO / file).is_file() else ""
            if not re.search(rf"^(async )?def {function}\(", source, re.M):
                problems.append(f"{block}: {file}::{function} does not exist")
            sources.append(source)
        if block.language != "python":
            text = "\n".join(sources) + helpers
            problems += [
                f"{block}: {flag} is not in {block.detail}" for flag in FLAG.findall(block.code) if flag not in text
            ]
    assert problems == []


RUN_HERE = [b for b in checked_blocks() if b.mark == "run here"]


@pytest.mark.parametrize("block", RUN_HERE, ids=[str(b) for b in RUN_HERE])
def test_cheap_blocks_run(block, tmp_path):
    expected = int(re.search(r"exit (\d+)", block.detail).group(1)) if "exit" in block.detail else 0
    command = [sys.executable, "-c", block.code] if block.language == "python" else ["bash", "-ec", block.code]
    # The console scripts (rapidlite, rapidlite-eval) next to this Python, run on this checkout's package.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "RAPIDLITE_NO_PROGRESS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == expected, (proc.stdout[-2000:], proc.stderr[-2000:])


def test_the_flags_page_is_generated_from_the_parser():
    from rapidlite.cli.reference import render
    from rapidlite.config.parser import build_parser

    assert FLAGS_PAGE.read_text(encoding="utf-8") == render(build_parser()), (
        "docs/reference/flags.md is stale: python -m rapidlite.cli.reference > docs/reference/flags.md"
    )
