"""Reward functions for online RL (``--reward-funcs``), with TRL's calling convention.

A SPEC is one of:

- ``path/to/file.py:function`` (the file is imported by path, so it needs no package);
- ``package.module:function`` (imported as a module: installed, or on ``PYTHONPATH``);
- a directory holding a sequence-classification model with one label (a ``--task reward_model`` run's ``hf/``
  export): it scores each prompt followed by its completion, conversations through the tokenizer's chat template,
  as TRL's ``GRPOTrainer`` scores with a reward model.

A function is called as TRL calls it: ``f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
log_metric=..., log_extra=..., **columns)``, where ``columns`` are the data's other columns (one value per
completion, repeated over a prompt's generations). It returns one reward per completion: a number, or None for
"no reward from this function" (TRL's convention). A function without ``**kwargs`` is refused when it is loaded;
one that raises, or returns the wrong number or kind of values, stops the run in one line naming it and the first
bad sample, with its own frames under that line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapidlite.errors import ConfigError, DataError

SPEC_HELP = "file.py:function, package.module:function, or a directory with a one-label reward model"


@dataclass
class TrainerState:
    """What a reward function reads as ``trainer_state`` (TRL passes its ``TrainerState``): the optimizer steps
    done, the run's total and the epochs read."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardFunction:
    """A loaded reward: its ``name`` (the function's, or the model directory's; the metrics' ``rewards/<name>``), the
    SPEC it came from, and the callable (TRL's signature; a reward model is wrapped into one)."""

    name: str
    spec: str
    call: Callable[..., Sequence[Any]]
    source_file: str | None = None  # the file whose frames a failure shows
    extra: dict[str, list[Any]] = field(default_factory=dict)


def _load_callable(spec: str) -> tuple[Callable[..., Any], str | None]:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"--reward-funcs {spec}: not a SPEC; give {SPEC_HELP}")
    if target.endswith(".py") or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"--reward-funcs {spec}: no file {path}; give the path of the .py file that defines {name}"
            )
        module_name = f"rapidlite_reward_{path.stem}_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # the user's file: its own error, with its frames
            del sys.modules[module_name]
            raise ConfigError(
                f"--reward-funcs {spec}: importing {path} raised {type(e).__name__}: {e}\n{_own_frames(e, str(path))}"
            ) from None
        source = str(path.resolve())
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"--reward-funcs {spec}: no module {e.name!r}; give file.py:function, or install the module or put "
                "it on PYTHONPATH"
            ) from None
        source = getattr(module, "__file__", None)
    function = getattr(module, name, None)
    if function is None or not callable(function):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ConfigError(
            f"--reward-funcs {spec}: {target} has no function {name!r}"
            + (f"; it has {', '.join(found)}" if found else "")
        )
    return function, source


def _check_signature(function: Callable[..., Any], spec: str) -> None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or C callable: its call shows what it accepts
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ConfigError(
            f"--reward-funcs {spec}: the function takes no **kwargs; write it with TRL's signature, "
            "def f(prompts, completions, completion_ids, **kwargs) (kwargs: the data's other columns)"
        )


def load_reward_functions(specs: Sequence[str]) -> list[RewardFunction]:
    """The reward functions of ``--reward-funcs``, loaded and checked (one line for a SPEC that is not one)."""
    if not specs:
        raise ConfigError(f"--reward-funcs: give at least one reward ({SPEC_HELP})")
    out = []
    for spec in specs:
        if os.path.isdir(spec):
            out.append(RewardFunction(Path(spec).resolve().name, spec, RewardModel(spec)))
            continue
        function, source = _load_callable(spec)
        _check_signature(function, spec)
        out.append(RewardFunction(getattr(function, "__name__", spec.rpartition(":")[2]), spec, function, source))
    names = [f.name for f in out]
    if len(set(names)) < len(names):
        taken = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            f"--reward-funcs: two rewards are named {', '.join(taken)}; their metrics would mix, rename one"
        )
    return out


def reward_weights(weights: Sequence[float] | None, functions: Sequence[RewardFunction]) -> list[float]:
    """``--reward-weights``, one per function (default: all 1)."""
    if weights is None:
        return [1.0] * len(functions)
    if len(weights) != len(functions):
        raise ConfigError(
            f"--reward-weights: {len(weights)} weights for {len(functions)} reward functions; give one per function"
        )
    return [float(w) for w in weights]


def _own_frames(error: BaseException, source: str | None) -> str:
    """The traceback frames of ``error`` in the user's file ``source`` (all frames when it is unknown)."""
    frames = traceback.extract_tb(error.__traceback__)
    if source is not None:
        mine = [f for f in frames if os.path.realpath(f.filename) == os.path.realpath(source)]
        frames = traceback.StackSummary.from_list(mine or frames)
    return "".join(traceback.format_list(frames)).rstrip()


def _sample(prompts: Sequence[Any], completions: Sequence[Any], i: int) -> str:
    def short(x: Any) -> str:
        text = x if isinstance(x, str) else repr(x)
        return repr(text if len(text) <= 60 else text[:57] + "...")

    return f"sample {i} (prompt {short(prompts[i])}, completion {short(completions[i])})"


def score(
    functions: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, list[Any]],
    state: TrainerState,
    log_metric: Callable[[str, float], None],
) -> list[list[float]]:
    """Every function's rewards for the completions: ``[completion][function]``, NaN where a function gave None.
    A function that raises, returns other than one number or None per completion, is a ``DataError`` naming it."""
    n = len(completions)
    table = [[math.nan] * len(functions) for _ in range(n)]
    for j, function in enumerate(functions):
        function.extra.clear()

        def log_extra(column: str, values: list[Any], _f: RewardFunction = function) -> None:
            _f.extra[column] = list(values)

        kwargs = dict(columns, trainer_state=state, log_metric=log_metric, log_extra=log_extra)
        try:
            rewards = function.call(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        except Exception as e:
            raise DataError(
                f"reward function {function.name} ({function.spec}) raised {type(e).__name__}: {e}; fix the function"
                f"\n{_own_frames(e, function.source_file)}"
            ) from None
        try:
            rewards = list(rewards)
        except TypeError:
            raise DataError(
                f"reward function {function.name} ({function.spec}) returned {type(rewards).__name__}, not a list of "
                f"{n} rewards (a number or None per completion)"
            ) from None
        if len(rewards) != n:
            raise DataError(
                f"reward function {function.name} ({function.spec}) returned {len(rewards)} rewards for {n} "
                "completions; return one per completion (None: no reward)"
            )
        for i, reward in enumerate(rewards):
            if reward is None:
                continue
            try:
                if isinstance(reward, str | bytes):
                    raise TypeError
                table[i][j] = float(reward)  # numbers, bools, numpy and 0-d torch values
            except (TypeError, ValueError):
                raise DataError(
                    f"reward function {function.name} ({function.spec}) returned {reward!r} for "
                    f"{_sample(prompts, completions, i)}; return a number or None"
                ) from None
    return table


class RewardModel:
    """A one-label sequence-classification model as a reward function: each prompt followed by its completion
    (conversations: prompt and completion messages through the chat template), right-padded, no special tokens
    added, scored by the label's logit (TRL's ``GRPOTrainer._calculate_rewards``). Loaded at its first call, on
    the policy's device."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = "cpu"
        self.__name__ = Path(directory).resolve().name

    def load(self, device: Any = "cpu") -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        config = AutoConfig.from_pretrained(self.directory)
        if getattr(config, "num_labels", None) != 1:
            raise ConfigError(
                f"--reward-funcs {self.directory}: a reward model has one label, this one has "
                f"{getattr(config, 'num_labels', '?')}; give a --task reward_model export"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.directory).to(device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        import torch

        if self.model is None:
            self.load()
        if prompts and not isinstance(prompts[0], str):
            texts = [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in inputs.items()}).logits[:, 0]
        return logits.float().cpu().tolist()
