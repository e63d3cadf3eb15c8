"""The black box ``--task causal_lm`` end to end, on the demo's tiny LLaMA and generated instruction data."""

import json
import logging
import math

import pytest
import torch

from helpers import rapidlite_captured, read_metrics, run_cli
from rapidlite import RapidliteEngine
from rapidlite.cli.main import main
from rapidlite.observe.logging import LOGGER_NAME
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import CausalLMFinetuner, honours_packed_positions, load_causal_lm
from rapidlite.tasks.causal_lm_demo import write_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny LLaMA and tokenizer, and word-reversal prompt/completion jsonl (train, validation)."""
    return write_demo_assets(tmp_path_factory.mktemp("causal"), seed=5, num_train=240, num_validation=40)


def write_rows(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def alpaca_rows(data_dir, split):
    rows = [json.loads(line) for line in open(data_dir / f"{split}.jsonl")]
    return [{"instruction": "reverse the words", "input": r["prompt"].split(": ")[1].strip(), "output": r["completion"]}
            for r in rows]  # fmt: skip


def task_args(model_dir, data_dir, *extra):
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "96",
        "--epochs", "1", "--log-interval", "5", *extra,
    ]  # fmt: skip


def trainer_and_data(model_dir, data_dir, *extra):
    trainer = CausalLMFinetuner(RapidliteEngine(args=parse_args(task_args(model_dir, data_dir, *extra))))
    train, valid, _, collate = trainer.train_valid_test_datasets_provider()
    return trainer, train, valid, collate


def test_cli_alpaca_run_exports_a_causal_lm_with_its_tokenizer(tiny_assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_dir = tiny_assets
    data = write_rows(tmp_path / "alpaca", {s: alpaca_rows(data_dir, s) for s in ("train", "validation")})
    out = tmp_path / "out"
    # Alpaca's prompt is long in a tokenizer trained on the reversal data alone.
    proc = rapidlite_captured(
        *task_args(model_dir, data, "--eval-generate", "3", "--seq-length", "384", "--save", str(out))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "format alpaca" in log and "0 truncated" in log
    assert "greedy completions of 3 validation prompts" in log
    final = [r for r in read_metrics(out) if r.get("split") == "validation"][-1]
    assert {"loss", "ppl", "exact_match"} <= final.keys() and final["ppl"] == pytest.approx(
        2.718281828 ** final["loss"]
    )
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model(**tokenizer(["reverse the words: red fox"], return_tensors="pt")).logits.shape[-1] == len(tokenizer)


def test_the_forward_step_sees_labels_on_the_response_and_eos_only(tiny_assets):
    model_dir, data_dir = tiny_assets
    trainer, train, _, collate = trainer_and_data(model_dir, data_dir)
    tok = trainer.tokenizer
    rows = [json.loads(line) for line in open(data_dir / "train.jsonl")][:4]
    batch = collate([train[i] for i in range(4)])
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for i, row in enumerate(rows):
        real = batch["attention_mask"][i].bool()
        labels = batch["labels"][i]
        assert tok.decode(batch["input_ids"][i][real]) == row["prompt"] + row["completion"] + tok.eos_token
        assert tok.decode(labels[labels != -100]) == row["completion"] + tok.eos_token
        assert (labels[~real] == -100).all()
    _, everything, _, _ = trainer_and_data(model_dir, data_dir, "--train-on-prompt")
    assert everything[0]["labels"] == everything[0]["input_ids"]


def _loss(trainer, model, rows, collate, micro_batch):
    total, items = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), micro_batch):
            loss_sum, n = trainer.run_forward_step(collate(rows[start : start + micro_batch]), model)
            total, items = total + float(loss_sum), items + n
    return total / items, items


def test_packed_loss_equals_unpacked_and_accumulation_is_token_exact(tiny_assets):
    model_dir, data_dir = tiny_assets
    trainer, _, valid, collate = trainer_and_data(model_dir, data_dir)
    packer, _, packed, packed_collate = trainer_and_data(model_dir, data_dir, "--packing", "--seq-length", "64")
    assert len(packed) < len(valid) / 2 and "attention_mask" not in packed_collate(packed[:3])
    model = load_causal_lm(str(model_dir)).eval()
    assert honours_packed_positions(model)
    one_batch, items = _loss(trainer, model, valid, collate, len(valid))
    # Micro-batches of 3 rows pad differently: the per-token loss over them is the same.
    assert _loss(trainer, model, valid, collate, 3) == (pytest.approx(one_batch, rel=1e-5), items)
    # Packs of several samples (padded to the longest pack of a micro-batch) give the unpacked per-token loss.
    assert _loss(packer, model, packed, packed_collate, 3) == (pytest.approx(one_batch, rel=1e-5), items)


def test_gpt2_keeps_packed_samples_apart():
    """transformers' GPT-2 reads restarting position ids without a mask as packed samples (checked by running)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    assert honours_packed_positions(model)


def test_bad_data_is_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys):
    model_dir, _ = tiny_assets
    data = write_rows(tmp_path / "bad", {"train": [{"title": "a", "body": "b"}] * 8})
    save = tmp_path / "save"
    assert main(task_args(model_dir, data, "--save", str(save))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no known format" in err.strip().splitlines()[-1]
    assert not save.exists() or not any(save.iterdir())

    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 8
    data = write_rows(tmp_path / "chat", {"train": chats})
    assert main(task_args(model_dir, data, "--save", str(save))) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--chat-template" in last
    assert not save.exists() or not any(save.iterdir())


def test_a_chat_role_templates_do_not_know_is_named(tiny_assets, tmp_path, capsys):
    """Messages whose role is an export's own name ("ai") have no assistant turn: one line names the role and the
    roles accepted, rather than asking for a longer --seq-length; nothing is written."""
    model_dir, _ = tiny_assets
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "ai", "content": "hello"}]}] * 8
    data = write_rows(tmp_path / "chat", {"train": chats})
    save = tmp_path / "run"
    assert main(task_args(model_dir, data, "--chat-template", "chatml", "--save", str(save))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "role 'ai'" in err[0] and "user, assistant" in err[0] and "--seq-length" not in err[0]
    assert not save.exists() or not any(save.iterdir())


def test_chat_data_with_chatml_trains_the_assistant_turns(tiny_assets, tmp_path):
    model_dir, data_dir = tiny_assets
    rows = [json.loads(line) for line in open(data_dir / "train.jsonl")][:8]
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
             for r in rows]  # fmt: skip
    data = write_rows(tmp_path / "chat", {"train": chats, "validation": chats[:2]})
    trainer, train, _, collate = trainer_and_data(model_dir, data, "--chat-template", "chatml")
    batch = collate(train[:2])
    labels = batch["labels"][0]
    assert trainer.tokenizer.decode(labels[labels != -100]) == rows[0]["completion"] + "<|im_end|>\n<|endoftext|>"


@pytest.mark.slow
def test_demo_learns_the_skill(tmp_path, monkeypatch):
    """``--task causal_lm --demo`` as the README runs it: the exact match of greedy completions of unseen
    prompts goes from the untrained model's 0 to most of them, and the validation loss falls far."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "causal_lm", "--demo", "--save", str(tmp_path / "run"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["exact_match"] == 0.0
    assert evals[-1]["exact_match"] >= 0.8 and evals[-1]["loss"] < evals[0]["loss"] / 10


def _one_step(model_dir, data_dir, *flags):
    args = parse_args(task_args(model_dir, data_dir, "--train-iters", "1", "--optimizer", "sgd", "--lr", "1.0", *flags))
    trainer = CausalLMFinetuner(RapidliteEngine(args=args))
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_one_step_with_accumulation_equals_one_big_batch(tiny_assets):
    """Rows of different lengths over 4 micro-batches: the SGD update is the big batch's (gradients divided by the
    global batch's labelled tokens, not averaged per micro-batch)."""
    model_dir, data_dir = tiny_assets
    big = _one_step(model_dir, data_dir, "--micro-batch-size", "8", "--global-batch-size", "8")
    small = _one_step(model_dir, data_dir, "--micro-batch-size", "2", "--global-batch-size", "8")
    before = load_causal_lm(str(model_dir)).state_dict()
    assert max(float((big[k] - before[k]).abs().max()) for k in big) > 1e-3  # the step did move the weights
    for name, value in big.items():
        torch.testing.assert_close(small[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_two_ranks_train_and_evaluate_as_one_process(tiny_assets, tmp_path):
    """Data parallel over 2 ranks (unequal token counts per rank): the same updates and the same token-exact
    validation loss as one process with the same global batch."""
    model_dir, data_dir = tiny_assets
    common = [
        "--train-iters",
        "3",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--global-batch-size",
        "8",
        "--eval-generate",
        "2",
    ]
    losses = []
    for name, layout in (
        ("one", ["--micro-batch-size", "8"]),
        ("two", ["--micro-batch-size", "4", "--nproc-per-node", "2"]),
    ):
        proc = run_cli(*task_args(model_dir, data_dir, *common, *layout, "--save", str(tmp_path / name)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append([r["loss"] for r in read_metrics(tmp_path / name) if r.get("split") in ("train", "validation")])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    # Greedy completions run on every rank (a forward may be collective) and end at the same token.
    assert "exact_match" in [r for r in read_metrics(tmp_path / "two") if r.get("split") == "validation"][-1]


@pytest.mark.slow
def test_a_model_pretrained_by_rapidlite_fine_tunes_and_generates_with_transformers(tmp_path):
    """Pretraining's export (the built-in GPT in GPT-2's layout, with its tokenizer) is a causal LM that --task
    causal_lm fine-tunes, and transformers generates with the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "8"]
    pt = ["--task", "pretraining", "--train-iters", "10", *size, *batch]
    pre = rapidlite_captured(*pt, "--save", str(tmp_path / "pt"))
    assert pre.returncode == 0, pre.stderr[-2000:]
    rows = [{"prompt": f"reverse: {a} {b}\n", "completion": f"{b} {a}"} for a in "abcdefgh" for b in "ijklmnop"]
    data = tmp_path / "rev.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = tmp_path / "sft"
    proc = rapidlite_captured(
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(tmp_path / "pt" / "hf"),
        "--data-path", str(data), "--split", "90,10", "--epochs", "2", "--micro-batch-size", "8",
        "--seq-length", "64", "--lr", "1e-3", "--log-interval", "1", "--packing", "--save", str(sft),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(sft) if "lr" in r]
    assert losses[-1] < losses[0]
    model = AutoModelForCausalLM.from_pretrained(sft / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(sft / "hf")
    assert type(model).__name__ == "GPT2LMHeadModel"
    ids = tokenizer("reverse: a i\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] > ids.shape[1]


def _eval_only(model_dir, data_dir, save, *flags):
    run = run_cli if "--nproc-per-node" in flags else rapidlite_captured
    proc = run(*task_args(model_dir, data_dir, "--eval-only", "--save", str(save), *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr, [r for r in read_metrics(save) if r.get("eval_only")]


def test_eval_only_scores_the_model_as_it_is_and_writes_no_checkpoint(tiny_assets, tmp_path):
    """``--eval-only``: the token-exact validation loss of the model as given (computed here by hand), its
    perplexity and the exact match of greedy completions, printed and appended to the metrics of --save, where
    nothing else is written or overwritten."""
    model_dir, data_dir = tiny_assets
    save = tmp_path / "save"
    save.mkdir()
    earlier = {"iteration": 7, "loss": 1.5}
    (save / "metrics.jsonl").write_text(json.dumps(earlier) + "\n")
    batch = ["--micro-batch-size", "3", "--global-batch-size", "3"]  # 40 rows: a last batch of one
    log, records = _eval_only(model_dir, data_dir, save, *batch, "--eval-generate", "2")
    trainer, _, valid, collate = trainer_and_data(model_dir, data_dir)
    by_hand, _ = _loss(trainer, load_causal_lm(str(model_dir)).eval(), valid, collate, len(valid))
    assert read_metrics(save)[0] == earlier and [r["split"] for r in records] == ["validation"]
    assert records[0]["iteration"] == 0 and records[0]["loss"] == pytest.approx(by_hand, rel=1e-6)
    assert records[0]["ppl"] == pytest.approx(math.exp(by_hand)) and "exact_match" in records[0]
    assert "greedy completions of 2 validation prompts" in log and "validation (--eval-only): iteration 0" in log
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl"]


@pytest.fixture(scope="module")
def trained_run(tiny_assets, tmp_path_factory):
    """A 3-step training run of the tiny model (its last evaluation and its export)."""
    model_dir, data_dir = tiny_assets
    save = tmp_path_factory.mktemp("trained")
    proc = rapidlite_captured(*task_args(model_dir, data_dir, "--train-iters", "3", "--save", str(save)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save, [r for r in read_metrics(save) if r.get("split") == "validation"][-1]


def test_eval_only_of_a_trained_export_gives_the_runs_validation_loss(tiny_assets, trained_run, tmp_path):
    _, data_dir = tiny_assets
    run, final = trained_run
    _, records = _eval_only(run / "hf", data_dir, tmp_path / "eval")
    assert final["loss"] < 5.5 and records[0]["loss"] == pytest.approx(final["loss"], rel=1e-6)


@pytest.mark.distributed
def test_eval_only_on_two_ranks_gives_the_one_process_loss(tiny_assets, trained_run, tmp_path):
    """Two ranks evaluate half the batches each (40 rows in micro-batches of 3: uneven) and the result is
    gathered: the one-process, token-exact loss."""
    _, data_dir = tiny_assets
    run, final = trained_run
    two = ["--micro-batch-size", "3", "--global-batch-size", "6", "--nproc-per-node", "2", "--eval-generate", "1"]
    _, records = _eval_only(run / "hf", data_dir, tmp_path / "eval", *two)
    assert records[0]["loss"] == pytest.approx(final["loss"], rel=1e-6) and "exact_match" in records[0]


def test_eval_only_without_a_validation_split_evaluates_all_the_data(tiny_assets, tmp_path, caplog):
    """One file and no --split: every row is evaluated, and the log says so; --split as in training evaluates
    the share a training run carves out."""
    model_dir, data_dir = tiny_assets
    data = tmp_path / "all.jsonl"
    data.write_text((data_dir / "train.jsonl").read_text())
    model = load_causal_lm(str(model_dir)).eval()
    for split, rows in (([], 240), (["--split", "90,10"], 24)):
        args = parse_args(task_args(model_dir, data, "--eval-only", *split))
        with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
            final = CausalLMFinetuner(RapidliteEngine(args=args)).train()
        # The rows a training run with the same --split would hold (no --split: all of them, in its train split).
        trainer, train, valid, collate = trainer_and_data(model_dir, data, *(split or ["--split", "100,0,0"]))
        expected = valid if split else train
        assert len(expected) == rows
        assert final["loss"] == pytest.approx(_loss(trainer, model, expected, collate, 8)[0], rel=1e-6)
        assert ("evaluating all 240 samples of its train split" in caplog.text) == (not split)
        caplog.clear()
