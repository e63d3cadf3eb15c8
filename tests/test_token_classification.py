"""The black box ``--task token_classification``: seqeval's scores, word/sub-token alignment, CoNLL and tabular data,
bad data, and runs on the demo's tiny BERT and generated entity data."""

import json
import random
import warnings

import datasets
import pytest
import torch

from helpers import rapidlite, rapidlite_here, read_metrics, run_cli, train_losses
from rapidlite import RapidliteEngine
from rapidlite.cli.main import main
from rapidlite.data.token_classification import (
    IGNORE,
    Sentences,
    align_labels,
    b_to_i_labels,
    build_token_classification_data,
    load_token_datasets,
    most_frequent_tag_baseline,
)
from rapidlite.errors import DataError
from rapidlite.evaluation.metrics import entities, is_entity_tagset, tagging_metrics
from rapidlite.resolve import parse_args
from rapidlite.tasks.demo_build import build_wordpiece_tokenizer
from rapidlite.tasks.token_classification import TokenClassificationFinetuner, load_word_tokenizer
from rapidlite.tasks.token_classification_demo import write_conll, write_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny BERT and WordPiece tokenizer, and generated entity data in CoNLL files."""
    return write_demo_assets(tmp_path_factory.mktemp("tokcls"), seed=5, num_train=160, num_validation=30, num_test=20)


def task_args(model_dir, data_dir, *extra):
    return [
        "--task", "token_classification", "--pretrained-model-name-or-path", str(model_dir),
        "--data-path", str(data_dir), "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "3e-3",
        "--seq-length", "48", "--epochs", "1", "--log-interval", "5", *extra,
    ]  # fmt: skip


def trainer_for(*argv):
    return TokenClassificationFinetuner(RapidliteEngine(args=parse_args(list(argv))))


# ------------------------------------------------------------------------------------------------ scores


def seqeval_scores(true, pred):
    from seqeval.metrics import accuracy_score, classification_report, f1_score, precision_score, recall_score

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zero divisions (scored 0) and non-entity tags warn
        out = {
            "precision": precision_score(true, pred),
            "recall": recall_score(true, pred),
            "f1": f1_score(true, pred),
            "accuracy": accuracy_score(true, pred),
        }
        report = classification_report(true, pred, output_dict=True)
    for type_, row in report.items():
        if not type_.endswith(" avg"):
            out |= {f"{type_}_precision": row["precision"], f"{type_}_recall": row["recall"]}
            out |= {f"{type_}_f1": row["f1-score"], f"{type_}_number": row["support"]}
    return out


FIXED = [
    # (true, pred): IOB2, I- without B-, type switches inside a span, 'O' only, IOBES, a B- after I-.
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-LOC"]]),
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "O", "O", "I-LOC"]]),
    ([["O", "I-PER", "I-PER", "O"]], [["O", "B-PER", "I-PER", "O"]]),
    ([["B-PER", "I-LOC", "I-LOC"]], [["B-PER", "I-PER", "I-LOC"]]),
    ([["O", "O", "O"]], [["O", "O", "O"]]),
    ([["O", "O", "O"]], [["O", "B-ORG", "O"]]),
    ([["B-ORG", "I-ORG", "B-ORG"], ["I-MISC"]], [["B-ORG", "B-ORG", "I-ORG"], ["O"]]),
    ([["S-PER", "O", "B-LOC", "E-LOC", "I-LOC"]], [["B-PER", "O", "B-LOC", "I-LOC", "E-LOC"]]),
    ([["E-PER", "I-PER", "S-LOC", "E-LOC"]], [["S-PER", "S-PER", "B-LOC", "E-LOC"]]),
    ([["B-PER", "I-PER"], ["I-PER", "O"]], [["B-PER", "I-PER"], ["I-PER", "I-PER"]]),
]


@pytest.mark.parametrize("true,pred", FIXED)
def test_scores_equal_seqeval_on_fixed_cases(true, pred):
    pytest.importorskip("seqeval")
    assert tagging_metrics(true, pred) == pytest.approx(seqeval_scores(true, pred), rel=1e-12, abs=1e-12)


def test_scores_equal_seqeval_on_random_tag_sequences():
    pytest.importorskip("seqeval")
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(0)
    tag_sets = [
        ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"],  # IOB2, malformed at random
        ["O", "I-PER", "I-LOC"],  # IOB1-style: I- only
        ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"],  # IOBES
        ["O"],
    ]
    for _ in range(600):
        tags = rng.choice(tag_sets)
        true = [[rng.choice(tags) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 6))]
        # Mostly right predictions, as a model's are: the interesting overlaps.
        pred = [[t if rng.random() < 0.7 else rng.choice(tags) for t in row] for row in true]
        for row in true + pred:
            assert entities(row) == get_entities(row)
        assert tagging_metrics(true, pred) == pytest.approx(seqeval_scores(true, pred), rel=1e-12, abs=1e-12)


def test_scores_by_hand():
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "I-ORG"]]
    m = tagging_metrics(true, pred)
    # True PER(0-1) LOC(3) ORG(0); predicted PER(0-1) ORG(3) ORG(0-1): one hit of three each way.
    assert (m["precision"], m["recall"], m["f1"]) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert (m["PER_f1"], m["LOC_f1"], m["ORG_precision"], m["ORG_recall"]) == (1.0, 0.0, 0.0, 0.0)
    assert (m["PER_number"], m["LOC_number"], m["ORG_number"]) == (1, 1, 1)
    assert entities(["I-PER", "I-PER", "B-PER", "I-LOC"]) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 3, 3)]
    assert tagging_metrics([["NN", "VB"]], [["NN", "NN"]], entity=False) == {"accuracy": 0.5}
    assert is_entity_tagset(["O", "B-PER", "I-PER", "S-LOC"]) and not is_entity_tagset(["NN", "VB", "O"])
    assert not is_entity_tagset(["O"]) and not is_entity_tagset(["O", "B-", "PER"])


# ------------------------------------------------------------------------------------------------ alignment

SENTENCE = ["Anna", "moved", "to", "Saltlake", "City"]
TAGS = ["B-PER", "O", "O", "B-LOC", "I-LOC"]


@pytest.fixture(scope="module")
def piece_tokenizer(tmp_path_factory):
    """A WordPiece vocabulary that splits "saltlake" into salt ##lake and "city" into ci ##ty."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "anna", "moved", "to", "salt", "##lake", "ci", "##ty"]
    path.write_text("\n".join(vocab) + "\n")
    return build_wordpiece_tokenizer(path)


def one_sentence_data(tokenizer, label_all_tokens=False, seq_length=32):
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"tokens": [SENTENCE], "ner_tags": [TAGS]})})
    return build_token_classification_data(raw, tokenizer, seq_length, label_all_tokens=label_all_tokens)


def test_the_tag_goes_on_the_first_sub_token_of_each_word(piece_tokenizer):
    data = one_sentence_data(piece_tokenizer)
    row = data.train[0]
    assert piece_tokenizer.convert_ids_to_tokens(row["input_ids"]) == [
        "[CLS]", "anna", "moved", "to", "salt", "##lake", "ci", "##ty", "[SEP]",
    ]  # fmt: skip
    names = data.id2label
    assert names == dict(enumerate(["B-LOC", "B-PER", "I-LOC", "O"]))  # string tags: sorted, as run_ner
    shown = [names[i] if i != IGNORE else None for i in row["labels"]]
    assert shown == [None, "B-PER", "O", "O", "B-LOC", None, "I-LOC", None, None]
    assert row["word_starts"] == [0, 1, 1, 1, 1, 0, 1, 0, 0]


def test_label_all_tokens_labels_every_piece_with_b_turned_into_i(piece_tokenizer):
    data = one_sentence_data(piece_tokenizer, label_all_tokens=True)
    row = data.train[0]
    shown = [data.id2label[i] if i != IGNORE else None for i in row["labels"]]
    assert shown == [None, "B-PER", "O", "O", "B-LOC", "I-LOC", "I-LOC", "I-LOC", None]
    assert row["word_starts"] == [0, 1, 1, 1, 1, 0, 1, 0, 0]  # scores still read the first piece of each word
    # A B- tag whose I- is absent from the tag set stays itself on the later pieces.
    assert b_to_i_labels(["B-PER", "I-PER", "B-LOC", "O"]) == [1, 1, 2, 3]
    assert align_labels([None, 0, 0, 1, None], [2, 3], [1, 1, 2, 3]) == ([IGNORE, 2, 2, 3, IGNORE], [0, 1, 0, 1, 0])


def test_truncation_is_counted_and_the_collator_pads_labels(piece_tokenizer):
    data = one_sentence_data(piece_tokenizer, seq_length=6)  # [CLS] anna moved to salt [SEP]: two words cut
    assert data.truncated == {"train": 1} and len(data.train[0]["input_ids"]) == 6
    full = one_sentence_data(piece_tokenizer)
    batch = full.collate_fn([data.train[0], full.train[0]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["word_starts"].shape == (2, 9)
    assert batch["labels"][0, 6:].tolist() == [IGNORE] * 3 and batch["word_starts"][0, 6:].tolist() == [0] * 3
    assert batch["attention_mask"][0].tolist() == [1] * 6 + [0] * 3


# ------------------------------------------------------------------------------------------------ data


def test_a_byte_level_bpe_tokenizer_reads_words_with_their_space(tmp_path):
    """RoBERTa's tokenizer marks a word by the space before it: without one, pre-split "world" is two pieces no
    running text has."""
    from transformers import AutoConfig, RobertaConfig, RobertaTokenizer

    from rapidlite.data.tokenizers import train_byte_level_bpe

    vocab_file, merges = train_byte_level_bpe(["hello world, the world said hello"] * 20, 300, tmp_path / "bpe")
    vocab = json.loads(open(vocab_file).read())
    vocab |= {t: len(vocab) + i for i, t in enumerate(["<s>", "</s>", "<pad>", "<unk>", "<mask>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    RobertaTokenizer(vocab=str(tmp_path / "vocab.json"), merges=str(merges)).save_pretrained(tmp_path / "model")
    RobertaConfig(vocab_size=len(vocab)).save_pretrained(tmp_path / "model")
    name = str(tmp_path / "model")
    tokenizer = load_word_tokenizer(name, AutoConfig.from_pretrained(name))
    assert tokenizer(["hello", "world"], is_split_into_words=True).tokens()[-2] == "Ġworld"


def test_conll_files_directories_and_splits(tmp_path, piece_tokenizer):
    """CoNLL-2003's four columns (the last is the tag), tabs, -DOCSTART- and blank lines; a directory of split
    files (train.txt, dev.txt) and one file split by --split."""
    text = "-DOCSTART- -X- -X- O\n\nAnna NNP B-NP B-PER\nmoved VBD B-VP O\n\n\nto TO B-PP O\nCity NNP B-NP B-LOC\n"
    directory = tmp_path / "conll"
    directory.mkdir()
    (directory / "train.txt").write_text(text)
    (directory / "dev.txt").write_text("anna\tB-PER\n")
    raw = load_token_datasets(str(directory))
    assert raw["train"]["tokens"] == [["Anna", "moved"], ["to", "City"]]
    assert raw["train"]["ner_tags"] == [["B-PER", "O"], ["O", "B-LOC"]]
    assert raw["validation"]["ner_tags"] == [["B-PER"]]
    one = tmp_path / "all.bio"
    write_conll(one, [[("Anna", "B-PER")]] * 10)
    raw = load_token_datasets(str(one), split="80,20")
    assert (len(raw["train"]), len(raw["validation"])) == (8, 2)
    with pytest.raises(DataError, match=r"all.txt:2: 'lonely' is not 'word ... tag'"):
        (tmp_path / "all.txt").write_text("Anna B-PER\nlonely\n")
        load_token_datasets(str(tmp_path / "all.txt"))


def test_class_label_ids_string_tags_ints_and_csv_text(tmp_path, piece_tokenizer):
    tags = datasets.Sequence(datasets.ClassLabel(names=["X", "NN", "VB"]))
    features = datasets.Features({"words": datasets.Sequence(datasets.Value("string")), "pos_tags": tags})
    hub_like = datasets.Dataset.from_dict({"words": [["anna", "moved"]], "pos_tags": [[1, 2]]}, features=features)
    data = build_token_classification_data(datasets.DatasetDict({"train": hub_like}), piece_tokenizer, 16)
    assert data.id2label == {0: "X", 1: "NN", 2: "VB"} and (data.words_key, data.tags_key) == ("words", "pos_tags")
    assert data.sentences["train"].tags == [[1, 2]]
    # A model head with the same tags in another order keeps its ids (as run_ner does).
    data = build_token_classification_data(
        datasets.DatasetDict({"train": hub_like}), piece_tokenizer, 16, label_order=["VB", "X", "NN"]
    )
    assert data.id2label == {0: "VB", 1: "X", 2: "NN"} and data.sentences["train"].tags == [[2, 0]]
    # ... also when the data has only some of its tags (and a validation tag train lacks is then known).
    only_nn = datasets.Dataset.from_dict({"words": [["anna"]], "pos_tags": [["NN"]]})
    valid = datasets.Dataset.from_dict({"words": [["moved"]], "pos_tags": [["VB"]]})
    raw = datasets.DatasetDict({"train": only_nn, "validation": valid})
    data = build_token_classification_data(raw, piece_tokenizer, 16, label_order=["VB", "X", "NN"])
    assert data.id2label == {0: "VB", 1: "X", 2: "NN"} and data.sentences["validation"].tags == [[0]]
    ints = datasets.Dataset.from_dict({"tokens": [["anna", "to"], ["to"]], "tags": [[10, 2], [2]]})
    data = build_token_classification_data(datasets.DatasetDict({"train": ints}), piece_tokenizer, 16)
    assert data.id2label == {0: "2", 1: "10"}  # numbers in numeric order
    csv = tmp_path / "tags.csv"
    csv.write_text("sentence,labels\nanna moved,B-PER O\nto city,O B-LOC\n")
    raw = load_token_datasets(str(csv), split="100,0")
    data = build_token_classification_data(raw, piece_tokenizer, 16, text_keys=["sentence"])
    assert sorted(data.sentences["train"].words) == [["anna", "moved"], ["to", "city"]] and len(data.id2label) == 3


def test_most_frequent_tag_baseline():
    train = Sentences(words=[["rose", "Rose", "rose"], ["Rose"]], tags=[[0, 1, 0], [2]])
    assert most_frequent_tag_baseline(train, [["rose", "Rose", "tulip"]]) == [[0, 1, 0]]


def write_rows(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


GOOD = {"tokens": ["Anna", "moved"], "ner_tags": ["B-PER", "O"]}
BAD_DATA = [
    ({"train": [{"text": "Anna moved", "tags": "B-PER O"}] * 4}, "no words column found"),
    ({"train": [{"tokens": ["Anna"], "entity": 3}] * 4}, "no tags column found"),
    (
        {"train": [GOOD, GOOD, {"tokens": ["Anna", "left"], "ner_tags": ["B-PER"]}], "validation": [GOOD]},
        "train row 3 ('Anna left') has 2 words (tokens) but 1 tags",
    ),
    ({"train": [GOOD] * 4, "validation": [GOOD, {"tokens": ["x"], "ner_tags": ["B-MISC"]}]}, "validation row 2"),
    ({"train": [GOOD] * 4, "validation": [{"tokens": ["Anna"]}]}, "the validation split lacks column ner_tags"),
]


@pytest.mark.parametrize("rows,words", BAD_DATA)
def test_bad_data_is_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys, rows, words):
    model_dir, _ = tiny_assets
    data = write_rows(tmp_path / "data", rows)
    save = tmp_path / "save"
    assert main(task_args(model_dir, data, "--save", str(save))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err.strip().splitlines()[-1]
    assert not save.exists() or not any(save.iterdir())


def test_an_unknown_tag_names_the_split_row_tag_and_train_tags(tiny_assets, tmp_path, capsys):
    model_dir, data_dir = tiny_assets
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.conll").write_text((data_dir / "train.conll").read_text())
    (data / "dev.conll").write_text("Anna B-PER\n\nParis B-GPE\n")
    assert main(task_args(model_dir, data)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        "validation row 2 ('Paris') has tag 'B-GPE', which the train split does not have (train tags: O, B-PER, I-PER"
        in last
    )


# ------------------------------------------------------------------------------------------------ runs


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory):
    """Two epochs on the tiny data (40 steps), saved: the trainer and its --save directory."""
    model_dir, data_dir = tiny_assets
    save = tmp_path_factory.mktemp("trained")
    trainer = trainer_for(*task_args(model_dir, data_dir, "--epochs", "2", "--save", str(save)))
    trainer.train()
    return trainer, save


def test_trains_scores_words_and_exports(trained, tiny_assets):
    """The last evaluation's scores are seqeval's on the word-level predictions of each word's first sub-token,
    computed here sentence by sentence with the exported model and its tokenizer."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    trainer, save = trained
    _, data_dir = tiny_assets
    evals = [r for r in read_metrics(save) if r.get("split") == "validation"]
    assert len(evals) == 2 and evals[-1]["loss"] < evals[0]["loss"]
    assert {"precision", "recall", "f1", "accuracy", "loss", "PER_f1", "LOC_number", "ORG_recall"} <= evals[-1].keys()
    assert [r["split"] for r in read_metrics(save) if "split" in r][-1] == "test"

    model = AutoModelForTokenClassification.from_pretrained(save / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(save / "hf")
    names = model.config.id2label
    true, pred = [], []
    for block in (data_dir / "validation.conll").read_text().split("\n\n")[1:]:
        if not block.strip():
            continue
        words, tags = zip(*(line.split() for line in block.splitlines()), strict=True)
        encoded = tokenizer(list(words), is_split_into_words=True, return_tensors="pt")
        with torch.no_grad():
            ids = model(**encoded).logits[0].argmax(-1).tolist()
        word_ids = encoded.word_ids(0)
        firsts = [i for i, w in enumerate(word_ids) if w is not None and (i == 0 or word_ids[i - 1] != w)]
        true.append(list(tags))
        pred.append([names[ids[i]] for i in firsts])
    expected = tagging_metrics(true, pred)
    for key, value in expected.items():
        assert evals[-1][key] == pytest.approx(value, abs=1e-9), key


def test_eval_only_of_the_export_gives_the_runs_scores(trained, tiny_assets, tmp_path):
    """Other micro-batches (other padding) and a fresh process's data: the same loss and scores."""
    _, save = trained
    _, data_dir = tiny_assets
    final = [r for r in read_metrics(save) if r.get("split") == "validation"][-1]
    argv = task_args(save / "hf", data_dir, "--eval-only", "--micro-batch-size", "3", "--global-batch-size", "3")
    again = trainer_for(*argv).train()
    for key in ("loss", "f1", "precision", "recall", "accuracy", "PER_f1"):
        assert again[key] == pytest.approx(final[key], rel=1e-6), key


def test_eval_only_refuses_a_tag_the_models_head_does_not_know(trained, tmp_path, capsys):
    """--eval-only of the export on a directory holding only dev.conll, with a tag (B-GPE) its head lacks: one line
    naming the tag and the model's tags, not a head rebuilt for the data's tags; nothing written."""
    _, save = trained
    data = tmp_path / "data"
    data.mkdir()
    (data / "dev.conll").write_text("Anna B-PER\nlives O\n\nParis B-GPE\n")
    out = tmp_path / "eval"
    assert main(task_args(save / "hf", data, "--eval-only", "--save", str(out))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "label 'B-GPE' (tags) is not one of the model's labels (O, B-PER" in err[0], err
    assert not out.exists()


def test_pos_tags_score_accuracy_and_say_entity_f1_does_not_apply(tiny_assets, tmp_path, caplog):
    model_dir, data_dir = tiny_assets
    pos = {"B-PER": "PROPN", "I-PER": "PROPN", "B-LOC": "PROPN", "I-LOC": "PROPN", "B-ORG": "NOUN", "I-ORG": "NOUN"}
    rows = {}
    for split in ("train", "validation"):
        blocks = [b for b in (data_dir / f"{split}.conll").read_text().split("\n\n")[1:] if b.strip()]
        pairs = [[line.split() for line in b.splitlines()] for b in blocks]
        rows[split] = [{"tokens": [w for w, _ in p], "pos_tags": [pos.get(t, "X") for _, t in p]} for p in pairs]
    data = write_rows(tmp_path / "pos", rows)
    with caplog.at_level("INFO", logger="rapidlite"):
        final = trainer_for(*task_args(model_dir, data, "--train-iters", "2")).train()
    assert {k for k in final if k not in ("split", "iteration", "epoch")} == {"accuracy", "loss"}
    assert "entity precision/recall/F1 are not applicable" in caplog.text


def test_lora_trains_the_head_in_full(tiny_assets, tmp_path):
    pytest.importorskip("peft")
    model_dir, data_dir = tiny_assets
    trainer = trainer_for(*task_args(model_dir, data_dir, "--train-iters", "2", "--lora-rank", "4"))
    trainer.train()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("classifier.modules_to_save" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert not any("word_embeddings" in n for n in trainable)


@pytest.mark.distributed
def test_two_ranks_ddp_and_zero3_train_and_score_as_one_process(tiny_assets, tmp_path):
    """The same losses every step and the same validation loss and scores on 2 ranks (DDP, ZeRO-3) as on one
    process: the loss is token-exact over ranks, the word-level predictions are gathered from both."""
    model_dir, data_dir = tiny_assets
    common = task_args(model_dir, data_dir, "--train-iters", "4", "--log-interval", "1", "--hidden-dropout", "0",
                       "--attention-dropout", "0")  # fmt: skip
    two = ["--micro-batch-size", "4", "--nproc-per-node", "2"]
    runs = {}
    for name, layout in (("one", []), ("ddp", two), ("zero3", [*two, "--zero-3-memory-optimization"])):
        save = runs[name] = tmp_path / name
        if layout:
            proc = rapidlite(*common, *layout, "--save", str(save))
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:  # the reference: in this process
            assert rapidlite_here(*common, "--save", str(save)) == 0
    want = train_losses(runs["one"])
    final = [r for r in read_metrics(runs["one"]) if r.get("split") == "validation"][-1]
    for name in ("ddp", "zero3"):
        assert len(want) == 4 and train_losses(runs[name]) == pytest.approx(want, rel=1e-5), name
        got = [r for r in read_metrics(runs[name]) if r.get("split") == "validation"][-1]
        for key in ("loss", "f1", "precision", "recall", "accuracy", "PER_number"):
            assert got[key] == pytest.approx(final[key], rel=1e-5), (name, key)


@pytest.mark.slow
def test_demo_beats_the_memorising_baseline(tmp_path, monkeypatch):
    """``--task token_classification --demo`` as the README runs it: entity F1 from the untrained model's ~0 to far
    above what remembering each word's most frequent tag scores."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "token_classification", "--demo", "--save", str(tmp_path / "run"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    baseline = float(log.split("baseline (each word's most frequent train tag) on validation: ")[1].split("f1 ")[1][:6])
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["f1"] < 0.2
    assert baseline < 0.6 and evals[-1]["f1"] > max(0.85, baseline + 0.3)


def test_a_tag_whose_sentences_the_split_put_outside_train_goes_back_to_train(tmp_path, piece_tokenizer):
    rows = [{"tokens": ["anna", "moved"], "ner_tags": ["B-PER", "O"]}] * 10 + [{"tokens": ["to"], "ner_tags": ["B-X"]}]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = str(tmp_path / "all.jsonl")
    seed = next(
        s for s in range(100) if ["to"] in load_token_datasets(path, split="70,30", seed=s)["validation"]["tokens"]
    )
    raw = load_token_datasets(path, split="70,30", seed=seed)
    data = build_token_classification_data(raw, piece_tokenizer, 16)
    assert data.moved == {"validation": 1} and "B-X" in data.id2label.values()
    assert ["to"] in data.sentences["train"].words and ["to"] not in data.sentences["validation"].words
    # A validation file of its own is the user's: a tag train lacks there stays one line.
    raw = datasets.DatasetDict(train=raw["train"], validation=raw["validation"])
    with pytest.raises(DataError, match="has tag 'B-X', which the train split does not have"):
        build_token_classification_data(raw, piece_tokenizer, 16)
