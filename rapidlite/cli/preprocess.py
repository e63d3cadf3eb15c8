"""``rapidlite-preprocess``: its command line over ``rapidlite.data.preprocess.preprocess`` (text -> Megatron
``.bin/.idx``; the input formats and the output are described there)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rapidlite.data.documents import TEXT_FORMATS, check_input
from rapidlite.data.preprocess import preprocess
from rapidlite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from rapidlite.errors import ConfigError, RapidliteError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rapidlite-preprocess",
        description="Tokenize JSON lines or text into a Megatron-LM mmap indexed dataset (.bin/.idx).",
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="a JSON-lines (.jsonl/.json) or text (.txt) file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)")
    group.add_argument(
        "--text-format",
        choices=TEXT_FORMATS,
        default="auto",
        help="auto: by suffix; paragraphs: blank-line-separated documents; lines: one document per line",
    )
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep the newlines between sentences")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, metavar="TYPE", help=" | ".join(TOKENIZER_TYPES))
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model or Hugging Face directory")
    group.add_argument(
        "--vocab-file",
        "--vocab",
        default=None,
        help="vocab.json (GPT-2 BPE) or vocab.txt (BERT); --vocab is Megatron's",
    )
    group.add_argument("--merge-file", default=None, help="merges.txt (GPT-2 BPE)")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: number of token ids")
    group.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    group.add_argument("--lang", default="english", help="language of the nltk sentence splitter")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_{document|sentence}.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", help="only mmap is supported")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--partitions", type=int, default=1, help="process the input in N parts, then merge")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    group.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (drawn only on an interactive terminal; also RAPIDLITE_NO_PROGRESS=1)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``rapidlite-preprocess``: 0 on success, 2 (and one ``error:`` line) on a user error."""
    args = build_parser().parse_args(argv)
    try:
        if args.dataset_impl != "mmap":
            raise ConfigError(f"--dataset-impl {args.dataset_impl}: only mmap is supported (Megatron's default)")
        check_input(args.input)
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
        )
        preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            split_sentences=args.split_sentences,
            append_eod=args.append_eod,
            workers=args.workers,
            partitions=args.partitions,
            keep_newlines=args.keep_newlines,
            text_format=args.text_format,
            lang=args.lang,
            log_interval=args.log_interval,
            progress=not args.no_progress,
        )
    except RapidliteError as e:
        print(f"rapidlite-preprocess: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
