"""``--save`` and ``--load`` before anything runs: a directory that can be written and is not another run's, a
checkpoint that exists (or a Hugging Face model to start from), a restarted worker group's resume."""

from __future__ import annotations

import argparse
import os

from rapidlite.config.tasks import get_task
from rapidlite.errors import ConfigError
from rapidlite.runtime.environ import env_int
from rapidlite.runtime.paths import check_writable_dir


def resolve_load(args: argparse.Namespace) -> list[str]:
    """``--load``: a checkpoint to resume (checked now, before any loading), or, as on Rapidformer's page, a
    Hugging Face model directory that a fine-tuning job loads with ``from_pretrained(args.load)``
    (``args.load_is_pretrained_model``: nothing is resumed).

    ``--save D --load D`` with no checkpoint in ``D`` yet (or no ``D``) starts fresh, so one command both starts
    and resumes a requeued job; ``--load D`` alone still has to exist (a mistyped path must not start over). A
    worker group restarted by ``--max-restarts`` resumes from ``--save``'s latest checkpoint."""
    args.load_is_pretrained_model = False
    notices = _resume_restarted_attempt(args)
    if args.load is None:
        return notices
    from rapidlite.checkpoint.layout import is_pretrained_model_dir  # torch: not for a run that loads nothing
    from rapidlite.checkpoint.selection import check_loadable

    if _same_dir(args.load, args.save) and not args.finetune and _no_checkpoint_yet(args.load):
        where = "does not exist yet" if not os.path.exists(args.load) else "holds no checkpoint yet"
        args.load = None
        return [f"--load {args.save} {where}: starting fresh (the same command resumes from its checkpoints)"]
    if not is_pretrained_model_dir(args.load):
        check_loadable(args.load)  # nothing to resume fails here; verifying waits for the load
        return notices
    args.load_is_pretrained_model = True
    if args.user_script is not None:
        return notices
    model = args.pretrained_model_name_or_path
    task = get_task(args.task) if args.task is not None else None
    if task is not None and task.load_model_dir and model in (None, args.load):
        args.pretrained_model_name_or_path = args.load
        return notices
    from_config = task is not None and task.from_config  # it starts from a config unless asked for the weights
    hint = "--pretrained-model-name-or-path DIR" + (" --load-pretrained-weights" if from_config else "")
    raise ConfigError(
        f"--load {args.load} holds a Hugging Face model, not a rapidlite checkpoint (no 'latest'): start from it "
        f"with {hint}; --load resumes a --save directory"
    )


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _no_checkpoint_yet(path: str) -> bool:
    """No directory, or an empty start of one: no 'latest', no iter_* and no Hugging Face model (a crash during
    the first save leaves only a .tmp_ directory, which is never loaded)."""
    from rapidlite.checkpoint.layout import LATEST_FILE, is_pretrained_model_dir

    if not os.path.exists(path):
        return True
    if not os.path.isdir(path) or is_pretrained_model_dir(path):
        return False
    return not os.path.exists(os.path.join(path, LATEST_FILE)) and not any(
        name.startswith("iter_") for name in os.listdir(path)
    )


def _resume_restarted_attempt(args: argparse.Namespace) -> list[str]:
    """In a worker group that torchrun restarted (``--max-restarts``; TORCHELASTIC_RESTART_COUNT > 0): resume
    from ``--save``'s latest checkpoint, whatever ``--load`` said for the first attempt."""
    attempt = env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if not attempt:
        return []
    from rapidlite.checkpoint.layout import LATEST_FILE, is_pretrained_model_dir

    restarted = f"restarted attempt {attempt} (--max-restarts)"
    if args.save is None or not os.path.isfile(os.path.join(args.save, LATEST_FILE)):
        why = "no --save" if args.save is None else f"no checkpoint in {args.save} yet"
        return [f"{restarted}: {why}, so training starts again from iteration 0"]
    if args.load is not None and not _same_dir(args.load, args.save) and is_pretrained_model_dir(args.load):
        return [
            f"{restarted}: --load {args.load} is the Hugging Face model the run starts from, so training starts "
            f"again from it; to resume instead, pass it as --pretrained-model-name-or-path with --load {args.save}"
        ]
    args.load, args.finetune = args.save, False
    return [f"{restarted}: resuming from the latest checkpoint in {args.save}"]


def _refuse_inside_an_export(given: str, save: str) -> None:
    """``--save`` at or under a run's ``hf/`` export: that run's next export replaces the directory, and the export
    would hold this run's checkpoints and metrics beside the model's files."""
    path = save
    while os.path.dirname(path) != path:
        run = os.path.dirname(path)
        if os.path.basename(path) == "hf" and os.path.isdir(run):
            names = os.listdir(run)
            if any(n in ("latest", "metrics.jsonl") or n.startswith("iter_") for n in names):
                raise ConfigError(
                    f"--save {given}: lies inside the Hugging Face export of the run in {run} ({path}), which its "
                    f"next export replaces; pass a directory outside it (e.g. {run}-eval)"
                )
        path = run


def check_save_dir(args: argparse.Namespace, given_load: str | None = None) -> list[str]:
    """``--save``: a directory that can be written, and not another run's unless this one resumes it (``--load``
    the same directory) or replaces it (``--overwrite``, carried out by the trainer when the run starts).
    ``--eval-only`` only appends to ``metrics.jsonl``. Returns the notice that ``--overwrite`` was not applied
    when ``--load`` resumes the run it would have removed (a requeued job's command may carry both)."""
    args.overwrite_save = False
    if args.save is None:
        return []
    save = os.path.abspath(args.save)
    check_writable_dir("--save", args.save, "the checkpoints")
    _refuse_inside_an_export(args.save, save)
    # A worker group restarted by --max-restarts continues the run that owns the directory.
    if args.eval_only or not os.path.isdir(save) or env_int("TORCHELASTIC_RESTART_COUNT", 0):
        return []
    names = os.listdir(save)
    iterations = sorted(n for n in names if n.startswith("iter_"))
    held = [*iterations[-1:], *(n for n in ("latest", "metrics.jsonl", "hf") if n in names)]
    resumes = _same_dir(given_load, args.save) or _same_dir(args.load, args.save)
    if not held:
        return []
    if resumes:
        if args.overwrite:
            return [f"--overwrite: not applied; --load {args.save} resumes the run held there (to start over in "
                    "it, drop --load)"]  # fmt: skip
        return []
    if not args.overwrite:
        raise ConfigError(
            f"--save {args.save} holds another run ({', '.join(held)}): pass --load {args.save} to resume it, "
            "--overwrite to replace it, or a new --save directory"
        )
    args.overwrite_save = True
    return []
