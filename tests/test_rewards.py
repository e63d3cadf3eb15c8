"""Reward functions for online RL (rapidlite.tasks.rewards): loading a SPEC, TRL's calling convention, and one
line naming the function and the sample for every way a function can go wrong."""

from __future__ import annotations

import math

import pytest

from rapidlite.errors import ConfigError, DataError
from rapidlite.tasks.rewards import TrainerState, load_reward_functions, reward_weights, score

REWARDS = """
def exact(prompts, completions, completion_ids, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def length(completions, trainer_state, log_metric, **kwargs):
    log_metric("length/seen", float(len(completions)))
    return [None if not c else len(c) / (1 + trainer_state.global_step) for c in completions]


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def raises(completions, **kwargs):
    return [1 / len(c) for c in completions]


def short(completions, **kwargs):
    return [1.0]


def text(completions, **kwargs):
    return ["1.0" for _ in completions]


def correct(completions, **kwargs):
    return [c == "4" for c in completions]
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def _score(functions, completions, answer=None):
    metrics = {}
    prompts = ["1+3=", "2+2="][: len(completions)]
    table = score(
        functions, prompts, completions, [[1]] * len(completions), {"answer": answer or ["4"] * len(completions)},
        TrainerState(global_step=1), lambda name, value: metrics.__setitem__(name, value),
    )  # fmt: skip
    return table, metrics


def test_functions_are_called_as_trl_calls_them(rewards_file):
    """The data's other columns arrive by name, ``trainer_state`` and ``log_metric`` are there, None is no
    reward (NaN), bools are numbers."""
    functions = load_reward_functions([f"{rewards_file}:exact", f"{rewards_file}:length", f"{rewards_file}:correct"])
    assert [f.name for f in functions] == ["exact", "length", "correct"]
    table, metrics = _score(functions, ["4", ""], answer=["4", "4"])
    assert table[0] == [1.0, 0.5, 1.0]
    assert table[1][0] == 0.0 and math.isnan(table[1][1]) and table[1][2] == 0.0
    assert metrics == {"length/seen": 2.0}
    assert reward_weights(None, functions) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="2 weights for 3 reward functions"):
        reward_weights([1.0, 2.0], functions)


def test_a_module_spec_imports_the_module(tmp_path, monkeypatch):
    (tmp_path / "pkg_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (function,) = load_reward_functions(["pkg_rewards:exact"])
    assert _score([function], ["4"])[0] == [[1.0]]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("{file}", "not a SPEC; give file.py:function"),
        ("{dir}/missing.py:f", "no file"),
        ("no_such_module_xyz:f", "no module 'no_such_module_xyz'"),
        ("{file}:nothing", "has no function 'nothing'; it has correct, exact, length"),
        ("{file}:no_kwargs", "takes no **kwargs; write it with TRL's signature"),
    ],
)
def test_a_bad_spec_is_one_line(rewards_file, spec, message):
    with pytest.raises(ConfigError) as caught:
        load_reward_functions([spec.format(file=rewards_file, dir=rewards_file.parent)])
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_two_rewards_of_one_name_are_refused(rewards_file):
    with pytest.raises(ConfigError, match="two rewards are named exact"):
        load_reward_functions([f"{rewards_file}:exact", f"{rewards_file}:exact"])


@pytest.mark.parametrize(
    "name,message",
    [
        ("raises", "reward function raises ({spec}) raised ZeroDivisionError: division by zero; fix the function"),
        ("short", "reward function short ({spec}) returned 1 rewards for 2 completions"),
        ("text", "reward function text ({spec}) returned '1.0' for sample 0 (prompt '1+3=', completion '4')"),
    ],
)
def test_a_failing_function_is_named_with_its_sample_and_its_own_frames(rewards_file, name, message):
    spec = f"{rewards_file}:{name}"
    (function,) = load_reward_functions([spec])
    with pytest.raises(DataError) as caught:
        _score([function], ["4", ""])
    first, *frames = str(caught.value).splitlines()
    assert first.startswith(message.format(spec=spec)), first
    if name == "raises":  # the user's frames under the line, and no frame of rapidlite's
        files = [line for line in frames if line.lstrip().startswith("File ")]
        assert files and all(line.strip().startswith(f'File "{rewards_file}"') for line in files), frames
        assert f'File "{rewards_file}", line 16, in raises' in str(caught.value)


def test_an_import_error_in_the_file_shows_its_frames(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import math\nvalue = 1 / 0\n")
    with pytest.raises(ConfigError) as caught:
        load_reward_functions([f"{path}:f"])
    assert str(caught.value).startswith(f"--reward-funcs {path}:f: importing {path} raised ZeroDivisionError")
    assert f'File "{path}", line 2' in str(caught.value)
