"""MkDocs hooks: the site's home page is README.md, so the repository's first page and the site's are one text;
and every task's page is in the Tasks section, so a new task's page needs no line in ``mkdocs.yml``.

mkdocs reads pages only under ``docs/``; this hook puts the README's Markdown in place of ``docs/index.md``'s
and turns its repository links (``docs/guides/x.md``) into site links (``guides/x.md``), which strict mode
then checks like any other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = "README.md"
TASKS_SECTION, TASKS_DIR = "Tasks", "tasks"


def readme_as_home_page(readme: str) -> str:
    """The README's Markdown with links into ``docs/`` made relative to the docs directory."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Serve README.md as ``index.md``; every other page is left as it is."""
    if page.file.src_uri != "index.md":
        return markdown
    root = Path(config.config_file_path).parent
    return readme_as_home_page((root / README).read_text(encoding="utf-8"))


def with_every_task_page(nav: list[Any], pages: list[str]) -> list[Any]:
    """``nav`` with the ``pages`` (``tasks/x.md``) its Tasks section does not list appended to it, in name order."""
    for entry in nav:
        if isinstance(entry, dict) and TASKS_SECTION in entry:
            listed = entry[TASKS_SECTION]
            listed += sorted(page for page in pages if page not in listed)
    return nav


def on_config(config: Any) -> Any:
    """Every page of ``docs/tasks/`` in the Tasks section: those ``mkdocs.yml`` lists in its order, then the rest."""
    docs = Path(config.docs_dir)
    pages = [path.relative_to(docs).as_posix() for path in (docs / TASKS_DIR).glob("*.md")]
    with_every_task_page(config.nav or [], pages)
    return config
