"""Entry point ``rapidlite``: a black-box task (``--task``) or a user's trainer script (``--user-script``)."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from rapidlite.errors import RapidliteError


def _fail(error: RapidliteError) -> int:
    sys.stdout.flush()
    print(f"rapidlite: error: {error}", file=sys.stderr, flush=True)
    return error.exit_code


def _user_script(argv: list[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--user-script", default=None)
    known, _ = pre.parse_known_args(argv)
    return known.user_script


def run_user_script(script: str, argv: list[str]) -> int:
    """Run the script as ``__main__`` with the flags in ``sys.argv``; its engine parses them (and its own)."""
    if not os.path.isfile(script):
        raise RapidliteError(f"--user-script {script}: file not found")
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def run_task(argv: list[str]) -> int:
    # Flags are parsed (and --help answered) before the heavy task modules are imported.
    from rapidlite.arguments import parse_args
    from rapidlite.tasks import demo

    if "--demo" in argv:
        argv = [*demo.DEMO_ARGS, *argv]
    args = parse_args(argv)
    if args.demo:
        demo.prepare_demo(args)

    from rapidlite.engine import RapidliteEngine
    from rapidlite.tasks.sequence_classification import SequenceClassificationFinetuner

    tasks = {"sequence_classification": SequenceClassificationFinetuner}
    trainer = tasks[args.task](engine=RapidliteEngine(args=args))
    metrics = trainer.train()
    if metrics:
        shown = {k: v for k, v in metrics.items() if k != "split"}
        trainer.logger.info(
            "final validation: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        script = _user_script(argv)
        if script is not None:
            return run_user_script(script, argv)
        return run_task(argv)
    except RapidliteError as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("rapidlite: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
