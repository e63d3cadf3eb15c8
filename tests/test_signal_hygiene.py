"""A training run in a longer-lived process (a notebook, a test session) leaves SIGTERM as it found it, and
``rapidlite-preprocess``'s worker processes end on SIGTERM even when their parent has a Python handler for it
(``Pool.terminate()`` relies on that; a worker ignoring it hung the pool's teardown)."""

import multiprocessing
import signal

import pytest

from helpers import ToyFinetuner, engine
from rapidlite.data.preprocess import _init_worker, _Job


class Failing(ToyFinetuner):
    def run_forward_step(self, batch, model):
        raise RuntimeError("a bug in the forward step")


def test_a_failed_run_restores_the_signal_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="a bug in the forward step"):
        Failing(engine("--micro-batch-size", "8", "--epochs", "1")).train()
    assert signal.getsignal(signal.SIGTERM) is before


JOB = _Job("corpus.jsonl", "jsonl", ("text",), False, False, False, "english")


def _worker_handler(_):
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_preprocess_workers_take_sigterm_by_default():
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # what a training leaves while it runs
    try:
        with multiprocessing.get_context("fork").Pool(1, initializer=_init_worker, initargs=(None, JOB)) as pool:
            assert pool.map(_worker_handler, [0]) == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)
