"""``rapidlite-preprocess``: text → Megatron mmap indexed dataset (Megatron's ``tools/preprocess_data.py``).

Input: JSON lines (``.jsonl``/``.json``/``.ndjson``; one object per line, the text under each of
``--json-keys``) or plain text (``.txt``: documents are blocks separated by blank lines, or one per
line with ``--text-format lines``). A file with another suffix is JSON lines when its first non-blank
line is a JSON object, else text. Blank lines of a JSON-lines file are skipped.

Output, per key: ``{prefix}_{key}_document.bin/.idx`` (each document one sequence) or, with
``--split-sentences``, ``{prefix}_{key}_sentence.bin/.idx`` (each sentence a sequence, grouped into
documents). ``--append-eod`` adds the tokenizer's EOD id to the end of every document (its last sentence).
Documents that tokenize to nothing are skipped, as Megatron does. Token ids are stored as uint16 when
the vocabulary has fewer than 65500 tokens, else int32.

Sentences are split by ``rapidlite.data.documents.SentenceSplitter``, which also reads the input files.

Tokenization runs in a ``multiprocessing`` pool (``--workers``) over chunks of documents in input
order, with at most two windows of documents in flight so memory stays bounded; results are written
in order, so the output is byte-identical for any number of workers. ``--partitions N`` cuts the
documents into N contiguous ranges, processes them one after the other into temporary datasets and
merges those with ``IndexedDatasetBuilder.add_index``: the result equals that of one partition.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rapidlite.data.documents import SentenceSplitter, check_input, detect_format, iter_documents
from rapidlite.data.indexed_dataset import (
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    index_file_path,
)
from rapidlite.data.tokenizers import AbstractTokenizer
from rapidlite.errors import ConfigError, DataError, RapidliteError
from rapidlite.observe.progress import Bar, progress_bar
from rapidlite.runtime.paths import check_writable_dir

CHUNKSIZE = 32


# ------------------------------------------------------------------------------------ tokenization
@dataclass(frozen=True)
class _Job:
    path: str
    fmt: str
    keys: tuple[str, ...]
    split_sentences: bool
    keep_newlines: bool
    append_eod: bool
    lang: str


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: AbstractTokenizer, job: _Job) -> None:
    if multiprocessing.parent_process() is not None:
        # A forked worker inherits its parent's Python handlers (a training's flag-only SIGTERM handler among
        # them): Pool.terminate() must end it, so SIGTERM takes its default action here.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER["tokenizer"], _WORKER["job"] = tokenizer, job
    _WORKER["splitter"] = SentenceSplitter(job.lang, job.keep_newlines) if job.split_sentences else None


def _texts(job: _Job, lineno: int, raw: str) -> list[str]:
    if job.fmt != "jsonl":
        return [raw]
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{job.path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{job.path}:{lineno}: expected a JSON object, got a JSON {type(obj).__name__}")
    texts = []
    for key in job.keys:
        if key not in obj:
            keys = ", ".join(list(obj)[:10]) or "none"
            raise DataError(f"{job.path}:{lineno}: no key {key!r} (keys: {keys}); choose the field with --json-keys")
        if not isinstance(obj[key], str):
            raise DataError(f"{job.path}:{lineno}: {key!r} is a JSON {type(obj[key]).__name__}, not a string")
        texts.append(obj[key])
    return texts


def _encode(item: tuple[int, str]) -> tuple[list[tuple[np.ndarray, list[int]] | None], int]:
    """One document → per key ``(token ids, sequence lengths)`` or None when empty; and its input bytes."""
    lineno, raw = item
    job: _Job = _WORKER["job"]
    tokenizer: AbstractTokenizer = _WORKER["tokenizer"]
    splitter: SentenceSplitter | None = _WORKER["splitter"]
    out: list[tuple[np.ndarray, list[int]] | None] = []
    for text in _texts(job, lineno, raw):
        ids: list[int] = []
        lengths: list[int] = []
        for piece in splitter.split(text) if splitter is not None else [text]:
            try:
                tokens = tokenizer.tokenize(piece)
            except RapidliteError as e:
                raise DataError(f"{job.path}:{lineno}: {e}") from None
            if tokens:
                ids.extend(tokens)
                lengths.append(len(tokens))
        if ids and job.append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        out.append((np.asarray(ids, dtype=np.int64), lengths) if ids else None)
    return out, len(raw.encode("utf-8"))


def _windowed_imap(pool: Any, items: Iterable[tuple[int, str]], window: int) -> Iterator[Any]:
    """``pool.imap(_encode, items)`` in order, with at most two windows of items queued at once."""
    source = iter(items)
    pending: collections.deque = collections.deque()
    while True:
        while len(pending) < 2:
            batch = list(itertools.islice(source, window))
            if not batch:
                break
            pending.append(pool.imap(_encode, batch, CHUNKSIZE))
        if not pending:
            return
        yield from pending.popleft()


class _Progress:
    """A bar over the input's bytes with documents/s beside it on a terminal (``bar``); else a log line every
    ``interval`` documents."""

    def __init__(self, log: Callable[[str], None] | None, interval: int, bar: Bar | None = None) -> None:
        self.log, self.interval, self.bar = log, interval, bar
        self.start = time.perf_counter()
        self.documents = self.bytes = 0

    def update(self, nbytes: int) -> None:
        self.documents += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            if self.documents % 256 == 0:
                elapsed = max(time.perf_counter() - self.start, 1e-9)
                self.bar.set_postfix_str(f"{self.documents} docs, {self.documents / elapsed:.0f} docs/s", refresh=False)
        elif self.log is not None and self.interval > 0 and self.documents % self.interval == 0:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.log(
                f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s)."
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(max(self.bar.total - self.bar.n, 0))  # the input is read whole (blank lines too)
            self.bar.set_postfix_str(f"{self.documents} docs", refresh=False)
            self.bar.close()
            self.bar = None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _remove(prefixes: Iterable[str]) -> None:
    for prefix in prefixes:
        for path in (data_file_path(prefix), index_file_path(prefix)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def preprocess(
    input_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer: AbstractTokenizer,
    json_keys: Sequence[str] = ("text",),
    split_sentences: bool = False,
    append_eod: bool = False,
    workers: int = 1,
    partitions: int = 1,
    keep_newlines: bool = False,
    text_format: str = "auto",
    lang: str = "english",
    log_interval: int = 1000,
    log: Callable[[str], None] | None = _stderr,
    progress: bool = False,
) -> dict[str, str]:
    """Tokenize ``input_path`` into mmap datasets; returns ``{key: output path prefix}``.

    ``log`` receives the progress lines (None: silent); with ``progress`` a bar replaces them when standard error
    is a terminal (``rapidlite.observe.progress``)."""
    path = check_input(input_path)
    keys = tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise ConfigError(f"--json-keys {' '.join(keys)}: give one or more distinct keys")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be at least 1")
    if partitions < 1:
        raise ConfigError(f"--partitions {partitions}: must be at least 1")
    fmt = detect_format(path, text_format)
    if fmt != "jsonl" and len(keys) != 1:
        raise ConfigError(f"--json-keys {' '.join(keys)}: {path} is plain text with one field; give one name")
    if append_eod and tokenizer.eod is None:
        raise ConfigError(
            f"--append-eod: the {getattr(tokenizer, 'name', 'given')} tokenizer has no end-of-document id"
        )

    level = "sentence" if split_sentences else "document"
    prefixes = {key: f"{os.fspath(output_prefix)}_{key}_{level}" for key in keys}
    directory = os.path.dirname(os.fspath(output_prefix))
    check_writable_dir("--output-prefix", directory or ".", "the .bin/.idx files", given=os.fspath(output_prefix))
    if directory:
        os.makedirs(directory, exist_ok=True)
    dtype = best_dtype(tokenizer.vocab_size)
    job = _Job(path, fmt, keys, split_sentences, keep_newlines, append_eod, lang)
    if split_sentences and log is not None:
        log(f"Splitting sentences with {SentenceSplitter(lang, keep_newlines).kind}.")

    if partitions == 1:
        ranges = [(0, None)]
        part_prefixes = [prefixes]
    else:
        count = sum(1 for _ in iter_documents(path, fmt))
        bounds = [count * i // partitions for i in range(partitions + 1)]
        ranges = list(itertools.pairwise(bounds))
        part_prefixes = [{k: f"{p}.part{i}-of-{partitions}" for k, p in prefixes.items()} for i in range(partitions)]
    written = [p for parts in part_prefixes for p in parts.values()]
    tracker = _Progress(log, log_interval)
    stats = {key: {"documents": 0, "sequences": 0, "tokens": 0, "empty": 0} for key in keys}
    pool = None
    try:
        if workers > 1:
            previous = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no fork warning from `tokenizers` in the workers
            try:
                pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer, job))
            finally:
                if previous is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = previous
        else:
            _init_worker(tokenizer, job)
        # After the pool has forked: the workers inherit no bar.
        tracker.bar = progress_bar(
            os.path.getsize(path), desc="tokenizing", bytes_=True, enabled=progress and log is not None
        )
        for (start, stop), targets in zip(ranges, part_prefixes, strict=True):
            builders = {k: IndexedDatasetBuilder(data_file_path(p), dtype=dtype) for k, p in targets.items()}
            items = itertools.islice(iter_documents(path, fmt), start, stop)
            results = map(_encode, items) if pool is None else _windowed_imap(pool, items, CHUNKSIZE * workers * 8)
            for encoded, nbytes in results:
                for key, document in zip(keys, encoded, strict=True):
                    if document is None:
                        stats[key]["empty"] += 1
                        continue
                    builders[key].add_document(*document)
                    stats[key]["documents"] += 1
                    stats[key]["sequences"] += len(document[1])
                    stats[key]["tokens"] += len(document[0])
                tracker.update(nbytes)
            for key, builder in builders.items():
                builder.finalize(index_file_path(targets[key]))
        if not any(n["documents"] for n in stats.values()):  # every document empty: no dataset to write
            empty = max(n["empty"] for n in stats.values())
            raise DataError(f"--input {path}: none of its {empty} documents has text; nothing written")
        if partitions > 1:
            for key, prefix in prefixes.items():
                merged = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
                for targets in part_prefixes:
                    merged.add_index(targets[key])
                merged.finalize(index_file_path(prefix))
            _remove(written)
        tracker.close()
    except BaseException:
        _remove(written + (list(prefixes.values()) if partitions > 1 else []))
        raise
    finally:
        if tracker.bar is not None:
            tracker.bar.close()  # stopped by an error: the message starts on a line of its own
        _WORKER.clear()
        if pool is not None:
            pool.terminate()
            pool.join()

    if log is not None:
        elapsed = time.perf_counter() - tracker.start
        for key, prefix in prefixes.items():
            n = stats[key]
            skipped = f", {n['empty']} empty ones skipped" if n["empty"] else ""
            log(
                f"Wrote {prefix}.bin/.idx: {n['documents']} documents, {n['sequences']} sequences, "
                f"{n['tokens']} tokens{skipped} ({elapsed:.1f}s)."
            )
    return prefixes
