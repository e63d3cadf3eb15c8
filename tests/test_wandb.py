"""``--wandb-project``: every metrics record and the resolved settings reach a Weights & Biases run (offline here:
no network), the run is finished with the process's outcome, a resumed run continues it, and only rank 0 reports.
The offline run is read back from its ``.wandb`` file: LevelDB's log format holding W&B's protobuf records."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DP_COMMON, DP_ONE, DP_TWO, REPO, ToyFinetuner, engine, rapidlite, read_metrics
from rapidlite.cli.main import main
from rapidlite.errors import ConfigError, TrainingDiverged
from rapidlite.runtime.preemption import EXIT_CODE

TOY = ["--micro-batch-size", "8", "--epochs", "2", "--log-interval", "2", "--lr", "0.01"]


# ------------------------------------------------------------------------------ reading an offline run back
def _log_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB's log
    format: 32 KiB blocks of chunks (crc32, length, type: full, first, middle, last)."""
    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, path
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk the writer has not finished
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
        else:
            break  # zero padding at the end of the file
    return records


def read_offline_run(run_dir: Path, timeout: float = 30) -> dict:
    """``{"id", "project", "name", "start", "config", "history", "exit_code"}`` of one offline run directory. W&B's
    service process writes the file on its own time after ``finish`` returns: read until the exit record is in
    (a record caught half-written does not parse yet)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            run = _parse_offline_run(run_dir)
        except DecodeError:
            if time.monotonic() > deadline:
                raise
            run = {"exit_code": None}
        if run["exit_code"] is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _parse_offline_run(run_dir: Path) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("run-*.wandb")
    out: dict = {"history": [], "config": {}, "exit_code": None, "start": 0.0}
    for raw in _log_records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            out["start"] = record.run.start_time.seconds + record.run.start_time.nanos / 1e9
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def offline_runs(root: Path) -> list[dict]:
    """Every offline run under ``root`` (``read_offline_run``), the first started first."""
    return sorted((read_offline_run(d) for d in (root / "wandb").glob("offline-run-*")), key=lambda r: r["start"])


def train_losses(rows: list[dict], key: str = "loss") -> dict[int, float]:
    return {r["iteration"]: r[key] for r in rows if "split" not in r and key in r}


# ------------------------------------------------------------------------------ tests
def test_every_record_and_the_settings_reach_an_offline_run(tmp_path, wandb_dir):
    save = tmp_path / "run"
    name = ["--wandb-project", "rapidlite-test", "--wandb-run-name", "toy"]
    ToyFinetuner(engine(*TOY, "--save", str(save), *name)).train()
    (run,) = offline_runs(wandb_dir)
    assert (run["project"], run["name"], run["exit_code"]) == ("rapidlite-test", "toy", 0)

    records = read_metrics(save)
    history = run["history"]
    wandb_train = {r["iteration"]: r["train/loss"] for r in history if "train/loss" in r}
    assert wandb_train == train_losses(records) and sorted(wandb_train) == [2, 4, 6, 8, 10, 12, 14, 16]
    for key in ("lr", "grad_norm", "consumed_samples"):
        assert {r["iteration"]: r[f"train/{key}"] for r in history if "train/loss" in r} == train_losses(records, key)
    validation = {r["iteration"]: r["loss"] for r in records if r.get("split") == "validation"}
    assert {r["iteration"]: r["validation/loss"] for r in history if "validation/loss" in r} == validation
    (state,) = [r for r in records if r.get("split") == "model_state"]
    assert any(r.get("model_state/param_bytes") == state["param_bytes"] for r in history)

    config = run["config"]
    assert config["micro_batch_size"] == 8 and config["lr"] == 0.01 and config["epochs"] == 2
    assert config["wandb_project"] == "rapidlite-test" and config["save"] == str(save)
    assert config["global_batch_size"] == 8 and config["gradient_accumulation_steps"] == 1  # resolved values too
    checkpoint = next(save.glob("iter_*"))
    import torch

    assert torch.load(checkpoint / "state.pt", weights_only=True)["wandb_run_id"] == run["id"]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_dir):
    save = tmp_path / "run"
    argv = [*TOY, "--save", str(save), "--wandb-project", "rapidlite-test"]
    ToyFinetuner(engine(*argv, "--train-iters", "6")).train()
    ToyFinetuner(engine(*argv, "--load", str(save))).train()
    first, second = offline_runs(wandb_dir)
    assert first["id"] == second["id"]
    assert sorted(r["iteration"] for r in second["history"] if "train/loss" in r) == [8, 10, 12, 14, 16]
    assert first["exit_code"] == second["exit_code"] == 0

    ToyFinetuner(engine(*argv, "--load", str(save), "--finetune", "--save", str(tmp_path / "new"))).train()
    assert offline_runs(wandb_dir)[-1]["id"] != first["id"]  # --finetune starts a new run


class Diverging(ToyFinetuner):
    def run_forward_step(self, batch, model):
        loss = super().run_forward_step(batch, model)
        return loss * float("nan") if self.iteration >= 3 else loss


def test_a_failed_run_is_finished_with_its_exit_code(tmp_path, wandb_dir):
    with pytest.raises(TrainingDiverged):
        Diverging(engine(*TOY, "--max-skipped-steps", "2", "--wandb-project", "rapidlite-test")).train()
    (run,) = offline_runs(wandb_dir)
    assert run["exit_code"] == TrainingDiverged.exit_code
    assert sorted(r["iteration"] for r in run["history"] if "train/loss" in r) == [2]


def test_a_tracker_that_cannot_start_is_one_error(tmp_path, wandb_dir, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match=r"could not start the run \(api_key not configured.*wandb login"):
        ToyFinetuner(engine(*TOY, "--wandb-project", "p", "--wandb-mode", "online")).train()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--wandb-project", "p"], "--wandb-project reports to Weights & Biases, which is not installed: "),
        (["--wandb-run-name", "x"], "--wandb-run-name configures Weights & Biases reporting: add --wandb-project"),
        (["--wandb-mode", "sometimes"], "argument --wandb-mode: invalid choice"),
    ],
)
def test_refused_up_front(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as far as importlib can tell
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    assert main(["--task", "sequence_classification", "--demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    if "installed" in message:
        assert "pip install 'rapidlite[wandb]'" in err
    assert not (tmp_path / "cache").exists()


@pytest.mark.distributed
def test_two_ranks_report_once(tmp_path, wandb_dir):
    """Only rank 0 starts a W&B run; the launcher re-runs the command (with its --config file) in each worker, and
    the run ends without waiting on W&B's service process."""
    save = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("wandb-project: rapidlite-test\ntrain-iters: 4\nseed: 5\n")
    env = {k: v for k, v in os.environ.items() if k.startswith("WANDB")}
    proc = rapidlite(
        "--user-script", str(REPO / "examples" / "pretrain_custom_model.py"), "--config", str(config),
        *DP_COMMON, *DP_TWO, "--save", str(save), env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = offline_runs(wandb_dir)
    assert run["exit_code"] == 0 and run["config"]["world_size"] == 2 and run["config"]["seed"] == 5
    wandb_train = {r["iteration"]: r["train/loss"] for r in run["history"] if "train/loss" in r}
    assert wandb_train == train_losses(read_metrics(save)) and sorted(wandb_train) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_preempted_run_is_finished_and_the_same_command_continues_it(tmp_path, wandb_dir):
    """SIGTERM: the run stops with a checkpoint and exit code 143, its W&B run is finished with that code (marked
    preempting), and the same command resumes into the same W&B run."""
    save = tmp_path / "run"
    argv = [sys.executable, "-m", "rapidlite", "--user-script", str(REPO / "tests" / "scripts" / "preemptible.py")]
    argv += [*DP_COMMON, *DP_ONE, "--train-iters", "12", "--save", str(save), "--load", str(save)]
    argv += ["--wandb-project", "rapidlite-test"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "STEP_SLEEP": "0.1"}
    )
    for line in proc.stdout:
        if "iteration: 4 |" in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_CODE, err[-3000:]
    resumed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    first, second = offline_runs(wandb_dir)
    assert (first["exit_code"], second["exit_code"]) == (EXIT_CODE, 0) and first["id"] == second["id"]
    stopped = max(r["iteration"] for r in first["history"] if "train/loss" in r)
    assert min(r["iteration"] for r in second["history"] if "train/loss" in r) == stopped + 1
    assert {r["iteration"]: r["train/loss"] for r in second["history"] if "train/loss" in r} == {
        i: loss for i, loss in train_losses(read_metrics(save)).items() if i > stopped
    }
