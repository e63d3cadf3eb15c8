"""Data for ``--task token_classification``: sentences as words, one tag per word (NER, POS, chunking).

* :func:`load_token_datasets` reads ``--data-path`` as :func:`rapidlite.data.tabular.load_raw_datasets` does, and
  also CoNLL text files (``word ... tag`` per line, a blank line between sentences, ``-DOCSTART-`` lines
  skipped; ``.conll``, ``.txt`` or ``.bio``; one file split by ``--split`` or a directory of split files);
* :func:`detect_columns` finds the words column and the tags column;
* :func:`build_token_classification_data` maps tags to ids, tokenizes the words with a fast tokenizer and aligns
  the tags with the sub-tokens (:func:`align_labels`), and returns a :class:`TokenClassificationData` with a
  padding collator.

Every problem the user can fix is raised as :class:`rapidlite.errors.DataError` with one line naming the flag,
file or row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapidlite.data.tabular import SPLIT_ORDER, carved_splits, load_raw_datasets
from rapidlite.errors import DataError

if TYPE_CHECKING:  # heavy imports stay out of CLI start-up (``--help`` must be fast)
    import datasets
    import torch

CONLL_EXTENSIONS: tuple[str, ...] = ("conll", "txt", "bio")
WORD_COLUMNS: tuple[str, ...] = ("tokens", "words")
# run_ner's "{task}_tags" columns first (ner, pos, chunk), then the usual names of other data sets.
TAG_COLUMNS: tuple[str, ...] = ("ner_tags", "tags", "labels", "label", "ner", "pos_tags", "chunk_tags", "upos", "xpos")
IGNORE = -100  # the label of a sub-token the loss skips (special tokens, padding, a word's later pieces)
_TOKENIZE_CHUNK = 1000


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def read_conll(path: str) -> datasets.Dataset:
    """A CoNLL-style file as rows ``{"tokens": [...], "ner_tags": [...]}``: one word per line with its tag in the
    last column (columns split by tabs if the line has one, else by spaces), a blank line between sentences,
    ``-DOCSTART-`` lines skipped."""
    import datasets

    sentences: list[list[str]] = []
    tags: list[list[str]] = []
    words: list[str] = []
    word_tags: list[str] = []

    def end_sentence() -> None:
        if words:
            sentences.append(list(words))
            tags.append(list(word_tags))
            words.clear()
            word_tags.clear()

    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                text = line.strip()
                if not text or text.startswith("-DOCSTART-"):
                    end_sentence()
                    continue
                fields = [c.strip() for c in text.split("\t")] if "\t" in text else text.split()
                if len(fields) < 2 or not fields[0] or not fields[-1]:
                    raise DataError(
                        f"{path}:{number}: {text[:60]!r} is not 'word ... tag' (CoNLL: one word and its tag per "
                        "line, a blank line between sentences); fix the line"
                    )
                words.append(fields[0])
                word_tags.append(fields[-1])
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert the file to UTF-8") from None
    end_sentence()
    if not sentences:
        raise DataError(f"{path}: no sentences (CoNLL: 'word ... tag' lines, a blank line between sentences)")
    return datasets.Dataset.from_dict({"tokens": sentences, "ner_tags": tags})


def load_token_datasets(
    data_path: str,
    data_name: str | None = None,
    data_dir: str | None = None,
    split: str = "969,30,1",
    seed: int = 1234,
    eval_only: bool = False,
) -> datasets.DatasetDict:
    """``--data-path`` as a DatasetDict: what ``load_raw_datasets`` reads, plus CoNLL files (``read_conll``)."""
    return load_raw_datasets(
        data_path,
        data_name,
        data_dir,
        split,
        seed,
        readers=dict.fromkeys(CONLL_EXTENSIONS, read_conll),
        eval_only=eval_only,
    )


# --------------------------------------------------------------------------------------------------
# Columns and tags
# --------------------------------------------------------------------------------------------------


def detect_columns(
    dataset: datasets.Dataset, text_keys: Sequence[str] | None = None, label_key: str | None = None
) -> tuple[str, str]:
    """``(words column, tags column)`` of ``dataset``: ``--text-keys WORDS`` and ``--label-key TAGS``, else the
    usual names (``tokens``/``words``; ``ner_tags``, ``tags``, ``labels``, ..., ``pos_tags``, ``chunk_tags``)."""
    columns = list(dataset.column_names)
    available = ", ".join(columns)
    if text_keys:
        if len(text_keys) != 1:
            raise DataError(f"--text-keys {' '.join(text_keys)}: token classification reads one words column")
        words = text_keys[0]
        if words not in columns:
            raise DataError(f"--text-keys {words}: no such column (available: {available})")
    else:
        words = next((c for c in WORD_COLUMNS if c in columns), None)
        if words is None:
            raise DataError(
                f"--text-keys: no words column found (tried {', '.join(WORD_COLUMNS)}; available: {available}); "
                "name the column of word lists with --text-keys"
            )
    if label_key is not None:
        if label_key not in columns:
            raise DataError(f"--label-key {label_key}: no such column (available: {available})")
        tags = label_key
    else:
        tags = next((c for c in TAG_COLUMNS if c in columns and c != words), None)
        if tags is None:
            raise DataError(
                f"--label-key: no tags column found (tried {', '.join(TAG_COLUMNS)}; available: {available}); "
                "name the column of word tags with --label-key"
            )
    if tags == words:
        raise DataError(f"--label-key {tags}: is the words column too; name the tags column")
    return words, tags


def _class_names(dataset: datasets.Dataset, column: str) -> list[str] | None:
    """The tag names of a ``Sequence(ClassLabel)`` column (its values are ids into them), else None."""
    from datasets import ClassLabel

    inner = getattr(dataset.features[column], "feature", None)
    return list(inner.names) if isinstance(inner, ClassLabel) else None


def _as_list(value: Any, split: str, row: int, column: str, flag: str) -> list[Any]:
    # csv/tsv cells hold text: words (and tags) separated by spaces.
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise DataError(
        f"{flag} {column}: {split} row {row} holds {type(value).__name__} {value!r}, not a list of words or tags "
        "(or space-separated text); fix the row"
    )


def _preview(words: list[str]) -> str:
    # Rows of a split carved out of a file are shuffled: the words find the row, its number alone would not.
    text = " ".join(words)
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Sentences:
    """One split's words and tag ids, sentence by sentence."""

    words: list[list[str]]
    tags: list[list[int]]


def _read_split(ds: datasets.Dataset, split: str, words_col: str, tags_col: str) -> tuple[list[list[str]], list[list]]:
    """The rows' words and raw tags (ClassLabel ids as tag names), checked: a list each, of equal length."""
    names = _class_names(ds, tags_col)
    plain = ds.with_format(None)  # not ds.data: after select() that is still the whole table
    all_words, all_tags = [], []
    for row, (words, tags) in enumerate(zip(plain[words_col], plain[tags_col], strict=True), 1):
        words = [str(w) for w in _as_list(words, split, row, words_col, "--text-keys")]
        tags = _as_list(tags, split, row, tags_col, "--label-key")
        if len(words) != len(tags):
            raise DataError(
                f"--label-key {tags_col}: {split} row {row} ({_preview(words)}) has {len(words)} words ({words_col}) "
                f"but {len(tags)} tags; every word needs one tag: fix the row"
            )
        if names is not None:
            for tag in tags:
                if not _is_int(tag) or not 0 <= tag < len(names):
                    raise DataError(
                        f"--label-key {tags_col}: {split} row {row} ({_preview(words)}) has tag id {tag!r}, outside "
                        f"the column's {len(names)} tag names (ids 0..{len(names) - 1}); fix the row"
                    )
            tags = [names[t] for t in tags]
        all_words.append(words)
        all_tags.append(tags)
    return all_words, all_tags


def _tag_list(train_names: list[str] | None, train_tags: list[list]) -> list[str]:
    """The label list: a ClassLabel column's names in their order, else the sorted distinct train tags (numbers
    in numeric order), as run_ner builds it."""
    if train_names is not None:
        return train_names
    values = {t for tags in train_tags for t in tags}
    if values and all(_is_int(v) for v in values):
        return [str(v) for v in sorted(values)]
    return sorted(str(v) for v in values)


def b_to_i_labels(names: Sequence[str]) -> list[int]:
    """For each tag id the id a word's later sub-tokens get with ``--label-all-tokens``: B-X's is I-X's (where
    the tag set has it), every other tag keeps its own (run_ner's ``b_to_i_label``)."""
    index = {n: i for i, n in enumerate(names)}
    return [index.get("I-" + n[2:], i) if n.startswith("B-") else i for i, n in enumerate(names)]


def align_labels(
    word_ids: Sequence[int | None], word_labels: Sequence[int], b_to_i: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Sub-token labels and word starts for one tokenized sentence. ``word_ids``: the fast tokenizer's word
    index of each sub-token (None for special tokens). The first sub-token of a word gets the word's label;
    its later sub-tokens get ``IGNORE`` (-100), or with ``b_to_i`` (``--label-all-tokens``) ``b_to_i[label]``;
    special tokens get ``IGNORE``. ``word_starts`` marks first sub-tokens (1): the word-level predictions."""
    labels, starts = [], []
    previous = None
    for word in word_ids:
        if word is None:
            labels.append(IGNORE)
            starts.append(0)
        elif word != previous:
            labels.append(word_labels[word])
            starts.append(1)
        else:
            labels.append(IGNORE if b_to_i is None else b_to_i[word_labels[word]])
            starts.append(0)
        previous = word
    return labels, starts


# --------------------------------------------------------------------------------------------------
# Tokenization and batching
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenClassificationData:
    """Tokenized splits, the tag names (``id2label``) and the word-level sentences they came from."""

    train: datasets.Dataset
    validation: datasets.Dataset | None
    test: datasets.Dataset | None
    id2label: dict[int, str]
    words_key: str
    tags_key: str
    collate_fn: TokenClassificationCollator
    sentences: dict[str, Sentences] = field(default_factory=dict)
    # Per split: sentences cut by --seq-length; words before the cut the tokenizer turned into nothing.
    truncated: dict[str, int] = field(default_factory=dict)
    empty_words: dict[str, int] = field(default_factory=dict)
    # Sentences moved back to train from a split --split carved out of it, per split: a tag of theirs had no train
    # sentence.
    moved: dict[str, int] = field(default_factory=dict)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)


class TokenClassificationCollator:
    """Pads tokenized rows to the longest one: inputs with the tokenizer, ``labels`` with -100 and
    ``word_starts`` with 0 (a class, not a closure, so loader workers can pickle it)."""

    extra = ("labels", "word_starts")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        import torch

        inputs = [{k: v for k, v in f.items() if k not in self.extra} for f in features]
        padded = self.tokenizer.pad(inputs, padding="longest", return_tensors="pt")
        batch = {k: torch.as_tensor(v).to(torch.int64) for k, v in padded.items()}
        length = batch["input_ids"].shape[1]
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for key, fill in (("labels", IGNORE), ("word_starts", 0)):
            if features and key in features[0]:
                rows = [[fill] * (length - len(f[key])) for f in features]
                values = [pad + f[key] if left else f[key] + pad for pad, f in zip(rows, features, strict=True)]
                batch[key] = torch.tensor(values, dtype=torch.int64)
        return batch


def _tokenize(
    words: list[list[str]], tag_ids: list[list[int]], tokenizer: Any, seq_length: int, b_to_i: list[int] | None
) -> tuple[dict[str, list], int, int]:
    """Tokenized columns for these sentences, the count of sentences cut by ``seq_length``, and of words before
    the cut that the tokenizer turned into no sub-token at all (neither trained nor scored)."""
    columns: dict[str, list] = {}
    truncated = empty = 0
    for start in range(0, len(words), _TOKENIZE_CHUNK):
        chunk = words[start : start + _TOKENIZE_CHUNK]
        encoded = tokenizer(chunk, is_split_into_words=True, truncation=True, max_length=seq_length)
        for key, values in encoded.items():
            columns.setdefault(key, []).extend(values)
        for i, sentence in enumerate(chunk):
            word_ids = encoded.word_ids(i)
            labels, starts = align_labels(word_ids, tag_ids[start + i], b_to_i)
            columns.setdefault("labels", []).append(labels)
            columns.setdefault("word_starts", []).append(starts)
            kept = max((w for w in word_ids if w is not None), default=-1) + 1
            truncated += kept < len(sentence)
            empty += kept - sum(starts)
    return columns, truncated, empty


def _return_unseen_to_train(read: dict[str, tuple[list, list]], carved: tuple[str, ...]) -> dict[str, int]:
    """Move the sentences of a carved split (``--split`` cut it out of the train data) holding a tag no train
    sentence has back to train: the shuffle put a rare tag's only sentences there, and the user has no
    validation file to fix. Returns the sentences moved per split."""
    moved: dict[str, int] = {}
    for name in carved:
        if name not in read:
            continue
        known = {str(t) for tags in read["train"][1] for t in tags}
        words, tags = read[name]
        unseen = [i for i, sentence in enumerate(tags) if any(str(t) not in known for t in sentence)]
        if not unseen or len(unseen) == len(tags):
            continue  # nothing to move, or nothing would be left to score
        back = set(unseen)
        read["train"] = (
            read["train"][0] + [words[i] for i in unseen],
            read["train"][1] + [tags[i] for i in unseen],
        )
        read[name] = (
            [w for i, w in enumerate(words) if i not in back],
            [t for i, t in enumerate(tags) if i not in back],
        )
        moved[name] = len(unseen)
    return moved


def build_token_classification_data(
    raw: datasets.DatasetDict,
    tokenizer: Any,
    seq_length: int,
    text_keys: Sequence[str] | None = None,
    label_key: str | None = None,
    label_all_tokens: bool = False,
    label_order: Sequence[str] | None = None,
) -> TokenClassificationData:
    """Detect the columns, map tags to ids, tokenize and align every split of ``raw`` (nothing is cached on disk).

    The tag names come from the train split (a ClassLabel column's names, else its sorted distinct tags); a
    validation or test tag outside them is an error. ``label_order``: the tag names of a model's head, used as
    the tags and ids when they include the data's (a model fine-tuned on these tags keeps its head). A test split
    without the tags column is left out (nothing to score)."""
    import datasets

    if "train" not in raw:
        raise DataError(f"--data-path: the data has no train split (it has: {', '.join(raw.keys())})")
    if seq_length < 3:
        raise DataError(f"--seq-length {seq_length}: too short; use at least 3 (room for [CLS], a word and [SEP])")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"token classification aligns tags with sub-tokens through a fast tokenizer's word_ids(); "
            f"{type(tokenizer).__name__} is not one: use a model directory with a tokenizer.json"
        )
    splits = {name: raw[name] for name in SPLIT_ORDER if name in raw}
    words_key, tags_key = detect_columns(splits["train"], text_keys, label_key)
    if "test" in splits and tags_key not in splits["test"].column_names:
        del splits["test"]
    for name, ds in splits.items():
        missing = [c for c in (words_key, tags_key) if c not in ds.column_names]
        if missing:
            raise DataError(
                f"--data-path: the {name} split lacks column {', '.join(missing)} that train has "
                f"(it has: {', '.join(ds.column_names)}); make the files' columns consistent"
            )
    if len(splits["train"]) == 0:
        raise DataError("--data-path: the train split is empty; add training rows")

    read = {name: _read_split(ds, name, words_key, tags_key) for name, ds in splits.items()}
    moved = _return_unseen_to_train(read, carved_splits(raw))
    names = _tag_list(_class_names(splits["train"], tags_key), read["train"][1])
    if not names:
        raise DataError(f"--label-key {tags_key}: the train split has no tags")
    # A head with all these tags (and maybe more: a NER model scored on data without one of its types) keeps its
    # tags and ids; a head made for these tags alone would be a fresh, untrained one.
    if label_order is not None and len(set(label_order)) == len(label_order) and set(names) <= set(label_order):
        names = list(label_order)
    to_id = {n: i for i, n in enumerate(names)}
    b_to_i = b_to_i_labels(names) if label_all_tokens else None

    out: dict[str, datasets.Dataset] = {}
    sentences: dict[str, Sentences] = {}
    truncated: dict[str, int] = {}
    empty: dict[str, int] = {}
    for name, (words, tags) in read.items():
        tag_ids = []
        for row, sentence_tags in enumerate(tags, 1):
            ids = [to_id.get(str(t)) for t in sentence_tags]
            if None in ids:
                bad = sentence_tags[ids.index(None)]
                shown = ", ".join(names[:30]) + (", ..." if len(names) > 30 else "")
                raise DataError(
                    f"--label-key {tags_key}: {name} row {row} ({_preview(words[row - 1])}) has tag {bad!r}, which "
                    f"the train split does not have (train tags: {shown}); fix the {name} data or train on data with "
                    "that tag"
                )
            tag_ids.append(ids)
        columns, truncated[name], empty[name] = _tokenize(words, tag_ids, tokenizer, seq_length, b_to_i)
        sentences[name] = Sentences(words, tag_ids)
        out[name] = datasets.Dataset.from_dict(columns)
    return TokenClassificationData(
        train=out["train"],
        validation=out.get("validation"),
        test=out.get("test"),
        id2label=dict(enumerate(names)),
        words_key=words_key,
        tags_key=tags_key,
        collate_fn=TokenClassificationCollator(tokenizer),
        sentences=sentences,
        truncated=truncated,
        empty_words=empty,
        moved=moved,
    )


# --------------------------------------------------------------------------------------------------
# A baseline to beat
# --------------------------------------------------------------------------------------------------


def most_frequent_tag_baseline(train: Sentences, sentences: Sequence[Sequence[str]]) -> list[list[int]]:
    """Tags for ``sentences`` from memory alone: each word's most frequent train tag (the lower id on a tie),
    and for a word never seen in training the most frequent tag of all. What a model must beat to show it
    reads context."""
    by_word: dict[str, Counter] = {}
    overall: Counter = Counter()
    for words, tags in zip(train.words, train.tags, strict=True):
        for word, tag in zip(words, tags, strict=True):
            by_word.setdefault(word, Counter())[tag] += 1
            overall[tag] += 1

    def best(counts: Counter) -> int:
        return min(counts, key=lambda tag: (-counts[tag], tag))

    guess = {word: best(counts) for word, counts in by_word.items()}
    default = best(overall)
    return [[guess.get(word, default) for word in words] for words in sentences]
