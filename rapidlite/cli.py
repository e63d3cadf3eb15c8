"""Entry point ``rapidlite``: a black-box task (``--task``) or a user's trainer script (``--user-script``).

The same command runs one process or N: when more ranks are asked for than this process is, it re-runs
itself under torchrun (``rapidlite.launcher``). In a worker, failures are recorded for the launcher and
the process ends through ``distributed.shutdown``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from rapidlite.errors import ConfigError, RapidliteError


def _user_script(argv: list[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--user-script", default=None)
    known, _ = pre.parse_known_args(argv)
    return known.user_script


def run_user_script(script: str, argv: list[str]) -> int:
    """Run the script as ``__main__`` with the flags in ``sys.argv``; its engine parses them (and its own)."""
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # a script ending with sys.exit(...)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _launch_if_needed(args: argparse.Namespace, argv: list[str]) -> int | None:
    from rapidlite.launcher import launch, needs_launch

    return launch(args, "rapidlite", argv, module=True) if needs_launch(args) else None


def _embedded_default(argv: list[str]):
    """``(flags, prepare)`` of the embedded offline run this command asks for, or None: ``--task T --demo``,
    or a task that runs its embedded default without ``--data-path``."""
    from rapidlite.tasks.registry import get_task

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--task", default=None)
    pre.add_argument("--data-path", "--dataset-path", nargs="+", default=None)
    pre.add_argument("--demo", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if known.task is None:
        return None  # parse_args says what is missing
    task = get_task(known.task)
    if known.demo or (task.demo_without_data and known.data_path is None):
        return task.demo_run()
    return None


def run_task(argv: list[str]) -> int:
    # Flags are parsed (and --help answered) before the heavy task modules are imported.
    from rapidlite.arguments import parse_args
    from rapidlite.tasks.registry import get_task

    embedded = _embedded_default(argv) if "--help" not in argv and "-h" not in argv else None
    if embedded is not None:
        argv = [*embedded[0], *argv]  # flags given on the command line come later and win
    args = parse_args(argv)
    if embedded is not None:
        embedded[1](args)  # once, before any workers start
    code = _launch_if_needed(args, argv)
    if code is not None:
        return code

    from rapidlite.engine import RapidliteEngine

    trainer_class = get_task(args.task).trainer_class(args)
    trainer = trainer_class(engine=RapidliteEngine(args=args))
    metrics = trainer.train()
    if metrics:
        shown = {k: v for k, v in metrics.items() if k != "split"}
        trainer.logger.info(
            "final validation: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        )
    return 0


def _run(argv: list[str]) -> int:
    script = _user_script(argv)
    if script is None:
        return run_task(argv)
    if not os.path.isfile(script):
        raise ConfigError(f"--user-script {script}: file not found")
    from rapidlite.arguments import build_parser, mark_explicit, validate_args

    # The script may add flags of its own (extra_args_provider): its engine checks those in each worker.
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    mark_explicit(parser, argv, args)
    validate_args(args, require_task=False)
    code = _launch_if_needed(args, argv)
    return code if code is not None else run_user_script(script, argv)


def _worker_failure(e: BaseException) -> int:
    from rapidlite.distributed import report_worker_error

    return report_worker_error(e)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))  # started by torchrun
    try:
        code = _run(argv)
    except RapidliteError as e:
        code = _worker_failure(e) if worker else e.exit_code
        if not worker:
            sys.stdout.flush()
            print(f"rapidlite: error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("rapidlite: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception as e:
        if not worker:
            raise
        code = _worker_failure(e)
    if "torch" in sys.modules:  # --help and flag errors never loaded it
        from rapidlite.distributed import shutdown

        shutdown(code)  # in a worker: barrier, destroy the process group, os._exit; otherwise returns
    return code


if __name__ == "__main__":
    sys.exit(main())
