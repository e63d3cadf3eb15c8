"""Masked-LM data for ``--task masked_lm``: raw text turned into token blocks, and the masks drawn over them.

* :func:`text_column` finds the text column (``text``, the only text column, or ``--text-keys``);
* :func:`build_masked_lm_data` tokenizes every split and either concatenates the documents into blocks of
  ``seq_length`` tokens (as Hugging Face's ``run_mlm`` groups texts: every document keeps its ``[CLS]``/``[SEP]``
  and a block may span documents; the last, shorter block of each 1,000-document chunk is kept rather than
  dropped) or, ``line_by_line``, makes each document one sample cut at ``seq_length``;
* :class:`MaskedLMCollator` pads blocks into batches that carry what masking needs (which tokens may be
  predicted, word ids for whole-word masking, the samples' indices);
* :func:`draw_masks` and :func:`mask_tokens` choose the predicted tokens with ``DataCollatorForLanguageModeling``'s
  semantics (each token with probability ``mlm_probability``; of those 80% become ``[MASK]``, 10% a random token
  of the vocabulary, 10% stay; labels -100 elsewhere), or with whole-word masking every token of a chosen word
  (a word chosen with that probability at its first token), as Google's BERT and transformers 4 did it (the
  80/10/10 split then per token).

The random draws of a sample depend only on the seed, the sample's index and a stream (the training epoch, or
the fixed evaluation stream): the masks do not depend on how samples are batched, on the data-parallel layout or
on the loader's workers, so two ranks train on the masks one process draws, a resumed run on the uninterrupted
run's, and every evaluation of a model scores the same masks. (``DataCollatorForLanguageModeling`` draws from one
generator per collator, batch after batch, so its masks change with the batching.)

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line naming the flag
or file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rapidlite.data.tabular import SPLIT_ORDER, _short_reason, load_raw_datasets
from rapidlite.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets
    import torch

TEXT_NAMES: tuple[str, ...] = ("text", "content", "document", "sentence", "body")
IGNORE_INDEX = -100
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # of the predicted tokens; the rest stay as they are
CHUNK = 1000  # documents tokenized (and grouped) together, as datasets.map batches them
EVAL_STREAM = 0  # the random stream of evaluation masks; training epochs use streams (1, epoch)


TEXT_EXTENSIONS: tuple[str, ...] = ("txt",)


def read_text_lines(path: str) -> datasets.Dataset:
    """A plain text file as rows ``{"text": line}``, one document per line (``datasets``' text builder, so a
    large corpus is memory-mapped, not held in Python strings)."""
    import datasets

    try:
        return datasets.load_dataset("text", data_files={"train": path}, split="train")
    except Exception as e:  # the builder wraps the reader's error (a UnicodeDecodeError, ...) in its own type
        raise DataError(
            f"{path}: cannot be read as text, one document per line ({_short_reason(e, root=True)}); give UTF-8 text"
        ) from None


def load_text_datasets(
    data_path: str,
    data_name: str | None = None,
    data_dir: str | None = None,
    split: str = "969,30,1",
    seed: int = 1234,
    eval_only: bool = False,
) -> datasets.DatasetDict:
    """``--data-path`` as a DatasetDict: what ``load_raw_datasets`` reads, plus ``.txt`` files (one document per
    line, column ``text``)."""
    return load_raw_datasets(
        data_path,
        data_name,
        data_dir,
        split,
        seed,
        readers=dict.fromkeys(TEXT_EXTENSIONS, read_text_lines),
        eval_only=eval_only,
    )


def text_column(dataset: datasets.Dataset, text_keys: Sequence[str] | None = None) -> str:
    """The column holding the raw text: ``--text-keys`` (one column), else ``text``-like names, else the only
    string column."""
    import datasets

    columns = list(dataset.column_names)
    available = ", ".join(columns)
    if text_keys:
        if len(text_keys) != 1:
            raise DataError(f"--text-keys {' '.join(text_keys)}: masked_lm reads one text column; name one")
        column = text_keys[0]
        if column not in columns:
            raise DataError(f"--text-keys {column}: no such column (available: {available})")
    else:
        found = next((c for c in TEXT_NAMES if c in columns), None)
        strings = [
            c
            for c in columns
            if isinstance(dataset.features[c], datasets.Value)
            and dataset.features[c].dtype in ("string", "large_string")
        ]
        if found is None and len(strings) != 1:
            raise DataError(
                f"--text-keys: no text column found (tried {', '.join(TEXT_NAMES)}; available: {available}); "
                "name it with --text-keys"
            )
        column = found or strings[0]
    feature = dataset.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")):
        raise DataError(
            f"--text-keys {column}: the column holds {_describe(feature)}, not text; name the text column with "
            "--text-keys"
        )
    return column


def _describe(feature: Any) -> str:
    dtype = getattr(feature, "dtype", None)
    return dtype if isinstance(dtype, str) else type(feature).__name__


@dataclass
class MaskedLMData:
    """Tokenized splits (rows: ``input_ids``, ``special_tokens_mask``, and ``word_ids`` for whole-word
    masking) and what was made of the text."""

    train: Any
    validation: Any | None
    test: Any | None
    text_key: str
    documents: int  # non-empty documents over all splits
    empty: int  # empty rows skipped
    tokens: int
    truncated: int  # line-by-line documents cut at seq_length


def _nonempty(batch: dict[str, list], column: str) -> list[bool]:
    return [value is not None and bool(str(value).strip()) for value in batch[column]]


def _word_ids(encoding: Any, i: int, first: int) -> tuple[list[int], int]:
    """Word ids of document ``i`` numbered on from ``first`` (-1 for special tokens) and the next free id."""
    words = encoding.word_ids(i)
    top = max((w for w in words if w is not None), default=-1)
    return [-1 if w is None else first + w for w in words], first + top + 1


def _relative(word_ids: list[int]) -> list[int]:
    """Word ids renumbered from 0 within a block (they index a per-block table when words are chosen)."""
    base = min((w for w in word_ids if w >= 0), default=0)
    return [w - base if w >= 0 else -1 for w in word_ids]


def _cut(row: list[int], special: list[int], length: int) -> list[int]:
    """``row`` cut to ``length`` tokens keeping its closing special token (``[SEP]``), as truncation does."""
    if len(row) <= length:
        return row
    return row[: length - 1] + row[-1:] if special[-1] else row[:length]


def _tokenize_and_group(
    batch: dict[str, list], tokenizer: Any, column: str, seq_length: int, line_by_line: bool, words: bool
) -> dict[str, list]:
    texts = [str(t) for t in batch[column]]
    enc = tokenizer(
        texts,
        return_special_tokens_mask=True,
        return_token_type_ids=False,
        return_attention_mask=False,
        verbose=False,  # documents may be longer than the model: they are cut below
    )
    keys = ["input_ids", "special_tokens_mask"]
    rows: dict[str, list] = {k: list(enc[k]) for k in keys}
    if words:
        rows["word_ids"], first = [], 0
        for i in range(len(texts)):
            ids, first = _word_ids(enc, i, first)
            rows["word_ids"].append(ids)
        keys.append("word_ids")
    if line_by_line:
        specials = rows["special_tokens_mask"]
        out = {k: [_cut(r, m, seq_length) for r, m in zip(rows[k], specials, strict=True)] for k in keys}
        if words:
            out["word_ids"] = [_relative(w) for w in out["word_ids"]]
        out["cut"] = [len(r) > seq_length for r in rows["input_ids"]]
        return out
    # run_mlm's group_texts: concatenate, then cut into blocks (the last, shorter block kept).
    concatenated = {k: [x for row in rows[k] for x in row] for k in keys}
    total = len(concatenated["input_ids"])
    blocks = {k: [v[i : i + seq_length] for i in range(0, total, seq_length)] for k, v in concatenated.items()}
    if words:
        blocks["word_ids"] = [_relative(w) for w in blocks["word_ids"]]
    return blocks


def build_masked_lm_data(
    raw: datasets.DatasetDict,
    tokenizer: Any,
    seq_length: int,
    text_keys: Sequence[str] | None = None,
    line_by_line: bool = False,
    whole_word_masking: bool = False,
    num_proc: int | None = None,
) -> MaskedLMData:
    """Tokenize every split of ``raw`` (grouped into blocks, or one sample per document ``line_by_line``);
    empty rows are skipped and counted. Nothing is cached on disk."""
    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    if tokenizer.mask_token_id is None:
        raise ConfigError(
            "--pretrained-model-name-or-path: the tokenizer has no mask token; masked_lm needs a masked language "
            "model's tokenizer (BERT, RoBERTa, ...)"
        )
    if whole_word_masking and not getattr(tokenizer, "is_fast", False):
        raise ConfigError("--whole-word-masking needs a fast tokenizer (its word ids); this model's tokenizer is slow")
    if seq_length < 3:
        raise ConfigError(f"--seq-length {seq_length}: too short for masked LM; use at least 3 tokens")
    splits = {name: raw[name] for name in SPLIT_ORDER if name in raw}
    column = text_column(splits["train"], text_keys)
    out: dict[str, Any] = {"train": None, "validation": None, "test": None}
    documents = empty = tokens = truncated = 0
    for name, ds in splits.items():
        if column not in ds.column_names:
            raise DataError(
                f"--data-path: the {name} split lacks the text column {column} that train has (it has: "
                f"{', '.join(ds.column_names)}); make the files' columns consistent"
            )
        kept = ds.filter(
            _nonempty, batched=True, fn_kwargs={"column": column}, keep_in_memory=True, load_from_cache_file=False
        )
        if len(kept) == 0:
            raise DataError(
                f"--data-path: the {name} split has no text (its {len(ds)} {column} values are empty); "
                "add text or name another column with --text-keys"
            )
        documents, empty = documents + len(kept), empty + len(ds) - len(kept)
        tokenized = kept.map(
            _tokenize_and_group,
            batched=True,
            batch_size=CHUNK,
            remove_columns=kept.column_names,
            fn_kwargs={
                "tokenizer": tokenizer,
                "column": column,
                "seq_length": seq_length,
                "line_by_line": line_by_line,
                "words": whole_word_masking,
            },
            num_proc=num_proc,
            keep_in_memory=True,  # nothing written next to the user's data or into a stale cache
            load_from_cache_file=False,
            desc=f"Tokenizing {name}",
        )
        if line_by_line:
            truncated += sum(tokenized["cut"])
            tokenized = tokenized.remove_columns("cut")
        out[name] = tokenized
        tokens += _token_count(tokenized)
    return MaskedLMData(
        IndexedRows(out["train"]),
        IndexedRows(out["validation"]) if out["validation"] is not None else None,
        IndexedRows(out["test"]) if out["test"] is not None else None,
        column,
        documents,
        empty,
        tokens,
        truncated,
    )


def _token_count(ds: datasets.Dataset) -> int:
    import pyarrow.compute as pc

    # The Arrow column, not Python lists: a corpus's ids are never copied out (a fresh map has no index mapping).
    return int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0)


class IndexedRows:
    """A tokenized split whose rows carry their position (``index``), the key of their masks' random draws."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.rows[int(index)], "index": int(index)}

    # What ``--group-by-length`` measures the samples by (``rapidlite.data.samplers.sample_lengths`` reads the
    # Arrow column of a ``datasets.Dataset``): the rows' own.
    @property
    def column_names(self) -> list[str]:
        return list(self.rows.column_names)

    def with_format(self, *args: Any, **kwargs: Any) -> Any:
        return self.rows.with_format(*args, **kwargs)


class MaskedLMCollator:
    """Right-pads rows into ``input_ids``/``attention_mask`` and what masking needs: ``maskable`` (real,
    non-special tokens), ``word_ids`` (-1: special or padding) when the rows have them, and ``index`` (a list
    of the samples' dataset indices, kept on the host). A class, so loader workers can pickle it."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        length = max(len(r["input_ids"]) for r in rows)
        size = (len(rows), length)
        batch: dict[str, Any] = {
            "input_ids": torch.full(size, self.pad_token_id, dtype=torch.int64),
            "attention_mask": torch.zeros(size, dtype=torch.int64),
            "maskable": torch.zeros(size, dtype=torch.bool),
        }
        words = "word_ids" in rows[0]
        if words:
            batch["word_ids"] = torch.full(size, -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            batch["input_ids"][i, :n] = torch.tensor(r["input_ids"], dtype=torch.int64)
            batch["attention_mask"][i, :n] = 1
            batch["maskable"][i, :n] = torch.tensor(r["special_tokens_mask"], dtype=torch.bool).logical_not()
            if words:
                batch["word_ids"][i, :n] = torch.tensor(r["word_ids"], dtype=torch.int64)
        batch["index"] = [int(r["index"]) for r in rows]
        return batch


@dataclass
class MaskDraws:
    """Uniform draws deciding which tokens are predicted (``select``) and what they become (``action``), and
    the random token each could become (``random_ids``), all ``[batch, length]``."""

    select: torch.Tensor
    action: torch.Tensor
    random_ids: torch.Tensor

    def to(self, device: torch.device) -> MaskDraws:
        return MaskDraws(self.select.to(device), self.action.to(device), self.random_ids.to(device))


def draw_masks(
    indices: Sequence[int], length: int, seq_length: int, vocab_size: int, seed: int, stream: Sequence[int]
) -> MaskDraws:
    """The draws of the samples ``indices`` (a batch padded to ``length``): sample ``i``'s come from a generator
    seeded by ``(seed, *stream, i)`` and cover ``seq_length`` positions whatever the padding, so a sample's
    masks are the same in any batch."""
    import torch

    select = np.empty((len(indices), seq_length), dtype=np.float32)
    action = np.empty((len(indices), seq_length), dtype=np.float32)
    random_ids = np.empty((len(indices), seq_length), dtype=np.int64)
    for row, index in enumerate(indices):
        rng = np.random.default_rng([int(seed), *map(int, stream), int(index)])
        select[row] = rng.random(seq_length, dtype=np.float32)
        action[row] = rng.random(seq_length, dtype=np.float32)
        random_ids[row] = rng.integers(0, vocab_size, seq_length)
    if length > seq_length:
        raise ValueError(f"a batch of {length} tokens is longer than the draws' {seq_length}")
    return MaskDraws(*(torch.from_numpy(a[:, :length]) for a in (select, action, random_ids)))


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    draws: MaskDraws,
    mask_token_id: int,
    mlm_probability: float,
    word_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``: the tokens chosen by ``draws`` (whole words when ``word_ids`` is given) are the
    labels, and in the inputs 80% of them become ``mask_token_id``, 10% a random token, 10% stay."""
    import torch

    chance = draws.select < mlm_probability
    if word_ids is None:
        chosen = maskable & chance
    else:
        in_word = maskable & (word_ids >= 0)
        previous = torch.nn.functional.pad(word_ids[:, :-1], (1, 0), value=-1)
        starts = in_word & (word_ids != previous) & chance
        length = word_ids.shape[1]
        # A per-row table of chosen words (ids are < length within a block; slot `length` takes the rest).
        table = torch.zeros((word_ids.shape[0], length + 1), dtype=torch.bool, device=word_ids.device)
        table.scatter_(1, torch.where(starts, word_ids, length), True)
        table[:, length] = False
        chosen = in_word & table.gather(1, word_ids.clamp(min=0))
    labels = torch.where(chosen, input_ids, IGNORE_INDEX)
    to_mask = chosen & (draws.action < MASK_SHARE)
    to_random = chosen & (draws.action >= MASK_SHARE) & (draws.action < MASK_SHARE + RANDOM_SHARE)
    inputs = torch.where(to_mask, mask_token_id, input_ids)
    inputs = torch.where(to_random, draws.random_ids, inputs)
    return inputs, labels
