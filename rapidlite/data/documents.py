"""The documents ``rapidlite-preprocess`` reads: the input's format (JSON lines or plain text), its documents in
order, and their sentences.

Sentences are split by nltk's punkt model when nltk and its data are installed (nothing is
downloaded), else by a built-in rule: a sentence ends at ``.``/``!``/``?`` (and closing quotes or
brackets) followed by whitespace and a capital letter, unless the word before the period is a single
letter or a common abbreviation (Mr., Dr., ...). Which one is used is printed. Without
``--keep-newlines`` the whitespace between sentences is dropped; with it, each sentence keeps the
whitespace (newlines included) that follows it, so the sentences concatenate back to the document.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from rapidlite.errors import ConfigError, DataError

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
TEXT_FORMATS = ("auto", "jsonl", "paragraphs", "lines")

_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs fig figs inc ltd co corp mt gen col lt sgt capt rev hon messrs approx dept".split()
)


class SentenceSplitter:
    """Cuts a text into sentences with nltk punkt when available offline, else with a regex rule."""

    _BOUNDARY = re.compile(
        r"(?P<word>\w*)(?P<end>[.!?]+[\"')\]\u2019\u201d]*)(?P<space>\s+)(?=[\"'(\[\u2018\u201c]?\w)"
    )

    def __init__(self, lang: str = "english", keep_newlines: bool = False) -> None:
        self.lang, self.keep_newlines = lang, keep_newlines
        self._punkt = _load_punkt(lang)
        self.kind = f"nltk punkt ({lang})" if self._punkt is not None else "the built-in regex rule"

    def _regex_spans(self, text: str) -> list[tuple[int, int]]:
        start, end = len(text) - len(text.lstrip()), len(text.rstrip())
        if start >= end:
            return []
        spans = []
        for m in self._BOUNDARY.finditer(text, start, end):
            following = text[m.end() : m.end() + 8].lstrip("\"'([\u2018\u201c")[:1]
            if not following.isupper():
                continue
            word, end_mark = m.group("word"), m.group("end")
            if end_mark.startswith(".") and len(end_mark.rstrip("\"')]\u2019\u201d")) == 1:
                if len(word) == 1 and word.isalpha() or word.lower() in _ABBREVIATIONS:
                    continue
            spans.append((start, m.start("space")))
            start = m.end()
        spans.append((start, end))
        return spans

    def split(self, text: str) -> list[str]:
        """The sentences of ``text`` (whitespace-only pieces dropped)."""
        if self._punkt is not None:
            spans = list(self._punkt.span_tokenize(text))
        else:
            spans = self._regex_spans(text)
        if self.keep_newlines:
            starts = [s for s, _ in spans] + [len(text)]
            pieces = [text[a:b] for a, b in itertools.pairwise(starts)]
        else:
            pieces = [text[a:b] for a, b in spans]
        return [p for p in pieces if p.strip()]


def _load_punkt(lang: str) -> Any:
    """nltk's punkt sentence tokenizer if nltk and its data are installed; never downloads."""
    try:
        import nltk  # noqa: F401
    except ImportError:
        return None
    try:
        from nltk.tokenize import PunktTokenizer

        return PunktTokenizer(lang)
    except Exception:
        pass
    try:
        import nltk.data

        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except Exception:
        return None


def check_input(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"--input {path}: no such file")
    if not os.path.isfile(path):
        raise DataError(f"--input {path}: not a file (give one JSON-lines or text file)")
    with open(path, "rb") as f:  # up to the first byte that is not white space
        while (chunk := f.read(1 << 16)) and not chunk.strip():
            pass
    if not chunk.strip():
        raise DataError(f"--input {path}: the file is empty; nothing to preprocess (nothing written)")
    return path


def detect_format(path: str, text_format: str = "auto") -> str:
    """``jsonl``, ``paragraphs`` or ``lines`` for ``path`` (see the module docstring for ``auto``)."""
    if text_format not in TEXT_FORMATS:
        raise ConfigError(f"--text-format {text_format}: choose one of {', '.join(TEXT_FORMATS)}")
    if text_format != "auto":
        return text_format
    lower = path.lower()
    if lower.endswith(JSON_SUFFIXES):
        return "jsonl"
    if lower.endswith(TEXT_SUFFIXES):
        return "paragraphs"
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        return "jsonl" if isinstance(json.loads(first), dict) else "paragraphs"
    except (ValueError, UnicodeDecodeError):
        return "paragraphs"


def iter_documents(path: str, fmt: str) -> Iterator[tuple[int, str]]:
    """``(line number, raw item)``: a JSON line, or the text of one document."""
    lineno = 0
    try:
        with open(path, encoding="utf-8") as f:
            if fmt == "paragraphs":
                block: list[str] = []
                first = 0
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        if not block:
                            first = lineno
                        block.append(line)
                    elif block:
                        yield first, "".join(block).rstrip("\n")
                        block = []
                if block:
                    yield first, "".join(block).rstrip("\n")
            else:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield lineno, (line if fmt == "jsonl" else line.rstrip("\n"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason}); convert the file to UTF-8") from None
