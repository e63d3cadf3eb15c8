"""``--task reward_model``: tokenization, loss and metrics equal TRL's ``RewardTrainer`` (TRL 1.16, the ``test``
extra's pin) on the same tiny model, data and batch; accumulation and two ranks train as one process; bad data is one
line; a trained model is exported and scored by ``rapidlite-eval``."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from helpers import (
    REPO,
    as_layout,
    assert_same_metrics,
    rapidlite,
    rapidlite_captured,
    read_jsonl,
    read_metrics,
    run_cli,
    write_jsonl,
)
from rapidlite import RapidliteEngine
from rapidlite.data.preference import Counts, encode_reward_pairs
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm_demo import write_demo_assets
from rapidlite.tasks.reward_model import RewardModelFinetuner
from rapidlite.tasks.sequence_classification import load_classifier

trl = pytest.importorskip("trl")
TOL = dict(rel=1e-5, abs=1e-5)
KINDS = {"an animal": ("fox", "cat", "dog", "bird", "fish", "wolf"), "a colour": ("red", "blue", "green", "gold")}


def _kind_pairs(rng, n):
    """A learnable preference: "name an animal:" answered by an animal, not a colour (and the other way round)."""
    rows = []
    for _ in range(n):
        kind, other = rng.sample(list(KINDS), 2)
        rows.append(
            {
                "prompt": f"name {kind}:",
                "chosen": " " + rng.choice(KINDS[kind]),
                "rejected": " " + rng.choice(KINDS[other]),
            }
        )
    return rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The causal demo's tiny LLaMA (a reward model gets a fresh one-output head on it) and tokenizer; pairs of a
    correct word reversal against a near miss (rows of varied lengths), the same with a margin column, and the
    learnable animal/colour pairs."""
    root = tmp_path_factory.mktemp("reward")
    model_dir, data_dir = write_demo_assets(root, seed=5, num_train=48, num_validation=13)
    rng = random.Random(0)
    for split in ("train", "validation"):
        rows = []
        for r in (json.loads(line) for line in open(data_dir / f"{split}.jsonl")):
            words = r["completion"].split()
            rows.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": " ".join(words[1:] + words[:1])})
        write_jsonl(root / "pairs", split, rows)
        write_jsonl(root / "margin", split, [{**r, "margin": round(rng.uniform(0, 2), 3)} for r in rows])
    write_jsonl(root / "kinds", "train", _kind_pairs(rng, 128))
    write_jsonl(root / "kinds", "validation", _kind_pairs(rng, 32))
    return model_dir, root


def reward_args(model_dir, data_dir, *extra):
    return [
        "--task", "reward_model", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--epochs", "1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def _reward_model(model_dir, pad_id):
    torch.manual_seed(0)
    model = load_classifier(str(model_dir), 1, {0: "reward"})
    model.config.pad_token_id = pad_id
    return model


def _trl_trainer(model_dir, model, rows, max_length=1024, chat_template=None, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tok.chat_template = chat_template
    config = trl.RewardConfig(
        output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=max_length, **config
    )
    return trl.RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok), tok


# ------------------------------------------------------------------ data


@pytest.mark.parametrize("layout", ["text", "conversation", "implicit"])
def test_tokenization_is_trls(assets, layout):
    """Chosen and rejected ids equal TRL's RewardTrainer._prepare_dataset: prompt + response whole (text: EOS
    appended; chats: the chat template), rows longer than max_length dropped, not cut."""
    from rapidlite.data.instruction import CHATML_TEMPLATE

    model_dir, root = assets
    rows = as_layout(read_jsonl(root / "pairs")[:12], layout)
    full, tok = _trl_trainer(model_dir, _reward_model(model_dir, 0), rows, chat_template=CHATML_TEMPLATE)
    lengths = sorted(max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in full.train_dataset)
    max_length = lengths[len(lengths) // 2]  # about half the rows are longer: the filter is exercised
    trainer, tok = _trl_trainer(model_dir, _reward_model(model_dir, 0), rows, max_length, CHATML_TEMPLATE)
    expected = [{k: list(r[k]) for k in ("chosen_ids", "rejected_ids")} for r in trainer.train_dataset]
    counts = Counts()
    assert encode_reward_pairs(rows, tok, max_length, counts) == expected
    assert 0 < len(expected) < len(rows) and counts.dropped == {
        f"longer than --max-length {max_length}": 12 - len(expected)
    }


# ------------------------------------------------------------------ loss and metrics against TRL


def _trainer(model_dir, data_dir, *extra):
    trainer = RewardModelFinetuner(RapidliteEngine(args=parse_args(reward_args(model_dir, data_dir, *extra))))
    train, _, _, collate = trainer.train_valid_test_datasets_provider()
    return trainer, train, collate


@pytest.mark.parametrize("data", ["pairs", "margin", "centred"])
def test_loss_and_metrics_equal_trls_reward_trainer(assets, data):
    """The first step's loss, accuracy, margin and mean reward of 8 pairs of varied lengths (right padding: the score
    is read at each row's last token) equal RewardTrainer.compute_loss's, with and without a margin column, and with
    TRL's center_rewards_coefficient."""
    model_dir, root = assets
    centre = {"center_rewards_coefficient": 0.5} if data == "centred" else {}
    data = "pairs" if data == "centred" else data
    trainer, train, collate = _trainer(
        model_dir, root / data, *(["--center-rewards-coefficient", "0.5"] if centre else [])
    )
    model = _reward_model(model_dir, trainer.pad_id)
    batch = collate(train[:8])
    assert ("margin" in batch) == (data == "margin")
    model.train()
    trainer.monitor.step_metrics.clear()
    loss_sum, pairs = trainer.run_forward_step(batch, model)
    ours = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())

    theirs_trainer, _ = _trl_trainer(model_dir, copy.deepcopy(model), read_jsonl(root / data)[:8], **centre)
    theirs_batch = theirs_trainer.data_collator([theirs_trainer.train_dataset[i] for i in range(8)])
    theirs_trainer.model.train()
    loss = theirs_trainer.compute_loss(theirs_trainer.model, theirs_batch)
    theirs = {k: v[-1] for k, v in theirs_trainer._metrics["train"].items()}
    assert pairs == 8 and float(loss_sum.detach()) / pairs == pytest.approx(float(loss), **TOL)
    for name in ("accuracy", "margin", "mean_reward"):
        assert ours[name] == pytest.approx(theirs[name], **TOL), name
    assert 0 < ours["accuracy"] < 1  # the pairs disagree: the metric is exercised


def test_flags_it_does_not_use_are_refused(assets):
    model_dir, root = assets
    for flags, expected in (
        (["--padding-free"], "--padding-free: --task reward_model reads each sequence's score at its last token"),
        (["--beta", "0.2"], r"--beta: --task reward_model does not use it \(dpo, grpo, kto, rloo use it\); drop"),
        (["--max-prompt-length", "8"], "--max-prompt-length: --task reward_model does not use it"),
    ):
        with pytest.raises(ConfigError, match=expected):
            parse_args(reward_args(model_dir, root / "pairs", *flags))


def _rapidlite_eval(model, data, *flags):
    """``rapidlite-eval --model MODEL --data DATA FLAGS`` as a user runs it: its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "rapidlite.cli.evaluate", "--model", str(model), "--data", str(data)]
    scored = subprocess.run([*command, *flags], capture_output=True, text=True, env=env, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    return json.loads(scored.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ layouts


def _one_step(model_dir, data_dir, *flags):
    args = parse_args(
        reward_args(model_dir, data_dir, "--train-iters", "1", "--optimizer", "sgd", "--lr", "1.0", *flags)
    )
    trainer = RewardModelFinetuner(RapidliteEngine(args=args))
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_one_step_with_accumulation_equals_one_big_batch(assets):
    """Pairs of different lengths (with margins) over 4 micro-batches of 2: the SGD update is the batch of 8's."""
    model_dir, root = assets
    big = _one_step(model_dir, root / "margin", "--micro-batch-size", "8", "--global-batch-size", "8")
    small = _one_step(model_dir, root / "margin", "--micro-batch-size", "2", "--global-batch-size", "8")
    before = load_classifier(str(model_dir), 1, {0: "reward"}).state_dict()
    moved = {k for k in big if "score" not in k and float((big[k] - before[k]).abs().max()) > 1e-4}
    assert moved  # the step moved the body's weights, not only the fresh head
    for name, value in big.items():
        torch.testing.assert_close(small[name], value, rtol=1e-4, atol=1e-6, msg=name)


METRICS = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")


LAYOUTS = {
    "one": ["--micro-batch-size", "8"],
    "ddp": ["--micro-batch-size", "4", "--nproc-per-node", "2"],
    "zero3_offload": [
        "--micro-batch-size",
        "4",
        "--nproc-per-node",
        "2",
        "--zero-3-memory-optimization",
        "--cpu-offload",
    ],
    "deepspeed_zero3": [
        "--micro-batch-size",
        "4",
        "--nproc-per-node",
        "2",
        "--deepspeed",
        "--zero-3-memory-optimization",
    ],
}


@pytest.fixture(scope="module")
def layout_runs(assets, tmp_path_factory):
    """``get(name)``: the --save directory of layout ``name`` (2 SGD steps, then validation), run once (a
    one-process layout in this process)."""
    model_dir, root = assets
    out = tmp_path_factory.mktemp("reward-layouts")
    common = ["--train-iters", "2", "--optimizer", "sgd", "--lr", "0.5", "--global-batch-size", "8"]
    done = {}

    def get(name):
        if name not in done:
            argv = reward_args(model_dir, root / "margin", *common, *LAYOUTS[name], "--save", str(out / name))
            proc = (rapidlite if "--nproc-per-node" in LAYOUTS[name] else rapidlite_captured)(*argv)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = out / name
        return done[name]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zero3_offload", "deepspeed_zero3"])
def test_sharded_layouts_train_and_evaluate_as_one_process(layout_runs, layout):
    """FSDP2 ZeRO-3 with CPU offload and DeepSpeed ZeRO-3 over 2 ranks: the losses and metrics of every interval and
    of the validation pass equal one process's."""
    assert_same_metrics(layout_runs(layout), layout_runs("one"), METRICS, rel=1e-4)


@pytest.mark.distributed
def test_two_ranks_train_and_evaluate_as_one_process(assets, layout_runs):
    """Data parallel over 2 ranks: each interval's loss and metrics, and the validation pass's (13 pairs: the ranks'
    last batches are padded and trimmed), equal one process's with the same global batch."""
    model_dir, root = assets
    assert_same_metrics(layout_runs("ddp"), layout_runs("one"), METRICS, rel=1e-4)
    assert any(r.get("split") == "validation" and "max_reward" in r for r in read_metrics(layout_runs("one")))
    # rapidlite-eval on 2 ranks (13 pairs in batches of 4: unequal shares) scores the export as the run's last
    # validation pass did.
    results = _rapidlite_eval(layout_runs("one") / "hf", root / "margin" / "validation.jsonl", "--micro-batch-size",
                              "4", "--nproc-per-node", "2")  # fmt: skip
    last = [r for r in read_metrics(layout_runs("one")) if r.get("split") == "validation"][-1]
    assert results["world_size"] == 2 and results["n"] == 13
    for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert results[name] == pytest.approx(last[name], **TOL), name


@pytest.mark.distributed
def test_rapidlite_eval_writes_each_pairs_rewards_by_its_row(assets, layout_runs, tmp_path):
    """``--scores``: one line per scored row, numbered as in the data (a row it cannot score, chosen equal to
    rejected, left out), the same on 2 ranks as on one, and the metrics follow from them."""
    model_dir, root = assets
    rows = [json.loads(line) for line in (root / "margin" / "validation.jsonl").read_text().splitlines()]
    data = write_jsonl(tmp_path, "scored", [{**rows[0], "rejected": rows[0]["chosen"]}, *rows])
    export = layout_runs("one") / "hf"
    lines = {}
    for ranks in ("1", "2"):
        out = tmp_path / f"scores{ranks}.jsonl"
        results = _rapidlite_eval(export, data / "scored.jsonl", "--micro-batch-size", "4", "--nproc-per-node",
                                  ranks, "--scores", str(out))  # fmt: skip
        lines[ranks] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["row"] for line in lines["1"]] == list(range(1, 14))  # row 0 dropped
    for one, two in zip(lines["1"], lines["2"], strict=True):
        assert one["row"] == two["row"]
        assert one["chosen"] == pytest.approx(two["chosen"], **TOL) and one["rejected"] == pytest.approx(
            two["rejected"], **TOL
        )
    hits = [line["chosen"] > line["rejected"] for line in lines["2"]]
    assert results["n"] == 13 and results["accuracy"] == pytest.approx(sum(hits) / 13)
    mean = sum(line["chosen"] + line["rejected"] for line in lines["2"]) / 26
    assert results["mean_reward"] == pytest.approx(mean, **TOL)


# ------------------------------------------------------------------ bad data


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_rejected", "has no rejected column"),
        ("all_equal", "chosen equals rejected"),
        ("too_long", "longer than --max-length 8); raise --max-length (now 8)"),
    ],
)
def test_bad_data_is_one_line_exit_2_and_nothing_written(assets, tmp_path, case, expected):
    model_dir, root = assets
    rows = read_jsonl(root / "pairs")
    if case == "no_rejected":
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in rows]
    elif case == "all_equal":
        rows = [{**r, "rejected": r["chosen"]} for r in rows]
    extra = ["--max-length", "8"] if case == "too_long" else []
    data = write_jsonl(tmp_path / case, "train", rows)
    proc = rapidlite_captured(*reward_args(model_dir, data, *extra, "--save", str(tmp_path / "run")))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ end to end


def test_training_raises_accuracy_exports_and_rapidlite_eval_scores_the_export(assets, tmp_path):
    """On pairs it can learn (an animal, not a colour, when asked for an animal), validation accuracy rises from
    the first step's; DIR/hf loads as a one-output AutoModelForSequenceClassification that knows its pad id; and
    rapidlite-eval --task reward on the validation rows gives the run's last validation accuracy and margin."""
    from transformers import AutoModelForSequenceClassification

    model_dir, root = assets
    save = tmp_path / "run"
    flags = ["--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "3e-3", "--weight-decay", "0"]
    proc = rapidlite_captured(
        *reward_args(model_dir, root / "kinds", *flags, "--eval-interval", "1", "--save", str(save))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(save) if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 1 and evals[0]["accuracy"] <= 0.85
    assert evals[-1]["accuracy"] >= 0.95 and evals[-1]["margin"] > 1.0

    model = AutoModelForSequenceClassification.from_pretrained(save / "hf")
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None

    results = _rapidlite_eval(save / "hf", root / "kinds" / "validation.jsonl")
    assert results["task"] == "reward" and results["n"] == 32
    for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert results[name] == pytest.approx(evals[-1][name], **TOL), name


def test_demo_learns_to_score_the_correct_reversal_above_the_near_miss(tmp_path, monkeypatch):
    """``--task reward_model --demo`` as the docs run it: validation accuracy and margin rise well above the fresh
    head's (0.51 and 0.003 here)."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "reward_model", "--demo", "--save", str(tmp_path / "run"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    first, last = evals[0], evals[-1]
    assert first["iteration"] == 0 and first["accuracy"] <= 0.6
    assert last["accuracy"] >= first["accuracy"] + 0.12 and last["margin"] > 1.0


def test_rapidlite_eval_refuses_what_is_not_a_reward_model_or_pairs(assets, tmp_path, capsys):
    from rapidlite.cli.evaluate import main

    model_dir, root = assets
    mixed = write_jsonl(
        tmp_path, "mixed", [{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}]
    )
    cases = {
        # a causal LM: a sequence-classification head on it would have 2 outputs
        (str(model_dir), str(root / "kinds" / "validation.jsonl")): "its sequence-classification head has 2 outputs",
        (str(model_dir), str(mixed / "mixed.jsonl")): "row 1: a row's chosen and rejected differ in kind",
    }
    for (model, data), expected in cases.items():
        assert main(["--model", model, "--data", data, "--task", "reward"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("rapidlite: error:") and expected in err, err
    text = write_jsonl(tmp_path, "text", [{"text": "a line to score"}]) / "text.jsonl"
    assert main(["--model", str(model_dir), "--data", str(text), "--scores", str(tmp_path / "s.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--scores: each pair's rewards are written for --task reward, not perplexity" in err
    assert err.count("\n") == 1 and not (tmp_path / "s.jsonl").exists()
