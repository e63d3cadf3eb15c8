"""Data for ``--task seq2seq``: source/target text pairs (summaries, translations) turned into token ids.

Two layouts, as Hugging Face's ``run_summarization``/``run_translation`` read them:

* a source column and a target column: detected by name (``document``/``summary``, ``article``/``highlights``,
  ``text``/``summary``, ``source``/``target``, ... see ``COLUMN_PAIRS``), or named with ``--text-keys SOURCE
  --label-key TARGET``; columns named by language codes (``en``, ``de``) are a pair too with
  ``--source-lang``/``--target-lang``;
* translation pairs: a ``translation`` column of ``{"en": ..., "de": ...}`` (the WMT/OPUS layout), read in the
  direction ``--source-lang``/``--target-lang``.

``build_seq2seq_data`` checks every row of every split (a missing column, or an empty source or target, is one
line naming the split and quoting the pair's other text), prepends ``--source-prefix``, cuts sources at
``--seq-length`` and targets at ``--max-target-length`` tokens (``tokenizer(text_target=...)``, so multilingual
tokenizers use their target side), and returns data sets of ``{"input_ids", "attention_mask", "labels"}``;
rapidlite's ``PadCollator`` pads labels with -100, so padding is never trained or scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapidlite.data.tabular import SPLIT_ORDER
from rapidlite.errors import DataError

TRANSLATION_COLUMN = "translation"
# (source, target) column names of the common public data sets, in the order they are tried.
COLUMN_PAIRS: tuple[tuple[str, str], ...] = (
    ("document", "summary"),  # XSum, Multi-News
    ("article", "highlights"),  # CNN/DailyMail
    ("dialogue", "summary"),  # SAMSum
    ("text", "summary"),  # BillSum, OrangeSum
    ("article", "summary"),
    ("article", "abstract"),  # arXiv/PubMed
    ("description", "abstract"),  # BigPatent
    ("source", "target"),
    ("src", "tgt"),
)


@dataclass(frozen=True)
class Seq2SeqColumns:
    """Where a row's source and target are: two columns, or two languages of the ``translation`` column
    (``translation`` True)."""

    source: str
    target: str
    translation: bool = False

    def describe(self) -> str:
        if self.translation:
            return f"translation pairs {self.source} -> {self.target}"
        return f"columns {self.source} -> {self.target}"

    def pair(self, row: dict[str, Any]) -> tuple[Any, Any]:
        if self.translation:
            pairs = row.get(TRANSLATION_COLUMN) or {}
            return pairs.get(self.source), pairs.get(self.target)
        return row.get(self.source), row.get(self.target)


def _languages(dataset: Any) -> list[str]:
    """The language codes of a ``translation`` column (a struct of strings, or datasets' ``Translation``)."""
    feature = dataset.features[TRANSLATION_COLUMN]
    languages = getattr(feature, "languages", None)
    if languages is None and isinstance(feature, dict):
        languages = list(feature)
    return sorted(languages or [])


def detect_columns(
    dataset: Any,
    text_keys: list[str] | None = None,
    label_key: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> Seq2SeqColumns:
    """The source and target of ``dataset``'s rows (see the module docstring), or one line saying which flags
    name them."""
    columns = list(dataset.column_names)
    available = ", ".join(columns)
    if text_keys or label_key:
        if not (text_keys and label_key):
            raise DataError(
                "--text-keys/--label-key: name both the source column (--text-keys) and the target column "
                f"(--label-key); the data has {available}"
            )
        if len(text_keys) > 1:
            raise DataError(f"--text-keys {' '.join(text_keys)}: --task seq2seq reads one source column; name one")
        missing = [c for c in (text_keys[0], label_key) if c not in columns]
        if missing:
            raise DataError(f"--text-keys/--label-key: no column {', '.join(missing)} (available: {available})")
        if text_keys[0] == label_key:
            raise DataError(f"--text-keys/--label-key: both name {label_key}; the target must be another column")
        return Seq2SeqColumns(text_keys[0], label_key)
    if source_lang or target_lang:
        if not (source_lang and target_lang):
            raise DataError("--source-lang/--target-lang: give both (the direction of the translation)")
        if TRANSLATION_COLUMN in columns:
            languages = _languages(dataset)
            missing = [lang for lang in (source_lang, target_lang) if lang not in languages]
            if missing:
                raise DataError(
                    f"--source-lang/--target-lang: the translation pairs have no language {', '.join(missing)} "
                    f"(they have {', '.join(languages)})"
                )
            return Seq2SeqColumns(source_lang, target_lang, translation=True)
        if source_lang in columns and target_lang in columns:
            return Seq2SeqColumns(source_lang, target_lang)
        raise DataError(
            f"--source-lang {source_lang} --target-lang {target_lang}: the data has neither a translation column "
            f"nor columns named {source_lang} and {target_lang} (available: {available})"
        )
    if TRANSLATION_COLUMN in columns:
        languages = _languages(dataset)
        raise DataError(
            f"the data holds translation pairs ({', '.join(languages)}): name the direction with --source-lang and "
            "--target-lang"
        )
    for source, target in COLUMN_PAIRS:
        if source in columns and target in columns:
            return Seq2SeqColumns(source, target)
    tried = ", ".join(f"{s}/{t}" for s, t in COLUMN_PAIRS)
    raise DataError(
        f"no source/target columns found (tried {tried}, and a translation column; available: {available}); name "
        "them with --text-keys SOURCE --label-key TARGET"
    )


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _cut(encoded: Any) -> int:
    """How many rows the tokenizer cut (a fast tokenizer keeps what it cut as overflow); 0 for slow tokenizers."""
    return sum(bool(e.overflowing) for e in (getattr(encoded, "encodings", None) or ()))


def _encode_batch(
    batch: dict[str, list],
    *,
    split: str,
    columns: Seq2SeqColumns,
    tokenizer: Any,
    source_prefix: str,
    seq_length: int,
    max_target_length: int,
) -> dict[str, list]:
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    sources, targets = [], []
    for row in rows:
        source, target = (_text(v) for v in columns.pair(row))
        for what, text, key, other, text_of_other in (
            ("target", target, columns.target, "source", source),
            ("source", source, columns.source, "target", target),
        ):
            if not text:
                # Split rows may be a shuffled share of a file: the other text finds the row, an index would not.
                raise DataError(
                    f"--data-path: a pair of the {split} split has an empty {what} ({key}; its {other}: "
                    f"{text_of_other[:60]!r}); a pair needs both texts: fix or remove the row"
                )
        sources.append(source_prefix + source)
        targets.append(target)
    encoded = tokenizer(sources, max_length=seq_length, truncation=True)
    labels = tokenizer(text_target=targets, max_length=max_target_length, truncation=True)
    n = len(sources)
    return {
        "input_ids": encoded["input_ids"],
        "attention_mask": encoded["attention_mask"],
        "labels": labels["input_ids"],
        # One count per batch, on its first row: summed over the split afterwards.
        "cut_sources": [_cut(encoded)] + [0] * (n - 1),
        "cut_targets": [_cut(labels)] + [0] * (n - 1),
    }


def _encode_split(
    name: str,
    dataset: Any,
    columns: Seq2SeqColumns,
    tokenizer: Any,
    source_prefix: str,
    seq_length: int,
    max_target_length: int,
) -> tuple[Any, int, int]:
    """One split as token ids (a ``datasets.Dataset``); also how many sources and targets were cut."""
    needed = [TRANSLATION_COLUMN] if columns.translation else [columns.source, columns.target]
    missing = [c for c in needed if c not in dataset.column_names]
    if missing:
        raise DataError(
            f"--data-path: the {name} split has no column {', '.join(missing)} (it has: "
            f"{', '.join(dataset.column_names)}); make the splits' columns consistent"
        )
    if len(dataset) == 0:
        raise DataError(f"--data-path: the {name} split has no rows")
    encoded = dataset.map(
        _encode_batch,
        batched=True,
        remove_columns=dataset.column_names,
        fn_kwargs={
            "split": name,
            "columns": columns,
            "tokenizer": tokenizer,
            "source_prefix": source_prefix,
            "seq_length": seq_length,
            "max_target_length": max_target_length,
        },
        # Nothing may be written next to the user's data or into the cache of a previous tokenizer.
        keep_in_memory=True,
        load_from_cache_file=False,
        desc=f"Tokenizing {name}",
    )
    cut_sources, cut_targets = sum(encoded["cut_sources"]), sum(encoded["cut_targets"])
    return encoded.remove_columns(["cut_sources", "cut_targets"]), cut_sources, cut_targets


@dataclass
class Seq2SeqData:
    """Encoded splits (``datasets.Dataset`` of ``{"input_ids", "attention_mask", "labels"}``; None for a split
    the data lacks) and what encoding did."""

    train: Any
    validation: Any
    test: Any
    columns: Seq2SeqColumns
    truncated_sources: int
    truncated_targets: int


def build_seq2seq_data(
    raw: Any,
    tokenizer: Any,
    seq_length: int,
    max_target_length: int,
    *,
    text_keys: list[str] | None = None,
    label_key: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
    source_prefix: str | None = None,
) -> Seq2SeqData:
    """Every split of ``raw`` (a ``datasets.DatasetDict``) checked and encoded (see the module docstring)."""
    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    if seq_length < 2:
        raise DataError(f"--seq-length {seq_length}: too short for a source; use at least 2")
    if max_target_length < 2:
        raise DataError(f"--max-target-length {max_target_length}: too short for a target; use at least 2")
    columns = detect_columns(raw["train"], text_keys, label_key, source_lang, target_lang)
    splits: dict[str, Any] = {name: None for name in SPLIT_ORDER}
    cut_sources = cut_targets = 0
    for name in SPLIT_ORDER:
        if name in raw:
            rows, sources, targets = _encode_split(
                name, raw[name], columns, tokenizer, source_prefix or "", seq_length, max_target_length
            )
            splits[name] = rows
            cut_sources, cut_targets = cut_sources + sources, cut_targets + targets
    return Seq2SeqData(
        train=splits["train"],
        validation=splits["validation"],
        test=splits["test"],
        columns=columns,
        truncated_sources=cut_sources,
        truncated_targets=cut_targets,
    )
