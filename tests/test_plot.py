"""curves.png: drawn from metrics.jsonl at the end of a --save run and by `rapidlite plot DIR`; the series drawn are
the records (resumed attempts supersede what they redo, NaN is a gap); without matplotlib one line, never a failed
run."""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from pathlib import Path

import pytest

from helpers import ToyFinetuner, engine, read_metrics
from rapidlite.cli.main import main
from rapidlite.observe.curves import CURVES_FILE, figure_of, read_curves, write_curves
from rapidlite.observe.logging import MetricsWriter

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def train_record(iteration, loss, lr, tokens=1000.0):
    return {"iteration": iteration, "consumed_samples": 8 * iteration, "loss": loss, "lr": lr, "tokens_per_s": tokens}


def write_two_attempts(save_dir):
    """The first attempt logs to iteration 8 and is killed after its checkpoint at 6; the resumed attempt redoes 7-8
    and finishes at 10; then an --eval-only run appends its score."""
    first = MetricsWriter(str(save_dir), None, run_id="first")
    first.write({"split": "model_state", "iteration": 1, "param_bytes": 10})
    for it, loss in ((2, 4.0), (4, float("nan")), (6, 3.0), (8, 2.9)):
        first.write(train_record(it, loss, 1e-3 * it, 900.0 + it))
    first.write({"split": "validation", "iteration": 5, "loss": 3.5, "accuracy": 0.5})
    first.close()
    resumed = MetricsWriter(str(save_dir), None, run_id="resumed")
    resumed.write({"split": "model_state", "iteration": 7, "param_bytes": 10})
    for it, loss in ((8, 2.5), (10, 2.0)):
        resumed.write(train_record(it, loss, 5e-4, 1100.0))
    resumed.write({"split": "validation", "iteration": 10, "loss": 2.2})
    resumed.write({"split": "test", "iteration": 10, "loss": 2.3})
    resumed.close()
    evaluation = MetricsWriter(str(save_dir), None, run_id="eval")
    evaluation.write({"split": "validation", "iteration": 10, "loss": 2.2, "eval_only": True})
    evaluation.close()
    with open(save_dir / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 12, "loss"')  # the torn last line of a killed run


def test_the_series_are_the_records_of_the_run_as_it_stands(tmp_path):
    write_two_attempts(tmp_path)
    curves = read_curves(tmp_path)
    assert curves.train_loss.x == [2, 4, 6, 8, 10]
    assert curves.train_loss.y[:3:2] == [4.0, 3.0] and math.isnan(curves.train_loss.y[1])  # NaN written as null
    assert curves.train_loss.y[3:] == [2.5, 2.0]  # the resumed attempt's iteration 8, not the lost one
    assert curves.lr.x == curves.train_loss.x and curves.lr.y == [2e-3, 4e-3, 6e-3, 5e-4, 5e-4]
    assert curves.throughput_key == "tokens_per_s" and curves.throughput.y == [902.0, 904.0, 906.0, 1100.0, 1100.0]
    assert (curves.validation_loss.x, curves.validation_loss.y) == ([5, 10, 10], [3.5, 2.2, 2.2])
    assert (curves.test_loss.x, curves.test_loss.y) == ([10], [2.3])
    assert curves.resumed_at == [7] and curves.run_ids == ["first", "resumed", "eval"]


def test_the_figure_draws_the_series(tmp_path):
    write_two_attempts(tmp_path)
    curves = read_curves(tmp_path)
    loss_ax, lr_ax, rate_ax = figure_of(curves).axes
    drawn = {line.get_label(): line for line in loss_ax.get_lines() if not line.get_label().startswith("_")}
    for label, series in (("train", curves.train_loss), ("validation", curves.validation_loss)):
        assert list(drawn[label].get_xdata()) == series.x
        assert [y for y in drawn[label].get_ydata() if not math.isnan(y)] == [y for y in series.y if not math.isnan(y)]
    assert list(drawn["test"].get_ydata()) == [2.3]
    assert list(lr_ax.get_lines()[0].get_ydata()) == curves.lr.y
    assert list(rate_ax.get_lines()[0].get_ydata()) == curves.throughput.y
    assert rate_ax.get_ylabel() == "tokens/s"
    assert any(list(line.get_xdata()) == [7, 7] for line in loss_ax.get_lines())  # where the run resumed


def test_rapidlite_plot_writes_a_png(tmp_path, capsys):
    write_two_attempts(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / CURVES_FILE
    assert capsys.readouterr().out.strip() == str(png)
    assert png_size(png) == (800, 900) and 20_000 < png.stat().st_size < 1_000_000
    assert main(["plot", str(tmp_path / "metrics.jsonl"), "--output", str(tmp_path / "other.png")]) == 0
    assert png_size(tmp_path / "other.png") == (800, 900)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl", "other.png"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("empty dir", r"has no metrics.jsonl: pass the --save directory of a run"),
        ("missing", r"does not exist: pass the --save directory of a run"),
        ("no records", r"has no training or evaluation records to draw"),
        ("bad output", r"cannot write .*nowhere/curves.png"),
        ("output under a file", r"cannot write .*metrics.jsonl/curves.png: Not a directory"),
    ],
)
def test_rapidlite_plot_mistakes_are_one_line(tmp_path, capsys, setup, message):
    argv = ["plot", str(tmp_path)]
    if setup == "missing":
        argv = ["plot", str(tmp_path / "nothing")]
    elif setup == "no records":
        MetricsWriter(str(tmp_path), None, run_id="a").write({"split": "model_state", "iteration": 1})
    elif setup == "bad output":
        write_two_attempts(tmp_path)
        argv += ["--output", str(tmp_path / "nowhere" / "curves.png")]
    elif setup == "output under a file":
        write_two_attempts(tmp_path)
        argv += ["--output", str(tmp_path / "metrics.jsonl" / "curves.png")]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rapidlite: error: "), err
    assert re.search(message, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_without_matplotlib(curves, tmp_path, monkeypatch, capsys, log_lines):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed, also after earlier tests imported it
    missing = "drawing curves needs matplotlib, which is not installed: pip install matplotlib (a rapidlite dependency"
    write_two_attempts(tmp_path / "old")
    assert main(["plot", str(tmp_path / "old")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rapidlite: error: {missing}: it was removed)"]
    save = tmp_path / "run"
    ToyFinetuner(engine("--micro-batch-size", "16", "--epochs", "1", "--save", str(save))).train()
    hints = [line for line in log_lines if "pip install matplotlib" in line]
    assert hints == [f"no {save}/curves.png: {missing}: it was removed)"]
    assert not (save / CURVES_FILE).exists() and (save / "latest").exists()


def test_a_plot_that_fails_never_fails_the_run(curves, tmp_path, monkeypatch, log_lines):
    def broken(*args, **kwargs):
        raise RuntimeError("the renderer fell over\nsecond line")

    monkeypatch.setattr("rapidlite.trainer.monitor.write_curves", broken)
    save = tmp_path / "run"
    ToyFinetuner(engine("--micro-batch-size", "16", "--epochs", "1", "--save", str(save))).train()
    assert [line for line in log_lines if "curves.png" in line] == [
        f"could not draw {save}/curves.png: the renderer fell over"
    ]
    assert (save / "latest").exists()


def test_end_of_run_curves_follow_a_resumed_run(curves, tmp_path, log_lines):
    save = tmp_path / "run"
    flags = ["--micro-batch-size", "8", "--log-interval", "2", "--save", str(save)]
    ToyFinetuner(engine(*flags, "--epochs", "1")).train()
    first = png_size(save / CURVES_FILE)
    ToyFinetuner(engine(*flags, "--epochs", "2", "--load", str(save))).train()
    assert first == png_size(save / CURVES_FILE) == (800, 900)
    assert f"loss, learning rate and throughput curves: {save}/{CURVES_FILE}" in log_lines
    records = read_metrics(save)
    curves = read_curves(save)
    train = [r for r in records if "split" not in r]
    assert curves.train_loss.x == [r["iteration"] for r in train] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert curves.train_loss.y == [r["loss"] for r in train]
    assert curves.lr.y == [r["lr"] for r in train]
    assert curves.throughput_key == "samples_per_s"  # the toy's batches have no tokens
    assert curves.throughput.y == [r["samples_per_s"] for r in train]
    assert curves.validation_loss.y == [r["loss"] for r in records if r.get("split") == "validation"]
    assert curves.resumed_at == [9] and len(curves.run_ids) == 2
    assert json.loads((save / "metrics.jsonl").read_text().splitlines()[-1])["run_id"] == curves.run_ids[-1]


def test_overwrite_removes_the_earlier_runs_curves(tmp_path):
    from rapidlite.checkpoint.layout import clear_run

    write_two_attempts(tmp_path)
    write_curves(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert clear_run(tmp_path) == "curves.png, metrics.jsonl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_matplotlib_is_installed_with_rapidlite():
    """The README's first command ends with curves.png: matplotlib is a dependency, not only the [plot] extra
    (which stays, so 'rapidlite[plot]' still installs)."""
    import ast

    call = next(
        node
        for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
    )
    kwargs = {
        k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")
    }
    assert any(r.startswith("matplotlib") for r in kwargs["install_requires"])
    assert any(r.startswith("matplotlib") for r in kwargs["extras_require"]["plot"])


@pytest.mark.parametrize("switch", [("--no-curves",), ("RAPIDLITE_NO_CURVES", "1")], ids=["flag", "environment"])
def test_no_curves_leaves_the_picture_to_rapidlite_plot(curves, tmp_path, monkeypatch, log_lines, switch):
    save = tmp_path / "run"
    flags = ["--micro-batch-size", "16", "--epochs", "1", "--save", str(save)]
    if len(switch) == 2:
        monkeypatch.setenv(*switch)
    else:
        flags += switch
    ToyFinetuner(engine(*flags)).train()
    assert not (save / CURVES_FILE).exists() and not [line for line in log_lines if CURVES_FILE in line]
    assert main(["plot", str(save)]) == 0 and png_size(save / CURVES_FILE) == (800, 900)
