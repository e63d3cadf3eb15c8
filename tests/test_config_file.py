"""``--config FILE``: a YAML or JSON file of flags is the same as those flags on the command line (given, checked by
argparse, overridden by the command line), in ``rapidlite``, in user scripts and in ``python script.py``; bad files
are one line and exit code 2; every checkpoint keeps the run's settings as ``config.yaml``, which ``--config``
reads back into the same settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO, ToyFinetuner
from rapidlite import RapidliteEngine
from rapidlite.checkpoint.integrity import verify_checkpoint
from rapidlite.cli.main import main
from rapidlite.config.files import FILE_NAME, saved_flags
from rapidlite.config.parser import build_parser, parse
from rapidlite.resolve import parse_args, with_embedded_demo

ARGV = [
    "--task", "pretraining",
    "--micro-batch-size", "4",
    "--global-batch-size", "16",
    "--data-path", "a_text_document", "b_text_document",
    "--fp16",
    "--no-tf32",
    "--no-binary-head",
    "--split", "98,2,0",
    "--lr", "0.0002",
    "--min-lr", "2e-05",
    "--lr-decay-style", "cosine",
    "--optimizer", "sgd",
]  # fmt: skip

YAML = """
task: pretraining
micro-batch-size: 4          # dashes
global_batch_size: 16        # underscores
--data-path: [a_text_document, b_text_document]
fp16: true
mixed-precision: false       # a switch left off
tf32: false                  # --no-tf32
no-binary-head: true
split: [98, 2, 0]            # a list for a one-value flag: 98,2,0
lr: 2.0e-4
min-lr: 2e-5                 # YAML 1.1 reads this as text; argparse converts it as on the command line
lr-decay-style: cosine
optimizer: sgd
seq-length: null             # the default
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def flags_of(namespace) -> dict:
    return {k: v for k, v in vars(namespace).items() if k not in ("config", "explicit_flags")}


def test_a_file_is_its_flags(tmp_path):
    from_file = parse(["--config", write(tmp_path, YAML)])
    typed = parse(ARGV)
    assert flags_of(from_file) == flags_of(typed)
    # file flags are given flags (a --demo or a DeepSpeed file supplies only the others)
    assert from_file.explicit_flags == typed.explicit_flags | {"config"}  # false switches and nulls are not given


def test_json_is_read_the_same(tmp_path):
    values = yaml.safe_load(YAML)
    values["min-lr"] = 2e-5
    from_json = parse(["--config", write(tmp_path, json.dumps(values), "run.json")])
    assert flags_of(from_json) == flags_of(parse(ARGV))


def test_the_command_line_wins(tmp_path):
    config = write(tmp_path, YAML)
    for argv in (["--config", config, "--micro-batch-size", "2"], ["--micro-batch-size", "2", f"--config={config}"]):
        args = parse(argv)
        assert args.micro_batch_size == 2 and args.global_batch_size == 16
    later = write(tmp_path, "lr: 0.5\n", "later.yaml")
    assert parse(["--config", config, "--config", later]).lr == 0.5  # later files win over earlier ones


def test_file_flags_beat_the_demo_defaults(tmp_path):
    config = write(tmp_path, "task: sequence_classification\ndemo: true\nlr: 0.25\n")
    args = with_embedded_demo(parse(["--config", config]))
    assert args.lr == 0.25 and args.micro_batch_size == 32  # the demo's default where the file says nothing


BAD = [
    ("micro-bach-size: 8\n", "unknown key 'micro-bach-size': did you mean 'micro-batch-size' (--micro-batch-size)?"),
    ("lr_decay_stile: cosine\n", "unknown key 'lr_decay_stile': did you mean 'lr-decay-style'"),
    ("micro-batch-size: eight\n", "argument --micro-batch-size: invalid int value: 'eight'"),
    ("optimizer: adam\n", "argument --optimizer: invalid choice: 'adam'"),
    ("fp16: 1\n", "fp16: is a switch: expects true or false, got 1"),
    ("tf32: maybe\n", "tf32: expects true or false, got 'maybe'"),
    ("lr: true\n", "lr: expects a value, not true"),
    ("data-path: {a: 1}\n", "data-path: expects a value or a list of values, not a mapping"),
    ("- lr\n- 1\n", "expected a mapping of flag names to values"),
    ("lr: [1\n", "not valid YAML (expected ',' or ']'"),
    ("config: other.yaml\n", "config: not a setting a config file can hold"),
    ("help: true\n", "help: not a setting a config file can hold"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_a_bad_file_is_one_line_exit_2(text, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    config = write(tmp_path, text)
    assert main(["--task", "sequence_classification", "--demo", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rapidlite: error: --config {config}: ") and message in err, err
    assert "Traceback" not in err and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("missing.yaml", None, "file not found"),
        ("", None, "is a directory"),
        ("bad.json", '{"lr": }', "not valid JSON (Expecting value at line 1 column 8)"),
        ("latin1.yaml", b"lr: 0.1 # \xe9t\xe9\n", "cannot read it ("),
    ],
    ids=["missing", "directory", "malformed JSON", "not UTF-8"],
)
def test_a_missing_or_unreadable_file_is_one_line(name, text, message, tmp_path, capsys):
    config = tmp_path / name
    if isinstance(text, bytes):
        config.write_bytes(text)
    elif text is not None:
        config.write_text(text)
    assert main(["--config", str(config), "--task", "sequence_classification", "--demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config {config}: {message}" in err, err


def test_config_needs_a_file(capsys):
    assert main(["--task", "sequence_classification", "--config"]) == 2
    assert "--config needs a FILE" in capsys.readouterr().err


def test_bad_files_and_help_do_not_import_torch(tmp_path):
    bad = write(tmp_path, "micro-batch-size: eight\n")
    good = write(tmp_path, "task: sequence_classification\ndemo: true\nfp16: true\n", "good.yaml")
    code = (
        "import sys\n"
        "from rapidlite.cli.main import main\n"
        f"assert main(['--config', {bad!r}]) == 2\n"
        f"assert main(['--config', {good!r}, '--bf16']) == 2\n"  # a contradiction between the file and the line
        "try:\n"
        f"    main(['--config', {good!r}, '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--fp16 and --bf16 are exclusive" in proc.stderr and "--config FILE" in proc.stdout


SCRIPT = """
from rapidlite import RapidliteEngine

def own_flags(parser):
    parser.add_argument("--my-layers", type=int, default=1)
    parser.add_argument("--my_names", nargs="+", default=[])

engine = RapidliteEngine(extra_args_provider=own_flags)
a = engine.args
print("SETTINGS", a.my_layers, a.my_names, a.micro_batch_size, a.lr, sorted(a.explicit_flags & {"my_layers", "lr"}))
"""


def test_user_scripts_read_their_own_flags_from_the_file(tmp_path, capsys):
    script = write(tmp_path, SCRIPT, "train.py")
    config = write(tmp_path, "my-layers: 3\nmy_names: [a, b]\nmicro-batch-size: 2\nlr: 0.5\n")
    assert main(["--user-script", script, "--config", config, "--lr", "0.25"]) == 0
    assert "SETTINGS 3 ['a', 'b'] 2 0.25 ['lr', 'my_layers']" in capsys.readouterr().out
    # the script's engine checks the keys against the script's flags too
    typo = write(tmp_path, "my-layer: 3\n", "typo.yaml")
    assert main(["--user-script", script, "--config", typo]) == 2
    assert "unknown key 'my-layer': did you mean 'my-layers' (--my-layers)?" in capsys.readouterr().err


def test_python_script_with_a_config_file(tmp_path):
    script = write(tmp_path, SCRIPT, "train.py")
    config = write(tmp_path, "my-layers: 4\nmicro_batch_size: 3\n")
    proc = subprocess.run(
        [sys.executable, script, "--config", config],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SETTINGS 4 [] 3 0.0001 ['my_layers']" in proc.stdout


# ------------------------------------------------------------------------------ the settings a checkpoint keeps
TRAIN = [
    "--micro-batch-size", "8",
    "--global-batch-size", "16",
    "--epochs", "1",
    "--optimizer", "sgd",
    "--lr", "0.05",
    "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1",
    "--clip-grad", "0.5",
    "--seed", "7",
    "--text-keys", "question", "answer",
    "--no-binary-head",
    "--log-interval", "2",
]  # fmt: skip


def saved_config(save: Path) -> Path:
    return sorted(save.glob("iter_*"))[-1] / FILE_NAME


def test_a_checkpoint_keeps_the_settings_and_they_load_back(tmp_path):
    save = tmp_path / "run"
    trainer = ToyFinetuner(RapidliteEngine(argv=[*TRAIN, "--save", str(save), "--overwrite"]))
    trainer.train()
    path = saved_config(save)
    assert verify_checkpoint(path.parent) is None
    assert FILE_NAME in json.loads((path.parent / "manifest.json").read_text())["files"]  # covered by the manifest

    saved = yaml.safe_load(path.read_text())
    assert list(saved) == sorted(saved)
    assert saved["text-keys"] == ["question", "answer"] and saved["binary-head"] is False
    assert saved["save"] == str(save) and "overwrite" not in saved  # --overwrite belongs to one launch
    assert saved["global-batch-size"] == 16 and saved["lr"] == 0.05

    original = trainer.args
    again = parse_args(["--config", str(path), "--save", str(tmp_path / "again")], require_task=False)
    differing = {
        k: (getattr(original, k), getattr(again, k))
        for k in vars(original)
        if k not in ("save", "config", "explicit_flags", "overwrite", "overwrite_save")
        and getattr(original, k) != getattr(again, k)
    }
    assert differing == {}

    (path.parent / FILE_NAME).write_text(path.read_text().replace("0.05", "0.06"))
    assert verify_checkpoint(path.parent) == f"{FILE_NAME} fails its checksum"


def test_a_resume_is_not_saved_but_a_start_from_weights_is(tmp_path):
    save = tmp_path / "run"
    ToyFinetuner(RapidliteEngine(argv=[*TRAIN, "--save", str(save), "--train-iters", "2"])).train()
    resumed = ToyFinetuner(RapidliteEngine(argv=[*TRAIN, "--save", str(save), "--load", str(save)]))
    resumed.train()
    assert resumed.iteration == 4
    saved = yaml.safe_load(saved_config(save).read_text())
    assert "load" not in saved and "train-iters" not in saved

    parser = build_parser()
    finetune = parse_args(
        [*TRAIN, "--load", str(save), "--finetune", "--save", str(tmp_path / "new")], require_task=False
    )
    assert {"load": str(save), "finetune": True}.items() <= saved_flags(finetune, parser).items()


def test_a_scripts_own_flags_are_saved(tmp_path):
    def own_flags(parser):
        parser.add_argument("--my-width", type=int, default=16)

    save = tmp_path / "run"
    argv = ["--micro-batch-size", "8", "--epochs", "1", "--my-width", "24", "--save", str(save)]
    ToyFinetuner(RapidliteEngine(own_flags, argv=argv)).train()
    saved = yaml.safe_load(saved_config(save).read_text())
    assert saved["my-width"] == 24
    args = parse_args(
        ["--config", str(saved_config(save)), "--save", str(tmp_path / "b")], own_flags, require_task=False
    )
    assert args.my_width == 24 and args.epochs == 1
