"""The embedded demos' one builder: a ``DemoSpec`` says what a demo is made of, this module makes it.

Each ``*_demo`` module keeps only what is its own (its data generator and its ``DemoSpec``); what they all do the
same way lives here: the cache directory, building once on ``rapidlite.runtime.cache.build_once`` (safe when ranks race;
a complete directory built from other parameters is built again), the tokenizer saved beside a randomly
initialised Hugging Face model seeded without touching the caller's RNG, and the ``Demo`` the registry hands to
resolve and the CLI.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidlite.config.tasks import Demo
from rapidlite.data.tokenizers import BERT_SPECIAL_TOKENS
from rapidlite.runtime.cache import build_once, cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

MANIFEST = "demo_manifest.json"  # what a demo directory was built from: other parameters build it again
DEFAULT_SEED = 1234
# The BERT demos' model: 2 layers of width 64, enough to learn each demo's task within minutes on a CPU.
TINY_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def vocab_and_padding(tokenizer: Any) -> dict[str, int]:
    """The model config's token entries most demos need: the vocabulary's size and the padding id."""
    return {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}


@dataclass(frozen=True)
class DemoBuild:
    """What a demo's tokenizer hook works from: the seed, the generated splits (split name -> rows), the model
    directory (files written there stay beside the model) and a scratch directory (removed afterwards)."""

    seed: int
    splits: Mapping[str, list]
    model_dir: pathlib.Path
    scratch: pathlib.Path


@dataclass(frozen=True)
class DemoSpec:
    """One embedded demo: a tokenizer and a tiny randomly initialised model (``model/``) beside generated data
    (``data/``), built once into ``demo-{name}-v{version}`` in the rapidlite cache.

    ``generate(seed, sizes)`` makes the splits (``sizes``: split name -> row count, in ``splits``' order) and
    ``write_split(path, rows)`` writes each as ``data/{split}{suffix}``; ``tokenizer(DemoBuild)`` builds the
    tokenizer. ``model``: the ``transformers`` class, made from its config class with ``config`` (sizes),
    ``token_config(tokenizer)`` and, with ``labels``, the label maps; ``init(model)`` adjusts the initial weights.
    ``flags``: the flag values the run starts from (flags given on the command line win). Bump ``version`` when
    the generator, tokenizer or model changes, so cached assets are rebuilt.

    Calling the spec gives the registry's ``Demo`` (``TaskSpec.demo`` names ``"module:demo"``).
    """

    name: str
    version: int
    splits: Mapping[str, int]
    generate: Callable[[int, Mapping[str, int]], Mapping[str, list]]
    write_split: Callable[[pathlib.Path, list], None]
    suffix: str
    tokenizer: Callable[[DemoBuild], Any]
    model: str
    config: Mapping[str, Any]
    flags: Mapping[str, Any]
    token_config: Callable[[Any], Mapping[str, Any]] = vocab_and_padding
    labels: tuple[str, ...] = ()
    init: Callable[[Any], None] | None = None

    def root(self) -> pathlib.Path:
        """Where ``prepare`` builds the demo in the rapidlite cache."""
        return pathlib.Path(cache_root()) / f"demo-{self.name}-v{self.version}"

    def write_assets(
        self, out_dir: str | os.PathLike, seed: int = DEFAULT_SEED, **num: int
    ) -> tuple[pathlib.Path, pathlib.Path]:
        """Write (once) ``out_dir/model`` and ``out_dir/data``; returns (model_dir, data_dir). ``num_<split>=N``
        sizes a split. Deterministic for a seed; a concurrent builder's result is as good."""
        sizes = dict(self.splits)
        for key, count in num.items():
            split = key.removeprefix("num_")
            if not key.startswith("num_") or split not in sizes:
                raise TypeError(f"write_assets() got an unexpected keyword argument {key!r}")
            sizes[split] = count
        manifest = {"demo": self.name, "generator_version": self.version, "seed": seed}
        manifest.update({f"num_{split}": count for split, count in sizes.items()})
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        final = build_once(out_dir, lambda scratch: self._build(scratch, seed, sizes, text), key=text)
        return final / "model", final / "data"

    def _build(self, out: pathlib.Path, seed: int, sizes: Mapping[str, int], manifest: str) -> None:
        splits = self.generate(seed, sizes)
        (out / "data").mkdir()
        for name, rows in splits.items():
            self.write_split(out / "data" / f"{name}{self.suffix}", rows)
        build = DemoBuild(seed, splits, out / "model", out / "scratch")
        build.model_dir.mkdir()
        build.scratch.mkdir()
        tokenizer = self.tokenizer(build)
        shutil.rmtree(build.scratch)
        tokenizer.save_pretrained(build.model_dir)
        self._write_model(build.model_dir, tokenizer, seed)
        (out / MANIFEST).write_text(manifest, encoding="utf-8")

    def _write_model(self, model_dir: pathlib.Path, tokenizer: Any, seed: int) -> None:
        import torch
        import transformers

        from rapidlite.models.hf import plain_save

        model_class = getattr(transformers, self.model)
        config = model_class.config_class(**self.token_config(tokenizer), **label_maps(self.labels), **self.config)
        with torch.random.fork_rng(devices=[]):  # seeding must not change the caller's RNG stream
            torch.manual_seed(seed)
            model = model_class(config)
            if self.init is not None:
                self.init(model)
        with plain_save():
            model.save_pretrained(model_dir)

    def prepare(self) -> None:
        """Write (once) the embedded demo's model, tokenizer and data in the cache."""
        self.write_assets(self.root())

    def __call__(self) -> Demo:
        """The registry's view: the flags the run starts from, where ``prepare`` writes the model and the data."""
        root = self.root()
        assets = {"pretrained_model_name_or_path": str(root / "model"), "data_path": [str(root / "data")]}
        return Demo(defaults=self.flags, assets=assets, prepare=self.prepare)


def label_maps(labels: Sequence[str]) -> dict[str, Any]:
    """A classifier config's label entries (none without labels)."""
    if not labels:
        return {}
    return {
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {name: i for i, name in enumerate(labels)},
    }


def write_jsonl(path: pathlib.Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def parse_table(text: str) -> dict[str, tuple[tuple[str, ...], ...]]:
    """A word table kept as text, which reads better than nested tuples: each name on a line of its own, then its
    groups indented, one per line, a group's phrases separated by commas (a line ending in a comma goes on)."""
    table: dict[str, list[tuple[str, ...]]] = {}
    pending = ""
    for line in text.strip("\n").splitlines():
        if not line.startswith(" "):
            groups = table[line.strip()] = []
        elif (pending := pending + " " + line.strip()).endswith(","):
            continue
        else:
            groups.append(tuple(phrase.strip() for phrase in pending.split(",")))
            pending = ""
    return {name: tuple(groups) for name, groups in table.items()}


def write_lines(path: pathlib.Path, lines: Sequence[str]) -> None:
    """One text per line (a document, in a language-model corpus)."""
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_csv(path: pathlib.Path, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A header line, then one line per row, ``\\n``-terminated on every platform."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def wordpiece_tokenizer(model_dir: pathlib.Path, vocab: list[str], max_positions: int) -> PreTrainedTokenizerFast:
    """``vocab`` written as ``model_dir/vocab.txt`` (kept beside the model) and the tokenizer built from it."""
    (model_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return build_wordpiece_tokenizer(model_dir / "vocab.txt", model_max_length=max_positions)


def build_wordpiece_tokenizer(vocab_file: str | os.PathLike, model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """A lower-casing BERT WordPiece tokenizer (``PreTrainedTokenizerFast``) from a ``vocab.txt``.

    transformers 5 ignores ``BertTokenizerFast(vocab_file=...)`` (it silently builds a 5-token
    vocabulary, so every word becomes [UNK]) and takes ``vocab=`` instead, while transformers 4 takes
    ``vocab_file=``. Building the ``tokenizers`` pipeline ourselves behaves the same on both.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    with open(vocab_file, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f) if line.strip()}
    missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"{vocab_file}: vocabulary lacks special tokens {', '.join(missing)}")
    backend = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
        # BERT uses segment ids for sentence pairs; the generic class would drop them.
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
