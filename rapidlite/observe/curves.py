"""``DIR/curves.png``: training and validation loss, learning rate and throughput against iteration, drawn from
``DIR/metrics.jsonl`` at the end of a ``--save`` run and by ``rapidlite plot DIR``.

``metrics.jsonl`` holds the lines of one run: its first attempt and every resumption (``--load DIR``), each
attempt with its own ``run_id``. A resumed attempt restarts at its checkpoint, so the lines an earlier attempt
wrote after that iteration (work lost when it stopped) are superseded by the resumed attempt's: the curves are
the run as it stands. Records are told apart as ``observe.logging.MetricsWriter`` writes them: training records
have no ``split``; evaluations have ``split: "validation"`` or ``"test"``; ``split: "model_state"`` (written
once per attempt, after its first step) marks where an attempt starts. ``--eval-only`` records are evaluations
that start no attempt. NaN and infinity are written as null and drawn as gaps. matplotlib (a dependency)
draws with its Agg backend, off-screen; without it nothing is drawn. ``--no-curves`` (or ``RAPIDLITE_NO_CURVES=1``)
skips the end-of-run picture, about half a second of CPU (most of it importing matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapidlite.errors import ConfigError, DataError, RapidliteError, first_line

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
INSTALL_HINT = "pip install matplotlib (a rapidlite dependency: it was removed)"
NO_CURVES_ENV = "RAPIDLITE_NO_CURVES"  # as --no-curves: a batch of runs whose pictures nobody looks at


class PlotUnavailable(RapidliteError):
    """matplotlib is not installed."""


@dataclass
class Series:
    """One curve: ``y[i]`` at iteration ``x[i]``; NaN where the record held null (a NaN or inf value)."""

    x: list[int] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    def add(self, x: int, value: Any) -> None:
        self.x.append(x)
        self.y.append(float(value) if isinstance(value, (int, float)) else math.nan)

    def __len__(self) -> int:
        return len(self.x)


@dataclass
class Curves:
    """The series ``curves.png`` draws, read from one ``metrics.jsonl``."""

    train_loss: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    throughput: Series = field(default_factory=Series)
    throughput_key: str = "tokens_per_s"  # or samples_per_s, when the batches' tokens could not be counted
    validation_loss: Series = field(default_factory=Series)
    test_loss: Series = field(default_factory=Series)
    run_ids: list[str] = field(default_factory=list)  # the attempts whose lines are drawn, in order
    resumed_at: list[int] = field(default_factory=list)  # the first iteration of each resumed attempt

    def empty(self) -> bool:
        return not (len(self.train_loss) or len(self.validation_loss) or len(self.test_loss))


def _records(path: Path) -> list[dict[str, Any]]:
    """The file's records; a line that is not a JSON object (the torn last line of a killed run) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("iteration"), (int, float)):
                records.append(record)
    return records


def _attempts(records: list[dict[str, Any]]) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """Consecutive records of one ``run_id``, in file order (files of earlier versions have none: one attempt)."""
    attempts: list[tuple[str | None, list[dict[str, Any]]]] = []
    for record in records:
        run_id = record.get("run_id")
        if not attempts or attempts[-1][0] != run_id:
            attempts.append((run_id, []))
        attempts[-1][1].append(record)
    return attempts


def current_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str], list[int]]:
    """The records of the run as it stands: each attempt that trained replaces the earlier attempts' records from
    its first iteration on. Returns the records, the run ids they come from and the iterations where resumed
    attempts start."""
    kept: list[dict[str, Any]] = []
    resumed_at: list[int] = []
    for _, attempt in _attempts(records):
        trained = [r["iteration"] for r in attempt if not r.get("eval_only")]
        if trained:
            start = min(trained)
            if any(not r.get("eval_only") for r in kept):
                resumed_at.append(int(start))
            kept = [r for r in kept if r.get("eval_only") or r["iteration"] < start]
        kept.extend(attempt)
    run_ids = list(dict.fromkeys(r["run_id"] for r in kept if r.get("run_id")))
    return kept, run_ids, resumed_at


def read_curves(path: str | os.PathLike) -> Curves:
    """The curves of ``path`` (a ``--save`` directory or its ``metrics.jsonl``); ``DataError`` when there is no
    such file."""
    path = Path(path)
    metrics = path / METRICS_FILE if path.is_dir() else path
    if not metrics.is_file():
        where = f"{path} has no {METRICS_FILE}" if path.is_dir() else f"{path} does not exist"
        raise DataError(f"{where}: pass the --save directory of a run")
    records, run_ids, resumed_at = current_records(_records(metrics))
    records.sort(key=lambda r: r["iteration"])  # stable: an evaluation stays after its iteration's training record
    curves = Curves(run_ids=run_ids, resumed_at=resumed_at)
    train = [r for r in records if "split" not in r]
    if not any("tokens_per_s" in r for r in train) and any("samples_per_s" in r for r in train):
        curves.throughput_key = "samples_per_s"
    for record in records:
        iteration, split = int(record["iteration"]), record.get("split")
        if split is None:
            curves.train_loss.add(iteration, record.get("loss"))
            if "lr" in record:
                curves.lr.add(iteration, record["lr"])
            if curves.throughput_key in record:
                curves.throughput.add(iteration, record[curves.throughput_key])
        elif split in ("validation", "test") and "loss" in record:
            (curves.validation_loss if split == "validation" else curves.test_loss).add(iteration, record["loss"])
    return curves


def _new_figure() -> Any:
    """matplotlib's ``Figure`` on an Agg canvas (no pyplot: no global state, no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(f"drawing curves needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    figure = Figure(figsize=(8, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _line(ax: Any, series: Series, **style: Any) -> None:
    if not len(series):
        return
    gaps = [x for x, y in zip(series.x, series.y, strict=True) if math.isnan(y)]
    # A point alone (one record, or between NaN gaps) draws no line: markers show it.
    style.setdefault("marker", "o" if len(series) == 1 else "." if gaps else None)
    ax.plot(series.x, series.y, **style)
    if gaps:  # NaN/inf records (written as null): marked along the bottom edge
        ax.plot(
            gaps,
            [0] * len(gaps),
            "x",
            color="tab:red",
            ms=6,
            transform=ax.get_xaxis_transform(),
            label="NaN/inf",
            clip_on=False,
        )


def figure_of(curves: Curves, title: str = "") -> Any:
    """The matplotlib ``Figure`` of ``curves``: loss (train, validation, test), learning rate, throughput."""
    figure = _new_figure()
    from matplotlib.ticker import MaxNLocator

    loss_ax, lr_ax, rate_ax = figure.subplots(3, 1, sharex=True)
    _line(loss_ax, curves.train_loss, label="train", color="tab:blue", linewidth=1.2)
    _line(loss_ax, curves.validation_loss, label="validation", color="tab:orange", marker="o", ms=4)
    _line(loss_ax, curves.test_loss, label="test", color="tab:red", marker="X", ms=8, linestyle="none")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="upper right")
    _line(lr_ax, curves.lr, color="tab:green", linewidth=1.2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    _line(rate_ax, curves.throughput, color="tab:purple", linewidth=1.2)
    rate_ax.set_ylabel(curves.throughput_key.replace("_per_s", "/s"))
    rate_ax.set_xlabel("iteration")
    for ax in (loss_ax, lr_ax, rate_ax):
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for iteration in curves.resumed_at:
            ax.axvline(iteration, color="gray", linestyle=":", linewidth=1)
    resumed = f", resumed at iteration {', '.join(map(str, curves.resumed_at))}" if curves.resumed_at else ""
    figure.suptitle(f"{title}{resumed}" if title else resumed.lstrip(", "))
    return figure


def draw(curves: Curves, output: str | os.PathLike, title: str = "") -> Path:
    """Draw ``curves`` into ``output`` (PNG unless its suffix names another format), written to a temporary name
    first and renamed into place: an existing picture is replaced whole or not at all."""
    figure = figure_of(curves, title)
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        figure.savefig(tmp, format=output.suffix.lstrip(".").lower() or "png")
        os.replace(tmp, output)
    except OSError as e:
        raise DataError(f"cannot write {output}: {e.strerror or first_line(e)}") from None
    except ValueError as e:  # matplotlib: "Format 'x' is not supported (supported formats: ...)"
        raise ConfigError(f"{output}: {first_line(e)}") from None
    finally:
        with contextlib.suppress(OSError):  # missing, or under a path that is no directory (the error above says)
            tmp.unlink()
    return output


def write_curves(save_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> Path:
    """``save_dir/curves.png`` (or ``output``) from ``save_dir/metrics.jsonl``; returns its path. Raises
    ``PlotUnavailable`` without matplotlib, ``DataError`` when there is nothing to draw."""
    _new_figure()  # fails first, in one line, without matplotlib
    save_dir = Path(save_dir)
    curves = read_curves(save_dir)
    metrics = save_dir / METRICS_FILE if save_dir.is_dir() else save_dir
    if curves.empty():
        raise DataError(f"{metrics} has no training or evaluation records to draw")
    if output is None:
        output = metrics.with_name(CURVES_FILE)
    return draw(curves, output, title=str(metrics.parent))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite plot --help')")


def main(argv: Sequence[str]) -> int:
    """``rapidlite plot DIR [--output FILE]``."""
    parser = _Parser(
        prog="rapidlite plot",
        description=f"Draw DIR/{CURVES_FILE} (loss, learning rate, throughput against iteration) from a --save "
        f"directory's {METRICS_FILE}. Needs matplotlib: {INSTALL_HINT}",
    )
    parser.add_argument("dir", metavar="DIR", help=f"a --save directory (or its {METRICS_FILE})")
    parser.add_argument("--output", "-o", default=None, metavar="FILE", help=f"default: DIR/{CURVES_FILE}")
    args = parser.parse_args(list(argv))
    print(write_curves(args.dir, args.output))
    return 0
