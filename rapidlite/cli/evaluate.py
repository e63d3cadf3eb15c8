"""``rapidlite-eval``: score a causal LM (or a reward model) on a local jsonl file, on one process or N.

    rapidlite-eval --model DIR --data items.jsonl [--task multiple_choice|perplexity|reward] [--seq-length N]
                   [--micro-batch-size N] [--bf16] [--output results.json [--overwrite]] [--nproc-per-node N]
                   [--scores pairs.jsonl (--task reward: each pair's rewards)]

The data and the output path are checked before any model is loaded or worker started. With
``--nproc-per-node N`` the command re-runs itself as N torchrun workers (``rapidlite.runtime.launcher``); each
scores its share of the batches and rank 0 prints the gathered results as one JSON line (and writes
``--output``: atomically, and never over an existing file unless ``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rapidlite.cli.entry import run_command
from rapidlite.config.runtime import ParallelConfig
from rapidlite.errors import ConfigError
from rapidlite.evaluation.data import REWARD, TASK_FIELDS, load_eval_data


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite-eval --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rapidlite-eval",
        description="Score a causal LM, or a reward model, on local jsonl data.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        "--pretrained-model-name-or-path",
        dest="model",
        required=True,
        metavar="DIR_OR_NAME",
        help="an AutoModelForCausalLM directory (or cached name) with its tokenizer (--task reward: a reward model's; "
        "rows with images: an AutoModelForImageTextToText with its processor)",
    )
    p.add_argument(
        "--data",
        "--data-path",
        dest="data",
        required=True,
        metavar="FILE",
        help="jsonl rows: context/endings/label (multiple choice), text (perplexity), prompt/chosen/rejected (reward); "
        "with images (multiple choice, or chats for perplexity): a vision-language model's",
    )
    p.add_argument("--task", choices=tuple(TASK_FIELDS), default=None, help="default: from the rows' fields")
    p.add_argument(
        "--seq-length", type=int, default=None, help="maximum tokens per forward (default: the model's, as lm-eval)"
    )
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per rank per forward pass")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (log-probabilities still in float32)")
    p.add_argument(
        "--no-chunked-loss",
        action="store_true",
        help="score through the whole logits (default: the output layer a chunk of tokens at a time, where it serves)",
    )
    p.add_argument("--output", default=None, metavar="FILE", help="also write the results to this JSON file")
    p.add_argument(
        "--scores",
        default=None,
        metavar="FILE",
        help="--task reward: also write each scored pair's rewards, one JSON line per row (row, chosen, rejected)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output or --scores file")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes sharing the items (default: visible GPUs, else 1)"
    )
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    for flag in ("seq_length", "micro_batch_size", "nproc_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: give a positive number")
    for flag, path in (("--output", args.output), ("--scores", args.scores)):
        if path and os.path.exists(path) and not args.overwrite:
            raise ConfigError(f"{flag} {path} exists; give --overwrite to replace it, or another path")
    return args


def write_results(path: str, results: dict[str, Any] | list[dict[str, Any]], flag: str = "--output") -> None:
    """Write ``results`` (a JSON object, or a list written as JSON lines) through a temporary file in the same
    directory and rename it: a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            if isinstance(results, list):
                f.writelines(json.dumps(line) + "\n" for line in results)
            else:
                json.dump(results, f, indent=2)
                f.write("\n")
        os.replace(temporary, path)
    except OSError as e:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


def _warm(model: str) -> None:
    """What the workers import, imported once in a launcher that forks them (``--start-method`` auto)."""
    import rapidlite.evaluation.scoring  # noqa: F401
    from rapidlite.runtime.forked_workers import warm_imports

    warm_imports(model)


def run(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    task, items = load_eval_data(args.data, args.task)  # bad data fails here, before any worker starts
    if args.scores and task != REWARD:
        raise ConfigError(f"--scores: each pair's rewards are written for --task reward, not {task}; drop --scores")

    from rapidlite.runtime.launcher import launch, needs_launch

    # One data-parallel group on this node: the launch settings other than the process count keep their defaults.
    parallel = ParallelConfig(nproc_per_node=args.nproc_per_node)
    if needs_launch(parallel):
        return launch(parallel, "rapidlite.cli.evaluate", list(argv), module=True, warm=lambda: _warm(args.model))

    from rapidlite.config.topology import Topology
    from rapidlite.evaluation.scoring import evaluate, load_reward_scorer, load_scorer
    from rapidlite.runtime.distributed import init_distributed
    from rapidlite.runtime.world import target_world_size

    ctx = init_distributed(Topology.split(target_world_size(parallel)), parallel)
    from rapidlite.evaluation import vision

    per_pair: list | None = [] if args.scores else None
    if vision.has_image_items(items):  # rows with images: a vision-language model and its processor
        scorer = vision.load_vision_scorer(
            args.model, args.data, args.seq_length, args.micro_batch_size, args.bf16, ctx.device
        )
        scorer.chunked = not args.no_chunked_loss
        results = vision.evaluate(scorer, task, items, ctx if ctx.initialized else None)
    else:
        load = load_reward_scorer if task == REWARD else load_scorer
        scorer = load(args.model, args.seq_length, args.micro_batch_size, args.bf16, ctx.device)
        scorer.chunked = not args.no_chunked_loss
        results = evaluate(scorer, task, items, ctx if ctx.initialized else None, per_pair)
    if ctx.is_main_process:
        results = {**results, "model": args.model, "data": args.data, "world_size": ctx.world_size}
        print(json.dumps(results), flush=True)
        if args.output:
            write_results(args.output, results)
        if args.scores:
            write_results(args.scores, per_pair, "--scores")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(run, argv)


if __name__ == "__main__":
    sys.exit(main())
