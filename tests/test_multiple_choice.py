"""The black box ``--task multiple_choice`` end to end, on the demo's tiny BERT and generated SWAG-style questions."""

import csv
import json

import pytest
import torch

from helpers import rapidlite, rapidlite_here, read_metrics, run_cli, train_losses
from rapidlite.cli.main import main
from rapidlite.data.multiple_choice import Layout, build_multiple_choice_data, detect_layout, label_index
from rapidlite.evaluation.metrics import multiple_choice_accuracy
from rapidlite.tasks.multiple_choice_demo import write_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny BERT for multiple choice and its tokenizer, and questions in SWAG's csv columns."""
    return write_demo_assets(tmp_path_factory.mktemp("mc"), seed=5, num_train=64, num_validation=21)


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets[0])


def task_args(model_dir, data_dir, *extra):
    return [
        "--task", "multiple_choice", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "48",
        "--epochs", "1", "--log-interval", "1", *extra,
    ]  # fmt: skip


def swag_rows(data_dir, split):
    with open(data_dir / f"{split}.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_jsonl(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def raw(**splits):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


@pytest.mark.parametrize(
    "columns, layout",
    [
        (["video-id", "sent1", "sent2", "ending0", "ending1", "ending2", "ending3", "label"],
         Layout(("sent1", "sent2"), ("ending0", "ending1", "ending2", "ending3"), "label")),  # SWAG
        (["ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "label", "split"],
         Layout(("ctx_a", "ctx_b"), ("endings",), "label")),  # HellaSwag
        (["goal", "sol1", "sol2", "label"], Layout(("goal",), ("sol1", "sol2"), "label")),  # PIQA
        (["id", "question", "question_concept", "choices", "answerKey"],
         Layout(("question",), ("choices",), "answerKey")),  # CommonsenseQA, ARC
        (["id", "question_stem", "choices", "answerKey"], Layout(("question_stem",), ("choices",), "answerKey")),
        (["example_id", "article", "question", "options", "answer"],
         Layout(("article", "question"), ("options",), "answer")),  # RACE
    ],
)  # fmt: skip
def test_the_usual_layouts_are_detected(columns, layout):
    assert detect_layout(columns) == layout


def test_flags_name_the_columns():
    columns = ["passage", "q", "cands", "gold_idx"]
    layout = detect_layout(columns, text_keys=["passage", "q"], choices_key=["cands"], label_key="gold_idx")
    assert layout == Layout(("passage", "q"), ("cands",), "gold_idx")
    assert detect_layout(["q", "a", "b", "c", "y"], ["q"], ["a", "b", "c"], "y").choices == ("a", "b", "c")


def test_labels_are_indices_digit_strings_letters_or_the_choices_own_labels():
    assert [label_index(v, None, 4) for v in (2, 2.0, "3", "B", "d", None, "")] == [2, 2, 3, 1, 3, None, None]
    assert label_index("3", ["1", "2", "3", "4"], 4) == 2  # ARC's numbered choices: the label names one
    assert label_index("C", ["A", "B", "C"], 3) == 2
    for bad in ("maybe", 1.5, True):
        with pytest.raises(ValueError):
            label_index(bad, None, 4)


def test_hellaswag_rows_pair_the_context_with_each_ending(tokenizer):
    """ctx_a is the first text, ctx_b begins every ending (as SWAG's sent2 does), labels are digit strings, and
    the test split's empty labels mean unlabelled."""
    row = {"ctx_a": "Maya went to the bakery .", "ctx_b": "then maya", "label": "2"}
    endings = ["swam in the waves .", "fixed the engine .", "baked fresh bread .", "called a client ."]
    data = build_multiple_choice_data(
        raw(train=[{**row, "endings": endings}] * 3, test=[{**row, "endings": endings, "label": ""}]), tokenizer, 48
    )
    assert data.num_choices == 4 and data.train[0]["labels"] == 2 and data.test[0]["labels"] == -1
    decoded = [tokenizer.decode(ids) for ids in data.train[0]["input_ids"]]
    assert decoded[2] == "[CLS] maya went to the bakery. [SEP] then maya baked fresh bread. [SEP]"
    assert data.train[0]["token_type_ids"][2][-3:] == [1, 1, 1]


def test_choice_dicts_with_answer_keys(tokenizer):
    first = {"text": ["beach", "bakery", "bank"], "label": ["A", "B", "C"]}
    second = {"text": ["garage", "gym", "office"], "label": ["1", "2", "3"]}
    rows = [
        {"question": "maya baked fresh bread .", "choices": first, "answerKey": "B"},
        {"question": "tom fixed the engine .", "choices": second, "answerKey": "1"},
    ]
    data = build_multiple_choice_data(raw(train=rows), tokenizer, 32)
    assert list(data.train["labels"]) == [1, 0] and data.num_choices == 3
    assert tokenizer.decode(data.train[1]["input_ids"][0]) == "[CLS] tom fixed the engine. [SEP] garage [SEP]"


def test_accuracy_agrees_with_the_reference():
    """The accuracy over the questions, by hand and as scikit-learn computes it."""
    preds = torch.tensor([0, 1, 2, 3, 1, 1, 0])
    labels = torch.tensor([0, 1, 1, 3, 2, 1, 3])
    assert multiple_choice_accuracy(preds, labels) == pytest.approx(4 / 7)
    assert multiple_choice_accuracy(torch.tensor([1, 0]), torch.tensor([1, 0])) == 1.0
    sklearn = pytest.importorskip("sklearn.metrics")
    assert multiple_choice_accuracy(preds, labels) == pytest.approx(sklearn.accuracy_score(labels, preds))


def test_cli_run_exports_a_multiple_choice_model_and_eval_only_rescores_it(tiny_assets, tmp_path):
    """SWAG csv: the run logs accuracy and loss, exports a model AutoModelForMultipleChoice loads with its
    tokenizer, and --eval-only of the export gives the run's last validation scores."""
    from transformers import AutoModelForMultipleChoice, AutoTokenizer

    model_dir, data_dir = tiny_assets
    out = tmp_path / "out"
    assert main(task_args(model_dir, data_dir, "--save", str(out))) == 0
    final = [r for r in read_metrics(out) if r.get("split") == "validation"][-1]
    assert 0 <= final["accuracy"] <= 1 and final["loss"] > 0
    model = AutoModelForMultipleChoice.from_pretrained(out / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    pairs = tokenizer(["tom went to the gym ."] * 2, ["then tom lifted heavy weights .", "then tom washed the car ."])
    logits = model(**{k: torch.tensor([v]) for k, v in pairs.items()}).logits
    assert logits.shape == (1, 2)
    assert main(task_args(out / "hf", data_dir, "--eval-only", "--save", str(tmp_path / "again"))) == 0
    again = read_metrics(tmp_path / "again")[0]
    assert again["accuracy"] == final["accuracy"] and again["loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_lora_trains_the_scoring_head_in_full(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    model_dir, data_dir = tiny_assets
    out = tmp_path / "lora"
    assert main(task_args(model_dir, data_dir, "--lora-rank", "4", "--train-iters", "2", "--save", str(out))) == 0
    adapter = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert any("classifier" in k for k in adapter) and any("lora_A" in k for k in adapter)


def test_questions_are_grouped_by_length(tiny_assets, tmp_path):
    """``--group-by-length`` measures a question by the tokens of all its choices."""
    model_dir, data_dir = tiny_assets
    out = tmp_path / "grouped"
    assert main(task_args(model_dir, data_dir, "--group-by-length", "--train-iters", "2", "--save", str(out))) == 0
    assert len(train_losses(out)) == 2


def _bad(rows, field, value):
    changed = [dict(r) for r in rows]
    changed[3][field] = value
    return changed


@pytest.mark.parametrize(
    "change, flags, words",
    [
        (
            lambda rows: _bad(rows, "label", "4"),
            [],
            "train row 4 has label '4', not a choice (0..3 or A..D); fix the label; labels counting the choices "
            "from 1 need 1 subtracted",
        ),
        (lambda rows: _bad(rows, "label", "-1"), [], "train row 4 has label '-1', not a choice"),
        (lambda rows: _bad(rows, "label", ""), [], "train row 4 has no label"),
        (lambda rows: _bad(rows, "ending2", ""), [], "train row 4: choice 2 is empty"),
        (lambda rows: _bad(rows, "sent1", ""), ["--text-keys", "sent1"], "train row 4 has an empty context"),
        (lambda rows: rows, ["--choices-key", "ending0", "ending9"], "--choices-key ending0 ending9: no such column"),
        (lambda rows: [{k: v for k, v in r.items() if k != "label"} for r in rows], [], "no label column found"),
        (lambda rows: rows, ["--padding-free"], "--padding-free: --task multiple_choice scores each question's"),
    ],
)
def test_bad_data_is_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys, change, flags, words):
    model_dir, data_dir = tiny_assets
    data = write_jsonl(tmp_path / "bad", {"train": change(swag_rows(data_dir, "train")[:8])})
    save = tmp_path / "save"
    assert main(task_args(model_dir, data, "--split", "100,0,0", "--save", str(save), *flags)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and words in err, err
    assert not save.exists() or not any(save.iterdir())


def test_every_row_and_split_needs_the_same_number_of_choices(tiny_assets, tmp_path, capsys):
    model_dir, _ = tiny_assets
    row = {"question": "q ?", "choices": ["a", "b", "c"], "label": 0}
    for splits, words in (
        ({"train": [row, {**row, "choices": ["a", "b"]}]}, "train row 2 has 2 choices, earlier rows 3"),
        ({"train": [row] * 4, "validation": [{**row, "choices": ["a", "b", "c", "d"]}]}, "validation split has 4"),
    ):
        data = write_jsonl(tmp_path / words[:5], splits)
        assert main(task_args(model_dir, data, "--split", "100,0,0")) == 2
        assert words in capsys.readouterr().err


@pytest.mark.slow
def test_demo_learns_to_pick_the_consistent_ending(tmp_path, monkeypatch):
    """``--task multiple_choice --demo``, one of its three epochs: the untrained model is at chance (a quarter), the
    fine-tuned one picks the consistent ending of most unseen questions."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli(
        "--task", "multiple_choice", "--demo", "--epochs", "1", "--save", str(tmp_path / "run"), timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["accuracy"] < 0.35
    assert evals[-1]["accuracy"] > 0.6


@pytest.mark.distributed
def test_two_ranks_train_and_evaluate_as_one_process(tiny_assets, tmp_path):
    """Data parallel and ZeRO-3 over 2 ranks: the same loss at every step and the same validation accuracy and
    loss (gathered over the ranks; 21 questions in micro-batches of 4 leave a rank a padded last batch) as one
    process with the same global batch, dropout off."""
    model_dir, data_dir = tiny_assets
    common = task_args(model_dir, data_dir, "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0")
    assert rapidlite_here(*common, "--micro-batch-size", "8", "--save", str(tmp_path / "one")) == 0
    expected = train_losses(tmp_path / "one"), read_metrics(tmp_path / "one")[-1]
    two = ["--micro-batch-size", "4", "--nproc-per-node", "2"]
    for name, layout in (("ddp", two), ("zero3", [*two, "--zero-3-memory-optimization"])):
        proc = rapidlite(*common, *layout, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert train_losses(tmp_path / name) == pytest.approx(expected[0], rel=1e-4), name
        final = read_metrics(tmp_path / name)[-1]
        assert final["accuracy"] == expected[1]["accuracy"], name
        assert final["loss"] == pytest.approx(expected[1]["loss"], rel=1e-5), name
