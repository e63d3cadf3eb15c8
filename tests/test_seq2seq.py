"""The black box ``--task seq2seq`` end to end, on the demo's tiny T5 and generated translation pairs."""

import json
import sys

import pytest
import torch

from helpers import rapidlite, rapidlite_here, read_metrics, run_cli
from rapidlite import RapidliteEngine
from rapidlite.cli.main import main
from rapidlite.resolve import parse_args
from rapidlite.tasks.seq2seq import (
    Seq2SeqFinetuner,
    bleu,
    generation_metrics,
    load_seq2seq_lm,
    rouge,
    sentence_splitter,
)
from rapidlite.tasks.seq2seq_demo import PREFIX, write_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny T5 and tokenizer, and translation pairs (train 640, validation 24) in the WMT layout."""
    return write_demo_assets(tmp_path_factory.mktemp("seq2seq"), seed=5, num_train=640, num_validation=24)


def write_rows(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return directory


def pairs(data_dir, split):
    return [json.loads(line)["translation"] for line in open(data_dir / f"{split}.jsonl")]


@pytest.fixture(scope="session")
def summaries(tiny_assets, tmp_path_factory):
    """The same pairs as summarisation data: ``document``/``summary`` columns."""
    _, data_dir = tiny_assets
    rows = {
        split: [{"document": p["en"], "summary": p["art"]} for p in pairs(data_dir, split)]
        for split in ("train", "validation")
    }
    return write_rows(tmp_path_factory.mktemp("summaries"), rows)


def task_args(model_dir, data_dir, *extra, translation=True):
    languages = ["--source-lang", "en", "--target-lang", "art"] if translation else []
    return [
        "--task", "seq2seq", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        *languages, "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "3e-3", "--seq-length", "32", "--max-target-length", "16", "--epochs", "1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def trainer_and_data(model_dir, data_dir, *extra, translation=True):
    args = parse_args(task_args(model_dir, data_dir, *extra, translation=translation))
    trainer = Seq2SeqFinetuner(RapidliteEngine(args=args))
    train, valid, _, collate = trainer.train_valid_test_datasets_provider()
    return trainer, train, valid, collate


def test_labels_are_the_targets_padded_with_minus_100_and_the_loss_is_the_models(tiny_assets):
    """Sources carry the prefix, labels are the target's tokens and </s>, padding is -100 (never trained); the
    forward step's (loss_sum, tokens) is the model's own mean loss times the target tokens."""
    model_dir, data_dir = tiny_assets
    trainer, train, _, collate = trainer_and_data(model_dir, data_dir, "--source-prefix", PREFIX)
    tok = trainer.tokenizer
    rows = pairs(data_dir, "train")[:4]
    batch = collate([train[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    lengths = [len(tok(text_target=r["art"])["input_ids"]) for r in rows]
    assert batch["labels"].shape[1] == max(lengths) > min(lengths)  # so some rows are padded
    for i, row in enumerate(rows):
        real = batch["attention_mask"][i].bool()
        assert tok.decode(batch["input_ids"][i][real]) == PREFIX + row["en"] + " </s>"
        labels = batch["labels"][i]
        assert labels[: lengths[i]].tolist() == tok(text_target=row["art"])["input_ids"]
        assert (labels[lengths[i] :] == -100).all()
    model = load_seq2seq_lm(str(model_dir)).eval()
    with torch.no_grad():
        loss_sum, tokens = trainer.run_forward_step(batch, model)
        expected = model(**batch).loss
    assert tokens == sum(lengths)
    torch.testing.assert_close(loss_sum / tokens, expected, rtol=1e-5, atol=1e-6)


def test_a_large_vocabulary_trains_and_evaluates_through_the_chunked_loss(tiny_assets, tmp_path, log_lines):
    """T5 with 8192 output rows: the training and validation losses through the chunked output layer (the
    whole logits never made) equal --no-chunked-loss's."""
    from transformers import AutoConfig, AutoTokenizer, T5ForConditionalGeneration

    model_dir, data_dir = tiny_assets
    config = AutoConfig.from_pretrained(model_dir)
    config.vocab_size = 8192
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "t5")
    flags = ["--train-iters", "3", "--hidden-dropout", "0", "--eval-interval", "3", "--eval-iters", "1"]
    losses = {}
    for name, extra in (("chunked", []), ("plain", ["--no-chunked-loss"])):
        argv = task_args(tmp_path / "t5", data_dir, *flags, *extra, "--max-target-length", "8")
        assert rapidlite_here(*argv, "--save", str(tmp_path / name)) == 0
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r]
    assert len(losses["chunked"]) == 4  # three steps and the evaluation at the third (the final validation is that one)
    assert losses["chunked"] == pytest.approx(losses["plain"], rel=1e-6)
    assert any("the output layer's 8192 logits a chunk of tokens at a time" in line for line in log_lines)


# Sentences whose every n-gram order matches somewhere in the corpus (BLEU's usual case).
HYPOTHESES = ["the cat sat on the mat today", "a quick brown fox jumps over the lazy dog!", "Hello, world. Bye now."]
REFERENCES = ["the cat is on the mat today", "the quick brown fox jumped over the lazy dog.", "Hello world! Bye now."]


def test_bleu_is_sacrebleus():
    import sacrebleu

    assert bleu(HYPOTHESES, REFERENCES) == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score)
    assert bleu(REFERENCES, REFERENCES) == pytest.approx(100.0)
    # By hand: one sentence of 4 tokens, 3/4 unigrams, 2/3 bigrams, 1/2 trigrams, 0/1 4-grams match: 0 without
    # smoothing (torchmetrics; sacrebleu's default smoothing gives 25.4 here, its smooth_method="none" 0).
    one = (["a b c d"], ["a b c e"])
    assert bleu(*one) == 0.0 == sacrebleu.corpus_bleu(one[0], [one[1]], smooth_method="none").score
    # 5 tokens against 6: precisions 4/5, 3/4, 2/3, 1/2 and a brevity penalty exp(1 - 6/5).
    expected = 100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25 * 2.718281828459045 ** (1 - 6 / 5)
    assert bleu(["a b c d x"], ["a b c d e f"]) == pytest.approx(expected)


SUMMARIES = ["Police arrested five men. They were released later.", "The match ended in a draw!", "Rain fell."]
GOLD = ["All were released on bail.\nPolice arrested five men.", "A draw ended the matches.", "It rained."]


def test_rouge_is_rouge_scores_with_sentences_one_per_line():
    from rouge_score import rouge_scorer
    from torchmetrics.functional.text import rouge_score as torchmetrics_rouge

    scores = rouge(SUMMARIES, GOLD)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    # run_summarization's post-processing: sentences one per line (the gold ones are split already).
    split = ["Police arrested five men.\nThey were released later.", SUMMARIES[1], SUMMARIES[2]]
    reference = [scorer.score(g, p) for g, p in zip(GOLD, split, strict=True)]
    for key in scores:
        assert scores[key] == pytest.approx(100 * sum(r[key].fmeasure for r in reference) / 3)
    # The sentences come in the other order: the summary-level LCS (per sentence) finds both, the LCS of the whole
    # text one.
    assert scores["rougeLsum"] > scores["rougeL"] + 5
    # ROUGE-1/2/L as torchmetrics computes them (the same stemmer and tokenisation).
    other = torchmetrics_rouge(SUMMARIES, GOLD, use_stemmer=True, rouge_keys=("rouge1", "rouge2", "rougeL"))
    for key in ("rouge1", "rouge2", "rougeL"):
        assert scores[key] == pytest.approx(100 * float(other[f"{key}_fmeasure"]), rel=1e-6)
    # By hand: "the cats sat" against "the cat ran": 2 of 3 unigrams (cats -> cat), 1 of 2 bigrams.
    by_hand = rouge(["the cats sat"], ["the cat ran"])
    assert by_hand["rouge1"] == pytest.approx(200 / 3) and by_hand["rouge2"] == pytest.approx(50.0)
    assert generation_metrics([" the cats sat "], ["the cat ran\n"], with_rouge=True) == pytest.approx(
        {**by_hand, "bleu": 0.0}
    )


@pytest.fixture(scope="module")
def trained_run(tiny_assets, tmp_path_factory):
    """80 steps of the tiny T5 on the translation pairs with beam search 2, saved and exported."""
    model_dir, data_dir = tiny_assets
    save = tmp_path_factory.mktemp("trained")
    batch = ["--micro-batch-size", "16", "--global-batch-size", "16", "--hidden-dropout", "0"]
    argv = task_args(model_dir, data_dir, "--epochs", "2", *batch, "--lr", "5e-3", "--log-interval", "20")
    assert rapidlite_here(*argv, "--num-beams", "2", "--save", str(save)) == 0
    return save


def _generated_by_transformers(hf_dir, sources, **generate):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    texts, lengths = [], []
    with torch.no_grad():
        for source in sources:  # one at a time: no padding at all
            ids = model.generate(**tokenizer([source], return_tensors="pt"), **generate)[0]
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            tokens = ids[1:].tolist()  # after the decoder's start token, through </s> if it came
            lengths.append(
                tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in tokens else len(tokens)
            )
    return texts, sum(lengths) / len(lengths)


def test_the_export_generates_what_the_run_scored(tiny_assets, trained_run, tmp_path):
    """DIR/hf is an AutoModelForSeq2SeqLM with its tokenizer and the run's generation settings; the run's
    validation BLEU is sacrebleu's on what transformers generates from the export, one source at a time."""
    import sacrebleu

    _, data_dir = tiny_assets
    final = [r for r in read_metrics(trained_run) if r.get("split") == "validation"][-1]
    assert {"loss", "bleu", "gen_len"} <= final.keys() and "rouge1" not in final  # translations: BLEU
    generation = json.loads((trained_run / "hf" / "generation_config.json").read_text())
    assert generation["num_beams"] == 2 and generation["max_new_tokens"] == 16
    valid = pairs(data_dir, "validation")
    texts, gen_len = _generated_by_transformers(trained_run / "hf", [p["en"] for p in valid])
    expected = sacrebleu.corpus_bleu(texts, [[p["art"] for p in valid]]).score
    assert final["bleu"] > 5 and final["bleu"] == pytest.approx(expected, rel=1e-5)
    assert final["gen_len"] == pytest.approx(gen_len)


def test_summaries_are_scored_by_rouge_and_bleu_in_eval_only(summaries, trained_run, tmp_path, log_lines):
    """document/summary columns are detected; --eval-only of the export scores what transformers generates with
    greedy search (--num-beams 1 overrides the export's 2) by rouge_score and sacrebleu. Where nltk's sentence
    model is missing, one line says how ROUGE-Lsum splits sentences instead."""
    import sacrebleu
    from rouge_score import rouge_scorer

    save = tmp_path / "eval"
    argv = ["--task", "seq2seq", "--pretrained-model-name-or-path", str(trained_run / "hf"), "--data-path",
            str(summaries), "--eval-only", "--num-beams", "1", "--micro-batch-size", "5"]  # fmt: skip
    argv += ["--max-target-length", "16", "--save", str(save)]  # the run's: the default would be 128
    assert rapidlite_here(*argv) == 0
    record = [r for r in read_metrics(save) if r.get("eval_only")][0]
    rows = [json.loads(line) for line in open(summaries / "validation.jsonl")]
    texts, _ = _generated_by_transformers(trained_run / "hf", [r["document"] for r in rows], num_beams=1)
    gold = [r["summary"] for r in rows]
    assert record["bleu"] == pytest.approx(sacrebleu.corpus_bleu(texts, [gold]).score, rel=1e-5)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    scores = [scorer.score(g, t) for g, t in zip(gold, texts, strict=True)]
    for key in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        assert record[key] == pytest.approx(100 * sum(s[key].fmeasure for s in scores) / len(scores), rel=1e-6)
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl"]
    told = [line for line in log_lines if "punkt_tab" in line]
    assert len(told) == (sentence_splitter()[1] is not None)


def test_rouge_without_its_extra_is_one_line_naming_it(summaries, trained_run, tiny_assets, monkeypatch):
    """Summaries need rouge_score (the [seq2seq] extra): without it the run stops before the model loads, saying
    what to install; translations are scored by BLEU and need nothing more."""
    from rapidlite.errors import ConfigError

    monkeypatch.setitem(sys.modules, "rouge_score", None)  # what a missing package looks like to an import
    with pytest.raises(ConfigError, match=r"pip install 'rapidlite\[seq2seq\]'"):
        trainer_and_data(trained_run / "hf", summaries, translation=False)
    trainer_and_data(*tiny_assets)


def _refused(argv, save, capsys):
    assert main([*argv, "--save", str(save)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not save.exists() or not any(save.iterdir())
    return err.strip().splitlines()[-1]


def test_bad_data_and_models_are_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys):
    model_dir, data_dir = tiny_assets
    save = tmp_path / "save"
    good = [{"document": "a b", "summary": "c"}] * 4
    empty = {"document": "a b", "summary": " "}
    pairs_en_de = [{"translation": {"en": "a", "de": "b"}}] * 4
    en_fr = ["--source-lang", "en", "--target-lang", "fr"]
    cases = [
        ({"train": [{"title": "a", "body": "b"}] * 4}, [], "no source/target columns found"),
        ({"train": good, "validation": [{"document": "a b"}] * 2}, [], "the validation split has no column summary"),
        ({"train": [*good, empty], "validation": good}, [], "the train split has an empty target (summary; its source"),
        ({"train": pairs_en_de}, [], "--source-lang and --target-lang"),
        ({"train": pairs_en_de}, en_fr, "no language fr"),
        ({"train": good}, ["--text-keys", "document", "--label-key", "headline"], "no column headline"),
    ]
    for i, (rows, flags, message) in enumerate(cases):
        data = write_rows(tmp_path / f"data{i}", rows)
        argv = ["--task", "seq2seq", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data)]
        assert message in _refused([*argv, *flags], save, capsys), message

    from transformers import BartConfig, GPT2Config

    GPT2Config(vocab_size=64, n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
    argv = task_args(tmp_path / "gpt2", data_dir)
    assert "not a sequence-to-sequence model" in _refused(argv, save, capsys)
    bart = tmp_path / "bart"
    BartConfig(vocab_size=64, max_position_embeddings=24).save_pretrained(bart)
    (bart / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (bart / "tokenizer_config.json").write_text((model_dir / "tokenizer_config.json").read_text())
    assert "--seq-length 32: the model has 24 positions" in _refused(task_args(bart, data_dir), save, capsys)


def test_a_bart_model_and_qlora_adapters_train_and_generate(tiny_assets, tmp_path):
    """Another family (BART: learned positions, decoder start = </s>) from a local directory, and LoRA adapters on
    the T5 held in 4 bits (QLoRA; the base wrapped by peft generates through it): one step each, evaluated with
    generation; the adapter is exported as a sequence-to-sequence one."""
    import importlib.util

    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    model_dir, data_dir = tiny_assets
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = BartConfig(
        vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    BartForConditionalGeneration(config).save_pretrained(tmp_path / "bart")
    tokenizer.save_pretrained(tmp_path / "bart")
    lora = ["--lora-rank", "4"] + (["--load-in-4bit"] if importlib.util.find_spec("bitsandbytes") else [])
    for name, model, flags in (("bart", tmp_path / "bart", []), ("lora", model_dir, lora)):
        save = tmp_path / name
        assert rapidlite_here(*task_args(model, data_dir, "--train-iters", "1", "--save", str(save), *flags)) == 0
        final = [r for r in read_metrics(save) if r.get("split") == "validation"][-1]
        assert {"loss", "bleu", "gen_len"} <= final.keys()
    adapter = json.loads((tmp_path / "lora" / "hf" / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_2_SEQ_LM" and adapter["r"] == 4


def test_dry_run_plans_an_encoder_decoder(tiny_assets, capsys):
    """--dry-run builds the model as AutoModelForSeq2SeqLM on the meta device and profiles a forward with decoder
    inputs; the sequence length is the task's default without --seq-length."""
    model_dir, data_dir = tiny_assets
    argv = [a for a in task_args(model_dir, data_dir, "--dry-run") if a not in ("--seq-length", "32")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sequence length 1024" in out and "0.67M parameters" in out and "predicted memory per rank" in out


@pytest.mark.distributed
def test_two_ranks_ddp_and_zero3_train_and_evaluate_as_one_process(trained_run, summaries, tmp_path):
    """DDP and ZeRO-3 (FSDP2) on 2 ranks: the losses of every step, the validation loss, and the ROUGE and BLEU of
    what each rank generates for its share of the sources are one process's. The model starts from the trained
    export, whose generations end at different lengths: the ranks' batches finish at different steps, and under
    ZeRO-3 every rank must still run the same forward passes (without synced_gpus the ranks' collectives part
    and the run dies)."""
    flags = ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3"]
    common = task_args(trained_run / "hf", summaries, *flags, translation=False)
    assert rapidlite_here(*common, "--save", str(tmp_path / "one")) == 0
    two = ["--nproc-per-node", "2"]
    for name, flags in (("ddp", two), ("zero3", [*two, "--zero-3-memory-optimization"])):
        proc = rapidlite(*common, *flags, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]

    def curve(name):
        records = read_metrics(tmp_path / name)
        losses = [r["loss"] for r in records if r.get("split") in (None, "validation") and "loss" in r]
        return losses, [r for r in records if r.get("split") == "validation"][-1]

    one_losses, one_final = curve("one")
    scores = ("rouge1", "rouge2", "rougeL", "rougeLsum", "bleu", "gen_len")
    assert len(one_losses) == 4 and one_final["rouge1"] > 20 and 1 < one_final["gen_len"] < 15
    for name in ("ddp", "zero3"):
        losses, final = curve(name)
        assert losses == pytest.approx(one_losses, rel=1e-4), name
        assert [final[k] for k in scores] == pytest.approx([one_final[k] for k in scores], rel=1e-4), name


@pytest.mark.slow
def test_demo_learns_to_translate(tmp_path, monkeypatch):
    """``--task seq2seq --demo``, two of its three epochs: the untrained model's BLEU of 0 becomes nearly 100 on
    sentences never seen in training, and the validation loss falls far."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "seq2seq", "--demo", "--epochs", "2", "--save", str(tmp_path / "run"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["bleu"] < 5
    assert evals[-1]["bleu"] >= 90 and evals[-1]["loss"] < evals[0]["loss"] / 20
