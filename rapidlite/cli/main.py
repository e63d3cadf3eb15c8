"""Entry point ``rapidlite``: a black-box task (``--task``) or a user's trainer script (``--user-script``); and
the subcommands ``rapidlite env`` (``rapidlite.cli.env``), ``rapidlite plot DIR`` (``rapidlite.observe.curves``) and
``rapidlite export DIR`` (``rapidlite.cli.export``).

Each process parses its command line once and resolves it into the frozen settings (``rapidlite.resolve``);
the launcher's one decision (``launch_or_join``) then runs it here, or re-runs the same command under torchrun
when more ranks are asked for than this process is. In a worker, failures are recorded for the launcher and the
process ends through ``distributed.shutdown``. The one exception to "once": a ``--user-script`` run in this
process parses again in the script's ``RapidliteEngine()``, which alone knows the script's own flags.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rapidlite.cli.entry import end_process, run_command
from rapidlite.config.parser import parse_known
from rapidlite.errors import ConfigError, RapidliteError, first_line
from rapidlite.observe.progress import close_bars
from rapidlite.resolve import RunConfig, resolve_command
from rapidlite.runtime.launcher import launch_or_join
from rapidlite.runtime.time_budget import mark_start


def run_user_script(script: str, argv: list[str]) -> int:
    """Run the script as ``__main__`` with the flags in ``sys.argv``; its engine parses them (and its own).

    A script that ends without having created a ``RapidliteEngine`` trained nothing: one line says how to start
    its training. An exception the script raises is its own traceback, from the script's frame on (not the
    frames of rapidlite and runpy that ran it), and one line naming it (``ScriptFailed``, exit code 1)."""
    from rapidlite.engine import current_engine

    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    engine_before = current_engine()
    try:
        names = runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # a script ending with sys.exit(...)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except RapidliteError:
        raise
    except Exception as e:
        own = script_traceback(e, script)
        if own is None:
            raise
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            e.script_traceback = own  # a worker records it for the launcher, which prints one rank's
            raise
        close_bars()
        sys.stdout.flush()
        print(own, end="", file=sys.stderr, flush=True)
        hint = _missing_base(e, script)
        raise ScriptFailed(f"--user-script {script} raised {type(e).__name__}: {first_line(e)}{hint}") from None
    if current_engine() is engine_before:
        raise ConfigError(f"--user-script {script} ran but started no training: {_how_to_train(names)}")
    return 0


class ScriptFailed(RapidliteError):
    """A ``--user-script`` raised: its traceback is printed above the line, and the run ends as a crash does."""

    exit_code = 1


def _script_frames(error: BaseException, script: str) -> TracebackType | None:
    """``error``'s traceback from its first frame in ``script`` on, or None."""
    tb, path = error.__traceback__, os.path.realpath(script)
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    return tb


def script_traceback(error: BaseException, script: str) -> str | None:
    """``error``'s traceback from the first frame in ``script`` on (a syntax error in it: the offending line),
    or None when the error did not arise in the script."""
    if isinstance(error, SyntaxError) and error.filename:
        if os.path.realpath(error.filename) == os.path.realpath(script):
            return "".join(traceback.format_exception_only(error))
    tb = _script_frames(error, script)
    if tb is None:
        return None
    return "".join(traceback.format_exception(type(error), error, tb))


# The methods a Finetuner or PreTrainer subclass defines (Rapidformer's template).
TRAINER_METHODS = (
    "train_valid_test_datasets_provider",
    "model_optimizer_lr_scheduler_provider",
    "run_forward_step",
    "run_compute_metrics",
)


def _missing_base(error: BaseException, script: str) -> str:
    """For "MyFinetuner() takes no arguments": the class has a trainer's methods but no trainer base class."""
    message = str(error)
    if not isinstance(error, TypeError) or not message.endswith("() takes no arguments"):
        return ""
    name = message.removesuffix("() takes no arguments")
    tb = _script_frames(error, script)
    cls = tb.tb_frame.f_globals.get(name) if tb is not None else None
    methods = [m for m in TRAINER_METHODS if isinstance(cls, type) and m in vars(cls)]
    if not methods:
        return ""
    return (
        f"; {name} defines {', '.join(methods)} but subclasses neither Finetuner nor PreTrainer: "
        f"class {name}(Finetuner) (from rapidlite import Finetuner)"
    )


def _how_to_train(names: dict) -> str:
    """What a script that created no engine lacks: the call that trains its trainer class, or one."""
    base = sys.modules.get("rapidlite.trainer.base")
    trainers = [
        name
        for name, value in names.items()
        if base is not None and isinstance(value, type) and issubclass(value, base.BaseTrainer)
        and value.__module__ == "__main__"
    ]  # fmt: skip
    if trainers:
        return f"it defines {trainers[0]} but never runs it; end it with {trainers[0]}().train()"
    return (
        "it defines no Finetuner or PreTrainer subclass and creates no RapidliteEngine; subclass one and end "
        "the script with MyTrainer().train() (or train in a loop of your own with RapidliteEngine().compose)"
    )


def run_task(config: RunConfig, argv: list[str]) -> int:
    """``--task``: build the embedded demo's files if the run uses them, launch or join, train."""
    from rapidlite.config.tasks import get_task

    task = get_task(config.task)
    if config.demo:
        task.demo_run(config.demo).prepare()  # after every check, before any worker starts (workers find it done)
    if config.dry_run:
        return dry_run(config, argv)
    code = launch_or_join(config.sections.parallel, "rapidlite", argv, module=True, warm=lambda: _warm(config, task))
    if code is not None:
        return code

    from rapidlite.engine import RapidliteEngine

    trainer_class = task.trainer_class(config.sections)
    trainer = trainer_class(engine=RapidliteEngine(args=config))
    metrics = trainer.train()
    if metrics:
        shown = {k: v for k, v in metrics.items() if k not in ("split", "eval_only")}
        trainer.logger.info(
            ("validation (--eval-only): " if config.eval_only else "final validation: ")
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        )
    return 0


def _warm(config: RunConfig, task: Any = None) -> None:
    """What the workers import, imported once in a launcher that forks them (``--start-method``): the engine,
    the task's trainer, the model's transformers module and the run's libraries (DeepSpeed: 2-3 s a rank)."""
    import importlib

    import rapidlite.engine  # noqa: F401
    from rapidlite.config.libraries import run_libraries
    from rapidlite.runtime.forked_workers import warm_imports

    if task is not None:
        task.trainer_class(config.sections)
    warm_imports(config.sections.model.pretrained_model_name_or_path)
    for name in run_libraries(config.sections, task):
        with contextlib.suppress(ImportError):  # a missing one is the worker's one line
            importlib.import_module(name)


def dry_run(config: RunConfig, argv: list[str]) -> int:
    """``--dry-run``: the plan and memory prediction (with ``--device-profile`` the step time, with ``--search``
    the fastest layouts that fit), printed in this process; no worker starts."""
    from rapidlite.planning import plan
    from rapidlite.planning.report import format_plan

    settings = config.sections
    profile = None
    if settings.training.device_profile:  # read first: a bad profile is refused before the plan's work
        from rapidlite.planning.devices import device_profile

        profile = device_profile(settings.training.device_profile)
    the_plan = plan(settings, gpu=None if profile is None else not profile.shared_by_node)
    print(format_plan(the_plan), flush=True)
    if profile is not None:
        from rapidlite.planning.timing import format_throughput, step_time
        from rapidlite.runtime.world import nproc_per_node

        per_node = nproc_per_node(settings.parallel)
        print("\n".join(format_throughput(step_time(the_plan, profile, per_node), profile)), flush=True)
        if settings.training.search:
            from rapidlite.planning.search import format_search, search

            results = search(list(argv), settings, profile, per_node, the_plan)
            print("\n".join(format_search(results, settings.training.memory_budget)), flush=True)
    return 0


def _run(argv: list[str]) -> int:
    mark_start()  # --time-budget counts from here
    # Subcommands come before the flag parser: `rapidlite env`, `rapidlite plot DIR`, `rapidlite export DIR`.
    if argv and argv[0] == "env":
        from rapidlite.cli.env import main as env_main

        return env_main(argv[1:])
    if argv and argv[0] == "plot":
        from rapidlite.observe.curves import main as plot_main

        return plot_main(argv[1:])
    if argv and argv[0] == "export":
        from rapidlite.cli.export import main as export_main

        return export_main(argv[1:])
    # Parsed once, and --help answered, before the heavy task modules are imported. A user script may declare
    # flags of its own (extra_args_provider): its engine parses the command line with them when it starts.
    namespace, unknown = parse_known(argv)
    script = namespace.user_script
    if script is None:
        if unknown:
            raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (see 'rapidlite --help')")
        return run_task(resolve_command(namespace), argv)
    # The flags rapidlite knows are checked here, before any worker starts.
    config = resolve_command(namespace)
    if config.dry_run:
        return dry_run(config, argv)
    code = launch_or_join(config.sections.parallel, "rapidlite", argv, module=True, warm=lambda: _warm(config))
    return code if code is not None else run_user_script(script, argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_run, argv)


def console() -> None:
    """The ``rapidlite`` command (and ``python -m rapidlite``)."""
    end_process(main())


if __name__ == "__main__":
    console()
