"""Data loading for --task sequence_classification, and the offline demo assets. Fast, no network."""

import os

# Before datasets/huggingface_hub are imported: they read these once, at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import csv  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from rapidlite.data.text_classification import (  # noqa: E402
    build_text_classification_data,
    detect_columns,
    load_raw_datasets,
    parse_split,
)
from rapidlite.errors import DataError  # noqa: E402
from rapidlite.tasks.demo import write_demo_assets  # noqa: E402
from rapidlite.tasks.demo_build import build_wordpiece_tokenizer  # noqa: E402

WORDS = "the a movie film plot was is good bad great awful not very i liked it hated , . ! ?".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("tok") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return build_wordpiece_tokenizer(vocab)


def write_csv(path, header, rows, delimiter=","):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def sentiment_rows(n, offset=0):
    return [(f"the movie was {'good' if i % 2 else 'bad'} {'very ' * (i % 3)}.", i % 2) for i in range(offset, n)]


def ds(columns):
    return datasets.Dataset.from_dict(columns)


# ---------------------------------------------------------------------------------------------- loading


def test_local_dir_with_csv(tmp_path):
    write_csv(tmp_path / "train.csv", ["sentence", "label"], sentiment_rows(10))
    write_csv(tmp_path / "validation.csv", ["sentence", "label"], sentiment_rows(4))
    write_csv(tmp_path / "test.csv", ["sentence", "label"], sentiment_rows(3))
    raw = load_raw_datasets(str(tmp_path))
    assert list(raw.keys()) == ["train", "validation", "test"]
    assert [len(raw[k]) for k in raw] == [10, 4, 3]
    assert raw["train"][1] == {"sentence": "the movie was good very .", "label": 1}


def test_tsv_is_tab_separated_and_unquoted(tmp_path):
    # A lone '"' would make a quoting CSV reader swallow the following rows.
    rows = [('"wow, he said', "x", 1), ("plain, with comma", "y", 0), ("third", "z", 1)]
    (tmp_path / "train.tsv").write_text(
        "sentence1\tsentence2\tlabel\n" + "".join(f"{a}\t{b}\t{c}\n" for a, b, c in rows), encoding="utf-8"
    )
    write_csv(tmp_path / "dev.tsv", ["sentence1", "sentence2", "label"], [("a", "b", 0)], delimiter="\t")
    raw = load_raw_datasets(str(tmp_path))
    assert len(raw["train"]) == 3
    assert raw["train"][0]["sentence1"] == '"wow, he said'
    assert raw["train"][1]["sentence1"] == "plain, with comma"


def test_jsonl_and_dev_naming(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}", "label": "pos"} for i in range(5)])
    write_jsonl(tmp_path / "dev.jsonl", [{"text": "d", "label": "neg"}])
    raw = load_raw_datasets(str(tmp_path))
    assert sorted(raw.keys()) == ["train", "validation"]
    assert len(raw["train"]) == 5 and raw["validation"][0] == {"text": "d", "label": "neg"}


def test_parquet(tmp_path):
    ds({"text": ["a", "b", "c"], "label": [0, 1, 0]}).to_parquet(str(tmp_path / "train.parquet"))
    ds({"text": ["d"], "label": [1]}).to_parquet(str(tmp_path / "valid.parquet"))
    raw = load_raw_datasets(str(tmp_path))
    assert list(raw["train"]["text"]) == ["a", "b", "c"] and list(raw["validation"]["label"]) == [1]


def test_single_file_split_80_20_is_seeded_and_disjoint(tmp_path):
    path = tmp_path / "all.csv"
    write_csv(path, ["sentence", "label"], [(f"s{i}", i % 2) for i in range(100)])
    raw = load_raw_datasets(str(path), split="80,20", seed=1)
    assert sorted(raw.keys()) == ["train", "validation"]  # zero test weight: no test split
    train, valid = list(raw["train"]["sentence"]), list(raw["validation"]["sentence"])
    assert len(train) == 80 and len(valid) == 20 and not set(train) & set(valid)
    assert train != sorted(train, key=lambda s: int(s[1:]))  # shuffled, not a prefix
    assert list(load_raw_datasets(str(path), split="0.8,0.2", seed=1)["train"]["sentence"]) == train
    assert list(load_raw_datasets(str(path), split="80,20", seed=2)["train"]["sentence"]) != train
    three = load_raw_datasets(str(path), split="969,30,1")
    # 969,30,1 of 100 rows rounds test to 0 rows; a split with weight keeps at least one row.
    assert [len(three[k]) for k in ("train", "validation", "test")] == [96, 3, 1]


def test_missing_validation_file_is_carved_from_train(tmp_path):
    write_csv(tmp_path / "train.csv", ["sentence", "label"], [(f"s{i}", i % 2) for i in range(50)])
    raw = load_raw_datasets(str(tmp_path), split="90,10,0")
    assert len(raw["train"]) == 45 and len(raw["validation"]) == 5
    assert not set(raw["train"]["sentence"]) & set(raw["validation"]["sentence"])


def test_local_dir_with_data_name_subdirectory(tmp_path):
    (tmp_path / "glue" / "sst2").mkdir(parents=True)
    write_csv(tmp_path / "glue" / "sst2" / "train.csv", ["sentence", "label"], [("a", 0), ("b", 1)])
    write_csv(tmp_path / "glue" / "sst2" / "dev.csv", ["sentence", "label"], [("c", 0)])
    raw = load_raw_datasets(str(tmp_path / "glue"), data_name="sst2")
    assert len(raw["train"]) == 2
    with pytest.raises(DataError, match="--data-name mrpc"):
        load_raw_datasets(str(tmp_path / "glue"), data_name="mrpc")


def test_an_empty_file_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: the file is empty"):
        load_raw_datasets(str(tmp_path / "empty.jsonl"))


def test_a_header_without_rows_is_one_line(tmp_path):
    """datasets says 'Instruction "train" corresponds to no data!': the file is named, and what it lacks."""
    write_csv(tmp_path / "train.csv", ["sentence", "label"], [])
    with pytest.raises(DataError, match=r"train\.csv: the file holds a header and no rows; add rows$"):
        load_raw_datasets(str(tmp_path))


def test_missing_train_file(tmp_path):
    write_csv(tmp_path / "validation.csv", ["sentence", "label"], [("a", 0)])
    with pytest.raises(DataError, match=r"--data-path .*no train\.\* file found.*train\.csv"):
        load_raw_datasets(str(tmp_path))


def test_corrupt_parquet_names_the_file(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"train\.parquet: cannot be read as parquet"):
        load_raw_datasets(str(tmp_path))


def test_corrupt_json_names_the_file(tmp_path):
    (tmp_path / "train.json").write_text('{"text": "a", "label": 0}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"train\.json: line 2 is not valid JSON \(Expecting value, column 10\); fix"):
        load_raw_datasets(str(tmp_path))


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "-1,2", "0,0", "1,,2"])
def test_malformed_split(tmp_path, split):
    write_csv(tmp_path / "all.csv", ["sentence", "label"], [("a", 0), ("b", 1)])
    with pytest.raises(DataError, match="--split"):
        load_raw_datasets(str(tmp_path / "all.csv"), split=split)


def test_parse_split_pads_and_normalizes():
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)


def test_unknown_hub_name_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries cache the variables at import, possibly before this module set them.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"--data-path no_such_dataset_rapidlite: not a local file or directory"):
        load_raw_datasets("no_such_dataset_rapidlite", "cfg")
    assert time.monotonic() - start < 10


def test_nonexistent_local_path_does_not_ask_the_hub(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        load_raw_datasets(str(tmp_path / "nope" / "train.csv"))


# ------------------------------------------------------------------------------------- column detection


def test_detects_sentence_pairs_and_label():
    d = ds({"idx": [0], "sentence1": ["a"], "sentence2": ["b"], "label": [1], "extra": ["x"]})
    assert detect_columns(d) == (("sentence1", "sentence2"), "label")


def test_detects_text_and_alternative_label_name():
    d = ds({"text": ["a"], "sentiment": ["pos"], "note": ["x"]})
    assert detect_columns(d) == (("text",), "sentiment")


def test_fallback_uses_string_columns_except_label():
    d = ds({"id": [1], "body": ["a"], "title": ["b"], "summary": ["c"], "target": [0]})
    assert detect_columns(d) == (("body", "title"), "target")


def test_overrides_and_their_errors():
    d = ds({"review_body": ["a"], "stars": [3], "text": ["t"], "label": [0]})
    assert detect_columns(d, text_keys=["review_body"], label_key="stars") == (("review_body",), "stars")
    with pytest.raises(DataError, match=r"--text-keys body: no such column body \(available: review_body"):
        detect_columns(d, text_keys=["body"])
    with pytest.raises(DataError, match=r"--label-key rating: no such column"):
        detect_columns(d, label_key="rating")
    with pytest.raises(DataError, match="--label-key: no label column found"):
        detect_columns(ds({"text": ["a"], "score": [1]}))
    with pytest.raises(DataError, match="--text-keys: no text column found"):
        detect_columns(ds({"x": [1], "label": [0]}))


# ------------------------------------------------------------------------------- labels and tokenization


def test_string_labels_are_mapped_in_sorted_order(tokenizer):
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "bad", "awful", "great"], "label": ["pos", "neg", "neg", "pos"]}),
        validation=ds({"text": ["good"], "label": ["pos"]}),
    )
    data = build_text_classification_data(raw, tokenizer, seq_length=16)
    assert data.num_labels == 2 and data.id2label == {0: "neg", 1: "pos"}
    assert list(data.train["labels"]) == [1, 0, 0, 1] and list(data.validation["labels"]) == [1]
    assert set(data.train.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert data.test is None and data.text_keys == ("text",) and data.label_key == "label"


def test_unseen_validation_label_is_an_error(tokenizer):
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "bad"], "label": ["pos", "neg"]}),
        validation=ds({"text": ["good"], "label": ["neutral"]}),
    )
    with pytest.raises(DataError, match="validation label 'neutral' does not occur in train"):
        build_text_classification_data(raw, tokenizer, seq_length=16)


def test_negative_labels_dropped_from_train_kept_in_test(tokenizer):
    raw = datasets.DatasetDict(
        train=ds({"sentence": ["good", "bad", "i liked it", "awful"], "label": [1, 0, -1, 2]}),
        validation=ds({"sentence": ["good", "bad"], "label": [1, -1]}),
        test=ds({"sentence": ["good", "bad", "great"], "label": [-1, -1, -1]}),
    )
    data = build_text_classification_data(raw, tokenizer, seq_length=16)
    assert data.num_labels == 3 and data.id2label == {0: "0", 1: "1", 2: "2"}
    assert list(data.train["labels"]) == [1, 0, 2]
    assert list(data.validation["labels"]) == [1]
    assert list(data.test["labels"]) == [-1, -1, -1]


def test_integer_labels_not_from_zero_are_mapped_to_their_sorted_values(tokenizer):
    # Star ratings 1..5 (or labels 1/2) are classes by value: no phantom class 0 in the head or the macro F1.
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "bad", "awful", "great"], "stars": [5, 1, 1, 3]}),
        validation=ds({"text": ["good", "bad"], "stars": [5, -1]}),
    )
    data = build_text_classification_data(raw, tokenizer, seq_length=16, label_key="stars")
    assert data.num_labels == 3 and data.id2label == {0: "1", 1: "3", 2: "5"}
    assert list(data.train["labels"]) == [2, 0, 0, 1] and list(data.validation["labels"]) == [2]


def test_unseen_integer_validation_label_is_an_error(tokenizer):
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "bad"], "label": [0, 1]}),
        validation=ds({"text": ["good"], "label": [2]}),
    )
    with pytest.raises(DataError, match="validation label 2 does not occur in train"):
        build_text_classification_data(raw, tokenizer, seq_length=16)


@pytest.mark.parametrize("labels", [["pos", "pos"], [1, 1]])
def test_a_single_class_is_refused(tokenizer, labels):
    # One class would make a one-output head, which transformers trains as a regression.
    raw = datasets.DatasetDict(train=ds({"text": ["good", "great"], "label": labels}))
    with pytest.raises(DataError, match="only one class"):
        build_text_classification_data(raw, tokenizer, seq_length=16)


def test_save_to_disk_directories_are_read(tmp_path, tokenizer):
    both = datasets.DatasetDict(
        train=ds({"text": ["good", "bad"] * 10, "label": [1, 0] * 10}),
        dev=ds({"text": ["great"], "label": [1]}),
    )
    both.save_to_disk(str(tmp_path / "dict"))
    raw = load_raw_datasets(str(tmp_path / "dict"))
    assert set(raw) == {"train", "validation"} and len(raw["train"]) == 20 and raw["validation"]["text"] == ["great"]
    both["train"].save_to_disk(str(tmp_path / "one"))
    raw = load_raw_datasets(str(tmp_path / "one"), split="75,25")
    assert {k: len(v) for k, v in raw.items()} == {"train": 15, "validation": 5}
    datasets.DatasetDict(validation=both["dev"]).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(DataError, match="the saved dataset has no train split"):
        load_raw_datasets(str(tmp_path / "no-train"))
    assert sorted(os.listdir(tmp_path / "one")) == ["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]


def test_a_json_object_with_its_records_under_data_is_read_as_rows(tmp_path):
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}] * 5
    (tmp_path / "obj.json").write_text(json.dumps({"version": "1.0", "data": rows}))
    raw = load_raw_datasets(str(tmp_path / "obj.json"), split="80,20")
    assert {k: len(v) for k, v in raw.items()} == {"train": 8, "validation": 2}
    assert raw["train"].column_names == ["text", "label"]
    # A one-row file whose row holds a list of records (a question's answers) stays one row.
    answers = [{"question": "q", "answers": [{"text": "a", "answer_start": 0}]}]
    (tmp_path / "one.json").write_text(json.dumps(answers))
    assert len(load_raw_datasets(str(tmp_path / "one.json"), split="100,0")["train"]) == 1
    (tmp_path / "two.json").write_text(json.dumps({"data": rows, "rows": rows}))
    with pytest.raises(DataError, match="lists of records under several keys \\(data, rows\\)"):
        load_raw_datasets(str(tmp_path / "two.json"))


def test_a_class_whose_rows_the_split_put_outside_train_goes_back_to_train(tmp_path, tokenizer):
    # --split carved validation out of one file, and the shuffle put a one-row class there: the row trains.
    rows = [("good", "pos"), ("bad", "neg")] * 10 + [("awful", "rare")]
    write_csv(tmp_path / "all.csv", ["text", "label"], rows)
    seed = next(
        s
        for s in range(100)
        if "rare" in load_raw_datasets(str(tmp_path / "all.csv"), split="80,20", seed=s)["validation"]["label"]
    )
    raw = load_raw_datasets(str(tmp_path / "all.csv"), split="80,20", seed=seed)
    data = build_text_classification_data(raw, tokenizer, seq_length=8)
    assert data.moved == {"validation": 1} and data.num_labels == 3
    assert (len(data.train), len(data.validation)) == (len(raw["train"]) + 1, len(raw["validation"]) - 1)
    assert 2 in data.train["labels"] and 2 not in data.validation["labels"]  # ids: neg 0, pos 1, rare 2
    # Unlabelled rows (GLUE's -1) of a carved split are not a class to move.
    ints = datasets.DatasetDict(
        train=ds({"text": ["good", "bad"], "label": [1, 0]}), validation=ds({"text": ["good", "bad"], "label": [1, -1]})
    )
    ints.carved = ("validation",)
    assert build_text_classification_data(ints, tokenizer, seq_length=8).moved == {}
    # A validation file of its own is the user's: an unseen label there stays one line.
    raw = datasets.DatasetDict(train=raw["train"], validation=raw["validation"])
    with pytest.raises(DataError, match="validation label 'rare' does not occur in train"):
        build_text_classification_data(raw, tokenizer, seq_length=8)


def test_labels_stay_aligned_with_text_after_a_seeded_split(tmp_path, tokenizer):
    word = {1: "good", 0: "bad", -1: "awful"}
    write_csv(tmp_path / "all.csv", ["text", "label"], [(word[i % 3 - 1], i % 3 - 1) for i in range(60)])
    data = build_text_classification_data(load_raw_datasets(str(tmp_path / "all.csv"), split="70,30"), tokenizer, 8)
    ids = {tokenizer.convert_tokens_to_ids(w): y for y, w in word.items()}
    for split in (data.train, data.validation):
        assert len(split) > 0
        assert all(ids[row["input_ids"][1]] == row["labels"] >= 0 for row in split)


def test_class_label_names_and_pairs(tokenizer):
    features = datasets.Features(
        {
            "premise": datasets.Value("string"),
            "hypothesis": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]),
        }
    )
    train = datasets.Dataset.from_dict(
        {"premise": ["the movie", "the plot"], "hypothesis": ["was good", "was bad"], "label": [0, 1]},
        features=features,
    )
    data = build_text_classification_data(datasets.DatasetDict(train=train), tokenizer, seq_length=16)
    assert data.text_keys == ("premise", "hypothesis")
    assert data.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"} and data.num_labels == 3
    assert 1 in data.train[0]["token_type_ids"]  # the second sentence is segment 1


def test_float_scores_are_a_regression(tokenizer):
    # STS-B style: scores with fractions train one output; negative scores are scores, missing ones are dropped.
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "bad", "awful", "great"], "score": [4.5, -1.0, None, 3.0]}),
        validation=ds({"text": ["good", "bad"], "score": [5, 0]}),
        test=ds({"text": ["good"], "score": [None]}),
    )
    data = build_text_classification_data(raw, tokenizer, seq_length=16, label_key="score")
    assert data.regression and data.num_labels == 1 and data.id2label == {0: "score"}
    assert data.dropped == {"train": (1, 4)}
    assert list(data.train["labels"]) == [4.5, -1.0, 3.0] and list(data.validation["labels"]) == [5.0, 0.0]
    batch = data.collate_fn([data.train[0], data.train[1]])
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == [4.5, -1.0]
    assert torch.isnan(torch.tensor(data.test["labels"])).all()
    bad = datasets.DatasetDict(train=raw["train"], validation=ds({"text": ["good"], "score": ["high"]}))
    with pytest.raises(DataError, match="validation label 'high' is not a number like the train scores"):
        build_text_classification_data(bad, tokenizer, seq_length=16, label_key="score")
    whole = datasets.DatasetDict(train=ds({"text": ["good", "bad"], "label": [1.0, 0.0]}))
    assert not build_text_classification_data(whole, tokenizer, seq_length=16).regression  # whole numbers: classes


def test_regression_metrics_are_pearson_spearman_and_mse():
    from scipy.stats import pearsonr, spearmanr

    from rapidlite.evaluation.metrics import regression_metrics

    scores, labels = torch.tensor([0.1, 2.0, 2.5, 4.0, 3.0]), torch.tensor([0.0, 1.5, 3.0, 5.0, 2.0])
    metrics = regression_metrics(scores, labels)
    assert metrics["pearson"] == pytest.approx(pearsonr(scores, labels)[0], rel=1e-6)
    assert metrics["spearmanr"] == pytest.approx(spearmanr(scores, labels)[0], rel=1e-6)
    assert metrics["loss"] == pytest.approx(float(((scores - labels) ** 2).mean()), rel=1e-6)


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_classification_metrics_equal_torchmetrics(num_labels):
    """Accuracy and F1 (binary: the positive class; more labels: macro over the classes that occur) equal
    torchmetrics' on random predictions, with classes missing from either side; no rows give NaN."""
    from torchmetrics.functional.classification import binary_f1_score, multiclass_accuracy, multiclass_f1_score

    from rapidlite.evaluation.metrics import classification_metrics

    generator = torch.Generator().manual_seed(num_labels)
    cases = [torch.randint(0, num_labels, (2, n), generator=generator) for n in (1, 7, 50, 200)]
    cases += [torch.tensor([[0, 0, 0], [0, 0, 0]]), torch.tensor([[0, 1, 0], [1, 1, 1]])]  # one class; no negatives
    for preds, labels in cases:
        ours = classification_metrics(preds, labels, num_labels)
        accuracy = multiclass_accuracy(preds, labels, num_classes=max(num_labels, 2), average="micro")
        if num_labels == 2:
            f1 = binary_f1_score(preds, labels)
        else:
            f1 = multiclass_f1_score(preds, labels, num_classes=num_labels, average="macro")
        assert ours == pytest.approx({"accuracy": float(accuracy), "f1": float(f1)}, rel=1e-6), (preds, labels)
    empty = classification_metrics(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 3)
    assert all(v != v for v in empty.values())


def test_regression_metrics_equal_torchmetrics_with_ties():
    """Pearson, Spearman (tied values share their mean rank) and the mean squared error equal torchmetrics' and
    scipy's on random scores, with ties on both sides; a constant side gives NaN correlations."""
    from scipy.stats import spearmanr
    from torchmetrics.functional import mean_squared_error, pearson_corrcoef, spearman_corrcoef

    from rapidlite.evaluation.metrics import regression_metrics

    generator = torch.Generator().manual_seed(0)
    for n in (2, 9, 100):
        scores = torch.randint(0, 5, (n,), generator=generator).double() / 2  # STS-B's half steps: many ties
        labels = torch.rand(n, generator=generator, dtype=torch.float64).mul(5).round()
        if scores.std() == 0 or labels.std() == 0:
            continue
        ours = regression_metrics(scores, labels)
        assert ours["pearson"] == pytest.approx(float(pearson_corrcoef(scores, labels)), rel=1e-6)
        assert ours["spearmanr"] == pytest.approx(float(spearman_corrcoef(scores, labels)), rel=1e-6)
        assert ours["spearmanr"] == pytest.approx(spearmanr(scores, labels)[0], rel=1e-6)
        assert ours["loss"] == pytest.approx(float(mean_squared_error(scores, labels)), rel=1e-6)
    constant = regression_metrics(torch.ones(4), torch.arange(4.0))
    assert constant["pearson"] != constant["pearson"] and constant["loss"] == pytest.approx(1.5)


def test_scoring_a_classifier_imports_no_torchmetrics():
    """Importing torchmetrics costs an evaluating process about 2.5 s of CPU; classification does not need it."""
    code = (
        "import sys, torch\n"
        "from rapidlite.evaluation.metrics import classification_metrics, multiple_choice_accuracy, "
        "regression_metrics\n"
        "classification_metrics(torch.tensor([0, 1]), torch.tensor([1, 1]), 2)\n"
        "regression_metrics(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0]))\n"
        "multiple_choice_accuracy(torch.tensor([0]), torch.tensor([0]))\n"
        "print('torchmetrics' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]


def test_empty_train_is_refused(tokenizer):
    raw = datasets.DatasetDict(train=ds({"text": [], "label": []}))
    with pytest.raises(DataError, match="train split is empty"):
        build_text_classification_data(raw, tokenizer, seq_length=16)


def test_truncation_and_collate_pads_to_longest(tokenizer):
    raw = datasets.DatasetDict(
        train=ds({"text": ["good", "the movie was very very good", "bad " * 50], "label": [1, 1, 0]})
    )
    data = build_text_classification_data(raw, tokenizer, seq_length=12)
    assert max(len(ids) for ids in data.train["input_ids"]) == 12
    batch = data.collate_fn([data.train[0], data.train[1]])
    assert type(batch) is dict
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert batch["input_ids"].shape == (2, 8)  # [CLS] + 6 words + [SEP], not padded to seq_length
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch["input_ids"][0, 3:].eq(tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [1, 1]


def test_end_to_end_from_csv_directory(tmp_path, tokenizer):
    write_csv(
        tmp_path / "train.csv",
        ["review", "sentiment"],
        [("the plot was good", "positive")] * 3 + [("the plot was awful", "negative")] * 3,
    )
    write_csv(tmp_path / "dev.csv", ["review", "sentiment"], [("great", "positive")])
    data = build_text_classification_data(load_raw_datasets(str(tmp_path)), tokenizer, seq_length=32)
    assert data.text_keys == ("review",) and data.id2label == {0: "negative", 1: "positive"}
    assert len(data.train) == 6 and tokenizer.unk_token_id not in data.train[0]["input_ids"]
    assert sorted(os.listdir(tmp_path)) == ["dev.csv", "train.csv"]  # no cache files next to user data


# ---------------------------------------------------------------------------------------------- demo


def test_demo_assets_are_deterministic_and_load_offline(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    sizes = {"num_train": 60, "num_validation": 20, "num_test": 20}
    model_a, data_a = write_demo_assets(tmp_path / "a", seed=3, **sizes)
    model_b, data_b = write_demo_assets(tmp_path / "b", seed=3, **sizes)
    _, data_c = write_demo_assets(tmp_path / "c", seed=4, **sizes)
    for name in ("train.csv", "validation.csv", "test.csv"):
        assert (data_a / name).read_bytes() == (data_b / name).read_bytes()
    assert (data_a / "train.csv").read_bytes() != (data_c / "train.csv").read_bytes()
    assert (model_a / "vocab.txt").read_text().splitlines()[:5] == [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    ]

    raw = load_raw_datasets(str(data_a))
    assert raw["train"].column_names == ["sentence", "label"] and len(raw["train"]) == 60
    assert set(raw["train"]["label"]) == {"negative", "positive"}
    sentences = [s for split in raw.values() for s in split["sentence"]]
    assert len(set(sentences)) == len(sentences)  # no sentence shared between splits

    tok = AutoTokenizer.from_pretrained(model_a)
    ids = tok(sentences)["input_ids"]
    assert all(len(i) > 2 and tok.unk_token_id not in i for i in ids)
    model_1 = AutoModelForSequenceClassification.from_pretrained(model_a, num_labels=2)
    model_2 = AutoModelForSequenceClassification.from_pretrained(model_b, num_labels=2)
    for (name, p1), p2 in zip(model_1.state_dict().items(), model_2.state_dict().values(), strict=True):
        assert torch.equal(p1, p2), name
    assert model_1.config.id2label == {0: "negative", 1: "positive"}
    batch = tok(sentences[:4], padding=True, return_tensors="pt")
    assert model_1(**batch).logits.shape == (4, 2)


def test_demo_assets_are_reused_when_unchanged(tmp_path):
    sizes = {"num_train": 30, "num_validation": 10, "num_test": 10}
    model_dir, data_dir = write_demo_assets(tmp_path, seed=1, **sizes)
    stamp = {p: p.stat().st_mtime_ns for p in [*model_dir.iterdir(), *data_dir.iterdir()]}
    write_demo_assets(tmp_path, seed=1, **sizes)
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    write_demo_assets(tmp_path, seed=1, num_train=40, num_validation=10, num_test=10)
    assert len((data_dir / "train.csv").read_text().splitlines()) == 41
    assert json.loads((tmp_path / "demo_manifest.json").read_text())["num_train"] == 40
