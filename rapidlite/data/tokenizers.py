"""Megatron-LM's tokenizers (``--tokenizer-type``), for preprocessing and for pretraining.

``build_tokenizer`` returns an object with ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``,
``vocab_size`` and ``eod`` (the id ``--append-eod`` appends), plus ``cls``/``sep``/``mask``/``pad``
(None where a tokenizer has no such token). The types and their end-of-document id follow Megatron:

- ``GPT2BPETokenizer``: ``vocab.json`` + ``merges.txt``, byte-level BPE built on the ``tokenizers``
  library (GPT-2's regex, no prefix space), which gives the same ids as Megatron's own GPT-2 BPE code.
  ``eod`` is ``<|endoftext|>``. As in Megatron, that string inside a text is not special: it is
  tokenized like any other text.
- ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: ``vocab.txt``, BERT's basic tokenization
  (lower-casing and accent stripping for the first) then WordPiece; ``tokenize`` adds no
  ``[CLS]``/``[SEP]``. ``eod`` is ``[SEP]`` (Megatron's BERT tokenizer has no EOD; ``[SEP]`` is what
  ends a BERT segment). Megatron also appends ``[BOS]``/``[EOS]`` to the vocabulary; this does not,
  so ``vocab_size`` is the line count of ``vocab.txt``.
- ``HuggingFaceTokenizer``: ``--tokenizer-model`` is a local directory (or a cached hub name) for
  ``transformers.AutoTokenizer``; ``vocab_size`` is ``len(tokenizer)`` (added tokens included) as in
  Megatron. ``tokenize`` adds no special tokens (Megatron's adds the model's BOS and the like), so the
  preprocessed stream holds only the text and the EOD. ``eod`` is the eos token, else the sep token.
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: a ``.model`` file, needs the
  ``sentencepiece`` package. Both behave as Megatron's ``GPTSentencePieceTokenizer``: plain pieces,
  ``eod`` = the model's eos id (Megatron's ``SentencePieceTokenizer`` would also append ``<CLS>``,
  ``<SEP>``, ``<EOD>``, ``<MASK>`` pieces for BERT/T5; that variant is not provided).
- ``NullTokenizer``: the text is whitespace-separated integer ids. Exactly Megatron's semantics:
  ``--vocab-size N`` means ids ``0..N-1`` are text, ``eod = N`` and ``vocab_size = N + 1``.

The helpers ``train_byte_level_bpe`` and ``write_wordpiece_vocab`` train small vocabularies offline
(tests and the pretraining demo); nothing here downloads anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from rapidlite.config.sections import TOKENIZER_TYPES
from rapidlite.config.settings import Sections
from rapidlite.errors import ConfigError, DataError

EOD_TOKEN = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _require_file(flag: str, path: str | os.PathLike | None, tokenizer_type: str) -> str:
    if path is None:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    return path


class AbstractTokenizer:
    """What every tokenizer offers; ids are plain Python ints."""

    name: str = "tokenizer"
    vocab_size: int
    eod: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    pad: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def hf_tokenizer(self) -> Any:
        """A ``transformers`` tokenizer with the same vocabulary and ids, exported beside a Hugging Face model;
        None where there is none (the export then says so)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class _BackendTokenizer(AbstractTokenizer):
    """A ``tokenizers.Tokenizer`` pipeline used without its special-token post-processing."""

    _backend: Any

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    _special_tokens: dict[str, str] = {}

    def hf_tokenizer(self) -> Any:
        import copy

        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(self._backend), **self._special_tokens)


class GPT2BPETokenizer(_BackendTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` and ``merges.txt``; ``eod`` = ``<|endoftext|>``."""

    name = "GPT2BPETokenizer"
    _special_tokens = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:
            raise ConfigError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE vocabulary ({_first_line(e)})"
            ) from None
        self._backend = Tokenizer(model)
        self._backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._backend.decoder = decoders.ByteLevel()
        self.vocab_size = self._backend.get_vocab_size()
        eod = self._backend.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ConfigError(f"--vocab-file {vocab_file}: the vocabulary has no {EOD_TOKEN} token (the EOD)")
        self.eod = eod
        if not self.tokenize("a b"):
            raise ConfigError(f"--vocab-file {vocab_file}: the vocabulary tokenizes text to nothing")


class BertWordPieceTokenizer(_BackendTokenizer):
    """BERT WordPiece from ``vocab.txt``; ``tokenize`` adds no ``[CLS]``/``[SEP]``; ``eod`` = ``[SEP]``."""

    _special_tokens = {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    }

    def __init__(self, vocab_file: str, lower_case: bool = True) -> None:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab: dict[str, int] = {}
                for line in f:
                    token = line.rstrip("\r\n")
                    if token and token not in vocab:
                        vocab[token] = len(vocab)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--vocab-file {vocab_file}: cannot read ({_first_line(e)})") from None
        missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ConfigError(f"--vocab-file {vocab_file}: not a BERT vocabulary, it lacks {' '.join(missing)}")
        self._backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        self._backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
        )
        self._backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        self.vocab_size = len(vocab)
        self.cls, self.sep, self.mask, self.pad = (vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        self.unk = vocab["[UNK]"]
        self.eod = self.sep


def special_tokens_only(tokenizer: Any) -> bool:
    """Whether a ``transformers`` tokenizer holds its special tokens alone: what ``AutoTokenizer`` builds from a
    directory without tokenizer files (a model config saved on its own), so every word is unknown."""
    return len(tokenizer) <= max(1, len(set(tokenizer.all_special_ids)))


class HuggingFaceTokenizer(AbstractTokenizer):
    """``transformers.AutoTokenizer`` without added special tokens; ``eod`` = eos (else sep) token."""

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str) -> None:
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_model)
        except Exception as e:
            raise ConfigError(
                f"--tokenizer-model {tokenizer_model}: cannot load a Hugging Face tokenizer ({_first_line(e)}); "
                "give a local directory holding the tokenizer files"
            ) from None
        tok = self._tokenizer
        # Every data id would be "outside the vocabulary" of a tokenizer of special tokens alone.
        if special_tokens_only(tok):
            raise ConfigError(
                f"{tokenizer_model}: holds no tokenizer files (its tokenizer has {len(tok)} ids, its special tokens "
                "alone); save the tokenizer the data was made with there, or pass it with --tokenizer-type and its "
                "files"
            )
        self.vocab_size = len(tok)
        self.eod = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        self.cls, self.sep, self.mask, self.pad = (
            tok.cls_token_id,
            tok.sep_token_id,
            tok.mask_token_id,
            tok.pad_token_id,
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def hf_tokenizer(self) -> Any:
        return self._tokenizer


class SentencePieceTokenizer(AbstractTokenizer):
    """A SentencePiece ``.model`` (Megatron's ``GPTSentencePieceTokenizer``); ``eod`` = the eos id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self._load()

    def _load(self) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError(
                "--tokenizer-type SentencePieceTokenizer needs the sentencepiece package: pip install sentencepiece"
            ) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_file)
        except Exception as e:
            raise ConfigError(
                f"--tokenizer-model {self.model_file}: not a SentencePiece model ({_first_line(e)})"
            ) from None
        self.vocab_size = int(self._sp.vocab_size())
        eos, pad = int(self._sp.eos_id()), int(self._sp.pad_id())
        self.eod = eos if eos >= 0 else None
        self.pad = pad if pad >= 0 else None

    def __getstate__(self) -> dict[str, Any]:
        return {"model_file": self.model_file, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_file, self.name = state["model_file"], state["name"]
        self._load()

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class NullTokenizer(AbstractTokenizer):
    """Text of whitespace-separated ids ``0..N-1``; ``eod = N``, ``vocab_size = N + 1`` (Megatron's)."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            bad = next(w for w in text.split() if not w.lstrip("+-").isdigit())
            raise DataError(f"NullTokenizer: {bad[:40]!r} is not an integer token id") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise DataError(f"NullTokenizer: token id {i} is outside [0, {self.vocab_size}) (--vocab-size)")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> AbstractTokenizer:
    """The tokenizer Megatron builds for ``--tokenizer-type`` and its file flags."""
    if tokenizer_type == "GPT2BPETokenizer":
        vocab = _require_file("--vocab-file", vocab_file, tokenizer_type)
        merges = _require_file("--merge-file", merge_file, tokenizer_type)
        return GPT2BPETokenizer(vocab, merges)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _require_file("--vocab-file", vocab_file, tokenizer_type)
        return BertWordPieceTokenizer(vocab, lower_case=tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer directory)")
        return HuggingFaceTokenizer(os.fspath(tokenizer_model))
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        model = _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        tokenizer = SentencePieceTokenizer(model)
        tokenizer.name = tokenizer_type
        return tokenizer
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids)")
        if int(vocab_size) <= 0:
            raise ConfigError(f"--vocab-size {vocab_size}: must be positive")
        return NullTokenizer(int(vocab_size))
    raise ConfigError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def tokenizer_of(settings: Sections) -> Any:
    """The tokenizer the flags name: ``--tokenizer-type`` with its files, else the tokenizer of
    ``--pretrained-model-name-or-path`` (what Megatron's ``get_tokenizer()`` returns)."""
    data, model = settings.data, settings.model.pretrained_model_name_or_path
    if data.tokenizer_type is None:
        if model is None:
            raise ConfigError(
                "--task pretraining needs the tokenizer the data was preprocessed with: --tokenizer-type with "
                "--vocab-file/--merge-file/--tokenizer-model, or --pretrained-model-name-or-path"
            )
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
    return build_tokenizer(
        data.tokenizer_type,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model,
        vocab_size=data.vocab_size,
    )


# ----------------------------------------------------------------------------------------- training
def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, min_frequency: int = 2
) -> tuple[str, str]:
    """Train a GPT-2 style byte-level BPE (with ``<|endoftext|>``); returns (vocab.json, merges.txt) paths."""
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(out_dir, exist_ok=True)
    trainer = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN], show_progress=False
    )
    trainer.save_model(os.fspath(out_dir))
    return os.path.join(out_dir, "vocab.json"), os.path.join(out_dir, "merges.txt")


def write_wordpiece_vocab(
    texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, lowercase: bool = True
) -> str:
    """Train a BERT WordPiece vocabulary (with [PAD] [UNK] [CLS] [SEP] [MASK]); returns the vocab.txt path."""
    from tokenizers import BertWordPieceTokenizer as Trainer

    os.makedirs(out_dir, exist_ok=True)
    trainer = Trainer(lowercase=lowercase)
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=1, special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False
    )
    trainer.save_model(os.fspath(out_dir))
    return os.path.join(out_dir, "vocab.txt")
