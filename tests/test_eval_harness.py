"""``--eval-harness``: benchmarks scored inside the run, on the model in memory (adapters applied), equal to
``rapidlite-eval`` on the run's export; on 2 ZeRO-3 ranks equal to one process; bad input is one line."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, rapidlite, rapidlite_captured, rapidlite_here, read_metrics
from rapidlite.tasks.causal_lm_demo import write_demo_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    model_dir, data_dir = write_demo_assets(root, seed=11, num_train=32, num_validation=8)
    rows = [json.loads(line) for line in open(data_dir / "validation.jsonl")]
    texts = [" ".join(str(v) for v in row.values() if isinstance(v, str)) for row in rows]
    mc = root / "choices.jsonl"
    pool = " ".join(texts).split()  # the demo's words, so the tokenizer knows them
    with open(mc, "w") as f:
        for i in range(8):
            endings = [" ".join(pool[(5 * i + 3 * k + j) % len(pool)] for j in range(2)) for k in range(4)]
            context = " ".join(pool[(7 * i + j) % len(pool)] for j in range(3))
            f.write(json.dumps({"context": context, "endings": endings, "label": i % 4}) + "\n")
    ppl = root / "texts.jsonl"
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return model_dir, data_dir, mc, ppl


def argv(assets, *extra):
    model_dir, data_dir, mc, ppl = assets
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length", "64", "--train-iters", "3",
        "--lr", "3e-2", "--lora-rank", "4", "--hidden-dropout", "0", "--log-interval", "1",
        "--eval-harness", f"{mc},{ppl}", *extra,
    ]  # fmt: skip


def harness(save):
    (last,) = [r for r in read_metrics(save) if r.get("split") == "validation"][-1:]
    return {k: v for k, v in last.items() if k.startswith("harness/")}


def run_eval(model, data):
    cmd = [sys.executable, "-m", "rapidlite.cli.evaluate", "--model", str(model), "--data", str(data)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(REPO),
                          "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one(assets, tmp_path_factory):
    save = tmp_path_factory.mktemp("harness_one") / "run"
    assert rapidlite_here(*argv(assets), "--save", str(save)) == 0
    return save


def test_in_run_scores_equal_rapidlite_eval_on_the_export(assets, one):
    _, _, mc, ppl = assets
    scores = harness(one)
    assert set(scores) == {"harness/choices/acc", "harness/choices/acc_norm", "harness/texts/perplexity",
                           "harness/texts/loss"}  # fmt: skip
    offline = {"choices": run_eval(one / "hf", mc), "texts": run_eval(one / "hf", ppl)}  # the adapter on its base
    for key, value in scores.items():
        _, name, metric = key.split("/")
        assert value == pytest.approx(offline[name][metric], rel=1e-5), key
    first = [r for r in read_metrics(one) if r.get("split") == "validation"][0]
    assert "harness/texts/perplexity" in first  # at every evaluation


@pytest.mark.distributed
def test_zero3_on_two_ranks_scores_as_one_process(assets, one, tmp_path):
    two = ["--nproc-per-node", "2", "--micro-batch-size", "2", "--zero-3-memory-optimization"]
    proc = rapidlite(*argv(assets, *two), "--save", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = harness(one), harness(tmp_path / "two")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key


def test_bad_harness_input_is_one_line(assets, tmp_path):
    model_dir, data_dir, mc, _ = assets
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    cases = [
        (argv(assets)[:-2] + ["--eval-harness", str(tmp_path / "none.jsonl")], "none.jsonl"),
        (argv(assets)[:-2] + ["--eval-harness", str(pairs)], "score a reward model"),
        (argv(assets)[:-2] + ["--eval-harness", f"{mc},{mc}"], "two files are named choices"),
        (["--task", "sequence_classification", "--demo", "--eval-harness", str(mc)], "scores a causal language model"),
    ]
    for args, message in cases:
        proc = rapidlite_captured(*args, "--save", str(tmp_path / "run"))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
