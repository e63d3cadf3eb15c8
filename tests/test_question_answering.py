"""The black box ``--task question_answering`` (SQuAD-style extractive QA), on the demo's tiny BERT and data."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from torchmetrics.functional.text import squad as torchmetrics_squad

from helpers import rapidlite, rapidlite_here, read_metrics, train_losses
from rapidlite import RapidliteEngine
from rapidlite.cli.main import main
from rapidlite.data.question_answering import FeatureMeta, postprocess_predictions
from rapidlite.data.question_answering_rows import QAExample, read_answers
from rapidlite.evaluation.metrics import normalize_answer, squad_v1_metrics, squad_v2_metrics
from rapidlite.resolve import parse_args
from rapidlite.tasks.question_answering import QuestionAnsweringFinetuner
from rapidlite.tasks.question_answering_demo import write_demo_assets


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    """The demo's tiny BERT and tokenizer, and generated SQuAD-style jsonl (train 120, validation 30 rows)."""
    return write_demo_assets(tmp_path_factory.mktemp("qa"), seed=5, num_train=120, num_validation=30)


def rows_of(data_dir, split):
    return [json.loads(line) for line in open(data_dir / f"{split}.jsonl")]


def write_jsonl(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def task_args(model_dir, data_dir, *extra):
    return [
        "--task", "question_answering", "--pretrained-model-name-or-path", str(model_dir), "--data-path",
        str(data_dir), "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "3e-3", "--seq-length", "64",
        "--doc-stride", "16", "--epochs", "1", "--log-interval", "1", "--no-progress", *extra,
    ]  # fmt: skip


def trainer_for(model_dir, data_dir, *extra):
    trainer = QuestionAnsweringFinetuner(RapidliteEngine(args=parse_args(task_args(model_dir, data_dir, *extra))))
    trainer.datasets = trainer.train_valid_test_datasets_provider()
    return trainer


# ------------------------------------------------------------------------------------------------ metrics


def test_squad_v1_scores_as_the_official_script():
    """Hand-computed with evaluate-v1.1.py's rules: normalised text (case, punctuation, articles, spaces), F1 over
    tokens, the best over the gold answers, percentages."""
    predictions = ["The Eiffel  tower!", "in Paris", "a red car", "nothing here"]
    references = [["Eiffel Tower"], ["Paris", "the city of Paris"], ["the blue car", "red"], ["Rome"]]
    # 1: exact after normalisation. 2: F1 vs "paris" = 2*(1/2*1)/(1/2+1) = 2/3; vs "city of paris": p=1/2,
    # r=1/3 -> 0.4; best 2/3. 3: vs "blue car": p=r=1/2 -> 1/2; vs "red": p=1/2, r=1 -> 2/3. 4: 0.
    expected_f1 = 100 * (1 + 2 / 3 + 2 / 3 + 0) / 4
    scores = squad_v1_metrics(predictions, references)
    assert scores == {"exact_match": pytest.approx(25.0), "f1": pytest.approx(expected_f1)}
    assert normalize_answer("  The  (Eiffel) Tower, a tower.") == "eiffel tower tower"
    # torchmetrics agrees wherever no answer normalises to nothing...
    ids = [str(i) for i in range(len(predictions))]
    tm = torchmetrics_squad(
        [{"prediction_text": p, "id": i} for p, i in zip(predictions, ids, strict=True)],
        [{"answers": {"text": r, "answer_start": [0] * len(r)}, "id": i} for r, i in zip(references, ids, strict=True)],
    )
    assert float(tm["exact_match"]) == pytest.approx(scores["exact_match"])
    assert float(tm["f1"]) == pytest.approx(scores["f1"], rel=1e-6)
    # ...but not where one does: the official v1.1 F1 of "The" against "the" is 0 (no shared token), torchmetrics
    # scores it 1 as v2.0 does; exact match is 1 for both.
    assert squad_v1_metrics(["The"], [["the"]]) == {"exact_match": 100.0, "f1": 0.0}
    tm = torchmetrics_squad([{"prediction_text": "The", "id": "0"}], [{"answers": {"text": ["the"]}, "id": "0"}])
    assert float(tm["f1"]) == 100.0


def test_squad_v2_scores_as_the_official_script():
    """Hand-computed with evaluate-v2.0.py's rules: a no-answer question is answered right only by "", gold
    answers that normalise to nothing are dropped, and HasAns/NoAns split the totals."""
    predictions = ["Paris", "the city", "", "London", "", "a"]
    references = [["Paris"], ["Paris city"], ["Rome"], [], [], ["The"]]
    # exact: 1, 0, 0, 0, 1, 1 ("the" normalises to nothing: the gold is "", and "a" normalises to "" too)
    # f1:    1, 2*(1*1/2)/(1+1/2)=2/3, 0 (empty prediction), 0, 1, 1
    scores = squad_v2_metrics(predictions, references)
    assert scores == {
        "exact": pytest.approx(100 * 3 / 6),
        "f1": pytest.approx(100 * (1 + 2 / 3 + 0 + 0 + 1 + 1) / 6),
        "total": 6,
        "HasAns_exact": pytest.approx(100 * 2 / 4),
        "HasAns_f1": pytest.approx(100 * (1 + 2 / 3 + 0 + 1) / 4),
        "HasAns_total": 4,
        "NoAns_exact": pytest.approx(50.0),
        "NoAns_f1": pytest.approx(50.0),
        "NoAns_total": 2,
    }
    assert "NoAns_exact" not in squad_v2_metrics(["x"], [["x"]])  # the official script reports only splits it has


# ------------------------------------------------------------------------------------------------ post-processing


def test_postprocessing_picks_the_best_valid_span_over_windows():
    context = "abcdefghij"
    # Two windows of one example: [CLS] q [SEP] then context characters one per token; -1: not context.
    offsets_a = np.array([[-1, -1], [-1, -1], [-1, -1], [0, 1], [1, 2], [2, 3], [3, 4], [-1, -1]])
    offsets_b = np.array([[-1, -1], [-1, -1], [-1, -1], [2, 3], [3, 4], [4, 5], [5, 6], [-1, -1]])
    meta = [FeatureMeta(0, offsets_a, 0), FeatureMeta(0, offsets_b, 0)]
    examples = [QAExample("q1", context, ["ef"])]
    neg = -10.0
    # Window a: the question tokens score highest (never an answer) and an end before its start is invalid.
    start_a = np.array([neg, 9, 9, neg, neg, 3, neg, 9])
    end_a = np.array([neg, 9, 9, 2, neg, neg, neg, 9])
    # Window b (tokens c d e f): the best valid span "ef" scores 4 + 4; "cdef" (5 + 4) is longer than 3 tokens.
    start_b = np.array([neg, neg, neg, 5, neg, 4, neg, neg])
    end_b = np.array([neg, neg, neg, neg, neg, neg, 4, neg])
    texts, diffs = postprocess_predictions(examples, meta, [start_a, start_b], [end_a, end_b], max_answer_length=3)
    assert texts == ["ef"] and diffs == [None]
    # Allowing four tokens, "cdef" wins.
    assert postprocess_predictions(examples, meta, [start_a, start_b], [end_a, end_b], max_answer_length=4)[0] == [
        "cdef"
    ]
    # n_best_size 1 sees only each window's best start and end: no valid span of at most 3 tokens is left.
    one = postprocess_predictions(
        examples, meta, [start_a, start_b], [end_a, end_b], n_best_size=1, max_answer_length=3
    )
    assert one[0] == ["empty"]


def test_postprocessing_v2_compares_the_null_score_with_the_threshold():
    context = "abcd"
    offsets = np.array([[-1, -1], [-1, -1], [0, 1], [1, 2], [2, 3], [3, 4], [-1, -1]])
    meta = [FeatureMeta(0, offsets, 0), FeatureMeta(0, offsets, 0)]
    examples = [QAExample("q", context, [])]
    start = [np.array([3.0, 0, 2, 0, 0, 0, 0]), np.array([1.0, 0, 1, 0, 0, 0, 0])]
    end = [np.array([3.0, 0, 0, 2, 0, 0, 0]), np.array([1.0, 0, 0, 1, 0, 0, 0])]
    # The null score is the lowest over windows (1 + 1 = 2); the best span "ab" scores 2 + 2 = 4: diff -2.
    texts, diffs = postprocess_predictions(examples, meta, start, end, version_2_with_negative=True)
    assert texts == ["ab"] and diffs == [pytest.approx(-2.0)]
    texts, _ = postprocess_predictions(
        examples, meta, start, end, version_2_with_negative=True, null_score_diff_threshold=-3.0
    )
    assert texts == [""]


# ------------------------------------------------------------------------------------------------ windows


def test_an_answer_in_the_second_window_is_labelled_there_with_the_right_offsets(tiny_assets, tmp_path):
    """A context longer than --seq-length is cut into windows overlapping by --doc-stride tokens; the answer is
    labelled in the window that holds it (the CLS token in the others), and the kept offsets map its tokens back
    to its text."""
    model_dir, data_dir = tiny_assets
    row = rows_of(data_dir, "validation")[0]
    context = row["context"] + " " + row["context"]  # the answer is in the first half; ask for the second one
    answer = row["answers"]["text"][0]
    start = context.index(answer, len(row["context"]) + 1)
    long = {"id": "long", "context": context, "question": row["question"],
            "answers": {"text": [answer], "answer_start": [start]}}  # fmt: skip
    data = write_jsonl(tmp_path / "long", {"train": [long] * 2, "validation": [long]})
    trainer = trainer_for(model_dir, data, "--seq-length", "32", "--doc-stride", "8")
    d, tok = trainer.data, trainer.tokenizer
    assert d.windows["validation"] >= 2
    valid = d.validation
    labelled = [i for i in range(len(valid)) if valid[i]["start_positions"] != 0]
    assert labelled and labelled[0] >= 1 and valid[0]["start_positions"] == 0  # CLS in the first window
    i = labelled[0]
    s, e = valid[i]["start_positions"], valid[i]["end_positions"]
    offsets = d.meta[d.windows_of["validation"].start + i].offsets
    assert context[offsets[s][0] : offsets[e][1]] == answer and offsets[s][0] == start
    assert tok.decode(valid[i]["input_ids"][s : e + 1]) == answer.lower()
    # Consecutive windows share --doc-stride context tokens.
    first, second = (
        [t for t, o in zip(valid[k]["input_ids"], d.meta[k].offsets, strict=True) if o[0] >= 0] for k in (0, 1)
    )
    assert first[-8:] == second[:8]
    assert all(len(valid[k]["input_ids"]) <= 32 for k in range(len(valid)))


class OracleModel(torch.nn.Module):
    """Scores each window's labelled answer tokens highest, wherever the batch's padding puts them: a model
    whose predictions are exactly the labels."""

    def __init__(self, labels, left):
        super().__init__()
        self.labels, self.left = labels, left
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        start = torch.zeros(input_ids.shape, dtype=torch.float32)
        end = torch.zeros(input_ids.shape, dtype=torch.float32)
        for row in range(len(input_ids)):
            real = attention_mask[row].bool()
            s, e = self.labels[tuple(input_ids[row][real].tolist())]
            shift = int((~real).sum()) if self.left else 0
            start[row, s + shift] = end[row, e + shift] = 10.0
        return type("Output", (), {"start_logits": start, "end_logits": end})()


@pytest.mark.parametrize("side", ["right", "left"])
def test_exact_logits_give_full_marks_on_either_padding_side(tiny_assets, tmp_path, side):
    """Windows of a left-padding tokenizer put the context first; either way the labels, the collator's padding
    and the evaluation's realignment agree: logits that peak at the labels score 100."""
    model_dir, data_dir = tiny_assets
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": side}))
    trainer = trainer_for(model, data_dir, "--seq-length", "32", "--doc-stride", "8")
    valid = trainer.data.validation
    assert trainer.tokenizer.padding_side == side and trainer.data.windows["validation"] > 30  # windows: > 1 each
    first = valid[0]
    sequence = trainer.tokenizer.decode(first["input_ids"])
    assert sequence.index(rows_of(data_dir, "validation")[0]["question"].lower()[:8]) > (side == "left") * 15
    labels = {tuple(f["input_ids"]): (f["start_positions"], f["end_positions"]) for f in valid}
    rows = [valid[i] for i in range(len(valid))]
    batches = [trainer.data.collate_fn(rows[k : k + 7]) for k in range(0, len(rows), 7)][::-1]  # any order
    metrics = trainer.run_compute_metrics([OracleModel(labels, side == "left")], batches)
    assert metrics["exact_match"] == 100.0 and metrics["f1"] == 100.0


# ------------------------------------------------------------------------------------------------ data layouts


def test_squad_file_layout_csv_and_parquet_give_the_same_examples(tiny_assets, tmp_path):
    """The official SQuAD json layout, a csv with answer_text/answer_start columns, a csv with the answers as JSON
    in the cell and parquet with a dict column all read as the jsonl rows do."""
    import pandas as pd

    model_dir, data_dir = tiny_assets
    splits = {s: rows_of(data_dir, s) for s in ("train", "validation")}
    squad = tmp_path / "squad"
    squad.mkdir()
    for split, rows in splits.items():
        answers = [[{"text": r["answers"]["text"][0], "answer_start": r["answers"]["answer_start"][0]}] for r in rows]
        qas = [{"id": r["id"], "question": r["question"], "answers": a} for r, a in zip(rows, answers, strict=True)]
        paragraphs = [{"context": r["context"], "qas": [qa]} for r, qa in zip(rows, qas, strict=True)]
        (squad / f"{split}.json").write_text(
            json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]})
        )
    plain, cell, parquet = tmp_path / "plain", tmp_path / "cell", tmp_path / "parquet"
    for directory in (plain, cell, parquet):
        directory.mkdir()
    for split, rows in splits.items():
        with open(plain / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "question", "context", "answer_text", "answer_start"])
            w.writerows([r["id"], r["question"], r["context"], r["answers"]["text"][0], r["answers"]["answer_start"][0]]
                        for r in rows)  # fmt: skip
        with open(cell / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "question", "context", "answers"])
            w.writerows([r["id"], r["question"], r["context"], json.dumps(r["answers"])] for r in rows)
        pd.DataFrame(rows).to_parquet(parquet / f"{split}.parquet")
    reference = trainer_for(model_dir, data_dir).data
    for directory in (squad, plain, cell, parquet):
        d = trainer_for(model_dir, directory).data
        assert d.examples["validation"] == reference.examples["validation"], directory.name
        assert d.train["start_positions"] == reference.train["start_positions"], directory.name


def test_answer_layouts():
    assert read_answers({"text": ["a"], "answer_start": [3]}) == (["a"], [3])
    assert read_answers({"text": "a", "answer_start": 3}) == (["a"], [3])
    assert read_answers([{"text": "a", "answer_start": 3}, {"text": "bc", "answer_start": 5}]) == (["a", "bc"], [3, 5])
    assert read_answers('{"text": [], "answer_start": []}') == ([], [])
    with pytest.raises(ValueError, match="2 texts but 1"):
        read_answers({"text": ["a", "b"], "answer_start": [1]})


# ------------------------------------------------------------------------------------------------ bad data


def _refused(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def test_bad_data_is_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys):
    model_dir, data_dir = tiny_assets
    rows = rows_of(data_dir, "train")[:16]
    save = tmp_path / "save"

    shifted = [dict(r) for r in rows]
    shifted[5] = {**rows[5], "answers": {"text": rows[5]["answers"]["text"], "answer_start": [0]}}
    data = write_jsonl(tmp_path / "shifted", {"train": shifted, "validation": rows[:4]})
    err = _refused(task_args(model_dir, data, "--save", str(save)), capsys)
    assert f"train row 5 (id {rows[5]['id']})" in err and "is not in the context at answer_start 0" in err

    data = write_jsonl(tmp_path / "columns", {"train": [{"q": r["question"], "c": r["context"]} for r in rows]})
    assert "no question column found" in _refused(task_args(model_dir, data, "--save", str(save)), capsys)
    assert "no answers column found" in _refused(
        task_args(model_dir, data, "--text-keys", "q", "c", "--save", str(save)), capsys
    )
    assert "two columns" in _refused(task_args(model_dir, data, "--text-keys", "q", "--save", str(save)), capsys)

    unanswered = [{**r, "answers": {"text": [], "answer_start": []}} if i == 3 else r for i, r in enumerate(rows)]
    data = write_jsonl(tmp_path / "v2", {"train": unanswered, "validation": rows[:4]})
    assert "--version-2-with-negative" in _refused(task_args(model_dir, data, "--save", str(save)), capsys)

    data = write_jsonl(tmp_path / "novalid", {"train": rows, "validation": [{"question": "x", "context": "y"}]})
    assert "validation split lacks column answers" in _refused(task_args(model_dir, data, "--save", str(save)), capsys)

    err = _refused(task_args(model_dir, data_dir, "--seq-length", "20", "--save", str(save)), capsys)
    assert "raise --seq-length or lower --doc-stride" in err
    err = _refused(task_args(model_dir, data_dir, "--doc-stride", "64", "--save", str(save)), capsys)
    assert "--doc-stride 64: must be positive and below --seq-length 64" in err
    err = _refused(task_args(model_dir, data_dir, "--padding-free", "--save", str(save)), capsys)
    assert "--padding-free: question answering" in err and "drop --padding-free" in err
    assert not save.exists() or not any(save.iterdir())


# ------------------------------------------------------------------------------------------------ runs


def test_dry_run_plans_the_question_answering_model(tiny_assets, capsys):
    """--dry-run builds the task's model class (the span head) on the meta device from the directory's config."""
    from transformers import AutoModelForQuestionAnswering

    model_dir, data_dir = tiny_assets
    assert main([*task_args(model_dir, data_dir), "--dry-run"]) == 0
    out = capsys.readouterr().out
    params = sum(p.numel() for p in AutoModelForQuestionAnswering.from_pretrained(model_dir).parameters())
    assert f"model: {params / 1e6:.2f}M parameters" in out, out


@pytest.fixture(scope="module")
def trained_run(tiny_assets, tmp_path_factory):
    """A 6-iteration run with --save (its metrics and export)."""
    model_dir, data_dir = tiny_assets
    save = tmp_path_factory.mktemp("trained")
    assert rapidlite_here(*task_args(model_dir, data_dir, "--train-iters", "6", "--save", str(save))) == 0
    return save


def test_a_run_logs_squad_metrics_and_exports_a_question_answering_model(tiny_assets, trained_run, tmp_path):
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    model_dir, data_dir = tiny_assets
    final = [r for r in read_metrics(trained_run) if r.get("split") == "validation"][-1]
    assert {"exact_match", "f1", "loss"} <= final.keys() and final["iteration"] == 6
    assert 0 <= final["exact_match"] <= final["f1"] <= 100
    model = AutoModelForQuestionAnswering.from_pretrained(trained_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(trained_run / "hf")
    assert type(model).__name__ == "BertForQuestionAnswering"
    out = model(**tokenizer("Where was Olga born?", "Olga was born in Oslo.", return_tensors="pt"))
    assert out.start_logits.shape == out.end_logits.shape
    # --eval-only of the export scores the validation data as the run's last evaluation did.
    assert rapidlite_here(*task_args(trained_run / "hf", data_dir, "--eval-only", "--save", str(tmp_path))) == 0
    rescored = read_metrics(tmp_path)[0]
    for key in ("exact_match", "f1", "loss"):
        assert rescored[key] == pytest.approx(final[key], rel=1e-6), key


def test_squad_v2_data_reports_has_and_no_answer_scores(tiny_assets, tmp_path, log_lines):
    """SQuAD v2 rows (a third unanswerable) train and report the official v2 scores with their HasAns/NoAns
    splits; the run also groups its windows by length (--group-by-length)."""
    model_dir, data_dir = tiny_assets
    rows = {s: rows_of(data_dir, s) for s in ("train", "validation")}
    # Every third question is asked about another context: unanswerable there.
    for split in rows:
        contexts = [r["context"] for r in rows[split]]
        for i in range(0, len(rows[split]), 3):
            rows[split][i] = {**rows[split][i], "context": contexts[(i + 9) % len(contexts)],
                              "answers": {"text": [], "answer_start": []}}  # fmt: skip
    data = write_jsonl(tmp_path / "v2", rows)
    flags = ("--version-2-with-negative", "--group-by-length", "--train-iters", "2", "--save", str(tmp_path / "run"))
    assert rapidlite_here(*task_args(model_dir, data, *flags)) == 0
    assert any(line.startswith("--group-by-length: ") for line in log_lines)
    final = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"][-1]
    assert final["total"] == 30 and final["NoAns_total"] == 10 and final["HasAns_total"] == 20
    assert final["exact"] == pytest.approx((20 * final["HasAns_exact"] + 10 * final["NoAns_exact"]) / 30)


def test_lora_trains_the_span_head_in_full(tiny_assets):
    model_dir, data_dir = tiny_assets
    trainer = QuestionAnsweringFinetuner(
        RapidliteEngine(args=parse_args(task_args(model_dir, data_dir, "--train-iters", "2", "--lora-rank", "4")))
    )
    trainer.train()
    base = trainer.model.get_base_model()
    head = base.qa_outputs.modules_to_save["default"]
    assert head.weight.requires_grad and not base.bert.embeddings.word_embeddings.weight.requires_grad
    from transformers import AutoModelForQuestionAnswering

    initial = AutoModelForQuestionAnswering.from_pretrained(model_dir).qa_outputs.weight
    assert not torch.equal(head.weight.detach(), initial)


@pytest.mark.distributed
def test_two_ranks_ddp_and_zero3_train_and_evaluate_as_one_process(tiny_assets, tmp_path):
    """2 ranks under DDP and under ZeRO-3 (dropout 0): the same loss at every step and the same exact match, F1
    and validation loss as one process with the same global batch. Contexts are cut into windows of 32 tokens,
    which the ranks evaluate in shares (their last batches padded) and gather back in order."""
    model_dir, data_dir = tiny_assets
    common = ["--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    common += ["--seq-length", "32", "--doc-stride", "8"]
    layouts = {
        "one": ["--micro-batch-size", "8"],
        "ddp": ["--micro-batch-size", "4", "--nproc-per-node", "2"],
        "zero3": ["--micro-batch-size", "4", "--nproc-per-node", "2", "--zero-3-memory-optimization"],
    }
    results = {}
    for name, layout in layouts.items():
        argv = task_args(model_dir, data_dir, *common, *layout, "--save", str(tmp_path / name))
        if name == "one":
            assert rapidlite_here(*argv) == 0
        else:
            proc = rapidlite(*argv)
            assert proc.returncode == 0, proc.stderr[-3000:]
        final = [r for r in read_metrics(tmp_path / name) if r.get("split") == "validation"][-1]
        results[name] = (train_losses(tmp_path / name), final)
    losses, final = results["one"]
    assert len(losses) == 4
    for name in ("ddp", "zero3"):
        assert results[name][0] == pytest.approx(losses, rel=1e-4), name
        for key in ("exact_match", "f1"):
            assert results[name][1][key] == pytest.approx(final[key], abs=1e-9), (name, key)
        assert results[name][1]["loss"] == pytest.approx(final["loss"], rel=1e-4), name


@pytest.mark.slow
def test_demo_learns_to_read(tmp_path, monkeypatch):
    """``--task question_answering --demo``, five of its eight epochs: exact match goes from the untrained model's
    few percent to well above guessing among the context's answers of the asked kind (about 43%)."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = rapidlite(
        "--task", "question_answering", "--demo", "--epochs", "5", "--save", str(tmp_path / "run"), timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["exact_match"] < 25
    assert evals[-1]["exact_match"] >= 65 and evals[-1]["f1"] >= 65
