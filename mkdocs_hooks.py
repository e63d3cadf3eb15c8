"""MkDocs hook: the site's home page is README.md, so the repository's first page and the site's are one text.

mkdocs reads pages only under ``docs/``; this hook puts the README's Markdown in place of ``docs/index.md``'s
and turns its repository links (``docs/guides/x.md``) into site links (``guides/x.md``), which strict mode
then checks like any other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = "README.md"


def readme_as_home_page(readme: str) -> str:
    """The README's Markdown with links into ``docs/`` made relative to the docs directory."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Serve README.md as ``index.md``; every other page is left as it is."""
    if page.file.src_uri != "index.md":
        return markdown
    root = Path(config.config_file_path).parent
    return readme_as_home_page((root / README).read_text(encoding="utf-8"))
