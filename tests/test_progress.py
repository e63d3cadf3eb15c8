"""Progress bars: drawn with rate and ETA on the main process's terminal, for training (loss and lr beside it),
evaluation, rapidlite-preprocess and the fine-tuning tasks' data preparation; never into a pipe or a file, never
with --no-progress or RAPIDLITE_NO_PROGRESS; the log lines stay whole lines either way."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch.nn.functional as F

from helpers import PRETRAIN, REPO, ToyFinetuner, engine
from rapidlite.cli.preprocess import main as preprocess_main
from rapidlite.data.preprocess import preprocess
from rapidlite.data.tokenizers import build_tokenizer
from rapidlite.observe.progress import hf_datasets_progress, progress_allowed, progress_bar

# A render of a bar part-way: "N/T [elapsed<remaining, rate unit/s" (tqdm's format), remaining known.
ETA = r"\[\d\d:\d\d<\d\d:\d\d, +[\d.]+ ?{unit}/s"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def on_terminal(monkeypatch, stream: io.StringIO | None = None) -> io.StringIO:
    """Standard error on a (fake) terminal, with the suite's RAPIDLITE_NO_PROGRESS lifted. Called in the test's
    body: pytest's capture sets sys.stderr again after the fixtures have run."""
    monkeypatch.delenv("RAPIDLITE_NO_PROGRESS", raising=False)
    stream = FakeTerminal() if stream is None else stream
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def on_pipe(monkeypatch) -> io.StringIO:
    return on_terminal(monkeypatch, io.StringIO())


class SlowToy(ToyFinetuner):
    """Steps slow enough (20 ms) that the bar is redrawn part-way with a rate and an ETA."""

    def run_forward_step(self, batch, model):
        time.sleep(0.02)
        return F.mse_loss(model(batch["x"]), batch["y"])


# 64 training rows in micro-batches of 8: 8 iterations; 20 validation rows: 3 batches.
TOY = ["--micro-batch-size", "8", "--epochs", "1", "--log-interval", "2", "--lr", "1e-2"]


def test_the_rule(monkeypatch):
    on_terminal(monkeypatch)
    assert progress_allowed() and not progress_allowed(enabled=False)
    monkeypatch.setenv("RAPIDLITE_NO_PROGRESS", "1")
    assert not progress_allowed()
    monkeypatch.setenv("RAPIDLITE_NO_PROGRESS", "0")
    assert progress_allowed()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress_allowed() and progress_bar(10) is None


def test_training_and_evaluation_bars_on_a_terminal(monkeypatch, capsys):
    terminal = on_terminal(monkeypatch)
    SlowToy(engine(*TOY)).train()
    bars = terminal.getvalue()
    assert re.search(r"train: +\d+%.*\| [1-7]/8 " + ETA.format(unit="it"), bars), bars[-2000:]
    assert re.search(r"train: +100%.*\| 8/8 \[.*loss=[\d.]+, lr=[\d.e-]+\]", bars), bars[-2000:]
    assert re.search(r"validation: .*\| 0/3 \[", bars)  # the evaluation's own bar
    out = capsys.readouterr().out.splitlines()
    # The log lines are whole lines above the bar (written through tqdm), one per interval.
    assert out and all(line.startswith("[rapidlite] ") for line in out), out
    assert sum(line.startswith("[rapidlite] iteration: ") for line in out) == 4


def test_no_bar_into_a_pipe_or_with_no_progress(monkeypatch, capsys):
    pipe = on_pipe(monkeypatch)
    SlowToy(engine(*TOY)).train()
    assert pipe.getvalue() == ""
    piped = capsys.readouterr().out.splitlines()

    terminal = on_terminal(monkeypatch)
    SlowToy(engine(*TOY, "--no-progress")).train()
    assert terminal.getvalue() == ""
    monkeypatch.setenv("RAPIDLITE_NO_PROGRESS", "1")
    SlowToy(engine(*TOY)).train()
    assert terminal.getvalue() == ""
    # Not noisier without a terminal: the same lines as a run without bars.
    quiet = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in piped] == [line.split(":")[0] for line in quiet[: len(piped)]]


def test_no_progress_belongs_to_one_launch():
    """A checkpoint's settings (iter_N/config.yaml) leave out --no-progress: how one terminal showed the run."""
    from rapidlite.config.files import saved_flags
    from rapidlite.config.parser import build_parser
    from rapidlite.resolve import parse_args

    args = parse_args([*TOY, "--no-progress", "--log-interval", "3"], require_task=False)
    assert args.no_progress and "no-progress" not in saved_flags(args, build_parser())
    assert saved_flags(args, build_parser())["log-interval"] == 3


# ------------------------------------------------------------------------------------------ preprocessing
@pytest.fixture
def ids_corpus(tmp_path):
    path = tmp_path / "ids.jsonl"
    with open(path, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": " ".join(str((i * 7 + j) % 90) for j in range(1 + i % 17))}) + "\n")
    return path


def test_preprocess_bar_replaces_the_progress_lines_on_a_terminal(ids_corpus, tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    preprocess(ids_corpus, tmp_path / "a", tokenizer, log_interval=500, progress=True)
    text = terminal.getvalue()
    size = os.path.getsize(ids_corpus)
    assert re.search(r"tokenizing: 100%.*\| [\d.]+k/[\d.]+k \[.*B/s, 3000 docs\]", text), text[-1500:]
    assert f"{size / 1024:.0f}" in text or f"{size / 1024:.1f}" in text  # the input's size is the total
    assert "Processed" not in text and "Wrote " in text

    terminal.seek(0), terminal.truncate()
    preprocess(ids_corpus, tmp_path / "b", tokenizer, log_interval=500, progress=False)
    text = terminal.getvalue()
    assert "tokenizing" not in text and text.count("Processed ") == 6
    assert open(f"{tmp_path}/a_text_document.bin", "rb").read() == open(f"{tmp_path}/b_text_document.bin", "rb").read()


def test_preprocess_command_no_progress_and_pipe(ids_corpus, tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    argv = ["--input", str(ids_corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert preprocess_main([*argv, "--output-prefix", str(tmp_path / "a"), "--log-interval", "1000"]) == 0
    assert "tokenizing: 100%" in terminal.getvalue() and "Processed" not in terminal.getvalue()
    terminal.seek(0), terminal.truncate()
    assert (
        preprocess_main([*argv, "--output-prefix", str(tmp_path / "b"), "--log-interval", "1000", "--no-progress"]) == 0
    )
    assert "tokenizing" not in terminal.getvalue() and terminal.getvalue().count("Processed ") == 3
    pipe = on_pipe(monkeypatch)
    assert preprocess_main([*argv, "--output-prefix", str(tmp_path / "c"), "--log-interval", "1000"]) == 0
    assert "tokenizing" not in pipe.getvalue() and pipe.getvalue().count("Processed ") == 3


# ------------------------------------------------------------------------------- fine-tuning data preparation
def test_instruction_data_bar(tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    datasets = pytest.importorskip("datasets")
    from rapidlite.data.instruction import build_instruction_data
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    texts = ["sort the words b a c", "a b c", "reverse x y", "y x"] * 10
    tok = GPT2BPETokenizer(*train_byte_level_bpe(texts, 300, tmp_path)).hf_tokenizer()
    rows = [{"prompt": texts[i], "completion": texts[i + 1]} for i in range(0, 40, 2)]
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    quiet = build_instruction_data(raw, tok, 64)
    assert terminal.getvalue() == ""
    shown = build_instruction_data(raw, tok, 64, progress=True)
    assert re.search(r"encoding train: .*\| 0/20 \[", terminal.getvalue()), terminal.getvalue()
    assert shown.train == quiet.train


def test_hf_datasets_bars_follow_the_rule(monkeypatch):
    on_pipe(monkeypatch)
    datasets = pytest.importorskip("datasets")
    datasets.enable_progress_bars()
    with hf_datasets_progress(True):  # not a terminal
        assert datasets.are_progress_bars_disabled()
    assert not datasets.are_progress_bars_disabled()
    on_terminal(monkeypatch)
    with hf_datasets_progress(True):
        assert not datasets.are_progress_bars_disabled()
    with hf_datasets_progress(False):  # another rank, or --no-progress
        assert datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the user's own choice stays
    with hf_datasets_progress(True):
        assert datasets.are_progress_bars_disabled()
    assert datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars()


def test_transformers_bars_follow_the_rule(monkeypatch):
    from transformers.utils import logging as hf_logging

    from rapidlite.observe.progress import hf_transformers_progress

    on_pipe(monkeypatch)
    assert hf_logging.is_progress_bar_enabled()
    with hf_transformers_progress(True):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    on_terminal(monkeypatch)
    with hf_transformers_progress(True):
        assert hf_logging.is_progress_bar_enabled()
    with hf_transformers_progress(False):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()


# ------------------------------------------------------------------------------------- a real terminal
def run_on_pty(argv: list[str], timeout: float = 600) -> tuple[int, str, str]:
    """Run ``argv`` with standard error on a pseudo-terminal (120 columns) and standard output into a pipe;
    returns the exit code, standard output and what the terminal received."""
    env = {k: v for k, v in os.environ.items() if k != "RAPIDLITE_NO_PROGRESS"}
    env["PYTHONPATH"] = str(REPO)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=timeout)
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_preprocess_on_a_pseudo_terminal(ids_corpus, tmp_path):
    argv = [sys.executable, "-m", "rapidlite.cli.preprocess", "--input", str(ids_corpus)]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--output-prefix", str(tmp_path / "out")]
    code, _, screen = run_on_pty(argv)
    assert code == 0, screen[-2000:]
    assert re.search(r"tokenizing: 100%\|.*\| [\d.]+k/[\d.]+k " + ETA.format(unit="[kM]?B"), screen), screen
    code, _, screen = run_on_pty([*argv, "--no-progress"])
    assert code == 0 and "tokenizing" not in screen and "Wrote " in screen


@pytest.mark.slow
def test_training_on_a_pseudo_terminal(tmp_path):
    """A PreTrainer run (examples/pretrain_custom_model.py) as a user sees it in a terminal, and with --no-progress."""
    argv = [sys.executable, PRETRAIN, "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "40"]
    argv += ["--log-interval", "10", "--eval-interval", "20", "--eval-iters", "4", "--seq-length", "16"]
    argv += ["--hidden-size", "32"]
    code, out, screen = run_on_pty([*argv, "--save", str(tmp_path / "tty")])
    assert code == 0, screen[-3000:]
    assert re.search(r"train: +\d+%.*\| \d+/40 " + ETA.format(unit="it") + r", loss=[\d.]+, lr=", screen), screen
    assert re.search(r"validation: +0%.*\| 0/4 \[", screen) and re.search(r"test: +0%.*\| 0/4 \[", screen)
    assert all(line.startswith("[rapidlite] ") for line in out.splitlines())
    code, quiet, screen = run_on_pty([*argv, "--save", str(tmp_path / "quiet"), "--no-progress"])
    assert code == 0 and screen == "" and "\r" not in quiet
    assert len(quiet.splitlines()) == len(out.splitlines())


EXPORT_SCRIPT = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
from rapidlite import Finetuner, RapidliteEngine

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return {"input_ids": torch.arange(i, i + 6) % 50}

class Trainer(Finetuner):
    def train_valid_test_datasets_provider(self):
        return Tokens(), None, None
    def model_optimizer_lr_scheduler_provider(self):
        config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
        return GPT2LMHeadModel(config), None, None
    def run_forward_step(self, batch, model):
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

Trainer(engine=RapidliteEngine(argv=sys.argv[1:])).train()
print("DeepSpeed imported:", "deepspeed" in sys.modules)
"""


def test_export_is_quiet_in_a_pipe(tmp_path):
    """The final Hugging Face export writes no bar into a pipe (save_pretrained's own), and does not load a
    library the run does not use: accelerate's unwrap in save_pretrained imports DeepSpeed where it is installed
    (1.5 s of every exporting run, and a line announcing its CPU choice)."""
    script = tmp_path / "export.py"
    script.write_text(EXPORT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RAPIDLITE_NO_PROGRESS", "DS_ACCELERATOR")}
    env["PYTHONPATH"] = str(REPO)
    argv = [sys.executable, str(script), "--micro-batch-size", "4", "--epochs", "1", "--save", str(tmp_path / "run")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported Hugging Face model" in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
    for noise in ("Writing model shards", "Setting accelerator"):
        assert noise not in proc.stdout + proc.stderr
    assert "DeepSpeed imported: False" in proc.stdout


def test_a_demo_writing_its_model_is_quiet(tmp_path):
    """The embedded demo's model is written with save_pretrained into a fresh cache, and the run's export at
    its end: neither loads DeepSpeed (accelerate's unwrap imports it where it is installed) nor prints its line
    about its accelerator."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(PYTHONPATH=str(REPO), RAPIDLITE_CACHE=str(tmp_path / "cache"))
    argv = ["--task", "sequence_classification", "--demo", "--train-iters", "1", "--save", str(tmp_path / "run")]
    code = "import sys; from rapidlite.cli.main import main; code = main(sys.argv[1:]); "
    code += "print('DeepSpeed imported:', 'deepspeed' in sys.modules); sys.exit(code)"
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "cache").is_dir() and (tmp_path / "run" / "hf" / "model.safetensors").exists()
    assert "Setting accelerator" not in proc.stdout + proc.stderr
    assert "DeepSpeed imported: False" in proc.stdout
