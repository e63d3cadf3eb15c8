"""The black box ``--task masked_lm`` end to end, on the demo's tiny BERT and generated clinic notes."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from helpers import rapidlite, rapidlite_here, read_metrics, run_cli, train_losses
from rapidlite.cli.main import main
from rapidlite.data.masked_lm import (
    EVAL_STREAM,
    IGNORE_INDEX,
    MaskedLMCollator,
    build_masked_lm_data,
    draw_masks,
    mask_tokens,
)
from rapidlite.tasks.demo_build import build_wordpiece_tokenizer
from rapidlite.tasks.masked_lm_demo import write_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny BERT masked LM and its tokenizer, and clinic notes in train.txt/validation.txt."""
    return write_demo_assets(tmp_path_factory.mktemp("mlm"), seed=5, num_train=96, num_validation=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets[0])


def task_args(model_dir, data_dir, *extra):
    return [
        "--task", "masked_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "32",
        "--epochs", "1", "--log-interval", "1", *extra,
    ]  # fmt: skip


def raw(**splits):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_dict(columns) for name, columns in splits.items()})


def test_blocks_concatenate_the_documents_and_line_by_line_keeps_them_apart(tokenizer):
    docs = [
        "the patient reports nausea and bloating for 3 days .",
        "",
        "the mri confirms a lesion . we start rest and review in 4 weeks . examination of the spine shows a lesion .",
        "   ",
        "itching improved after emollients .",
    ]
    data = build_masked_lm_data(raw(train={"text": docs, "id": list(range(5))}), tokenizer, seq_length=16)
    encoded = tokenizer([d for d in docs if d.strip()])["input_ids"]
    stream = [t for ids in encoded for t in ids]
    blocks = [data.train[i] for i in range(len(data.train))]
    assert [t for b in blocks for t in b["input_ids"]] == stream  # no token lost or added, documents in order
    assert [len(b["input_ids"]) for b in blocks] == [16] * (len(stream) // 16) + [len(stream) % 16]
    assert all(b["index"] == i for i, b in enumerate(blocks))
    specials = {tokenizer.cls_token_id, tokenizer.sep_token_id}
    for block in blocks:
        assert [t in specials for t in block["input_ids"]] == [bool(m) for m in block["special_tokens_mask"]]
    assert (data.documents, data.empty, data.text_key, data.tokens) == (3, 2, "text", len(stream))

    lines = build_masked_lm_data(raw(train={"text": docs}), tokenizer, seq_length=16, line_by_line=True)
    rows = [lines.train[i]["input_ids"] for i in range(len(lines.train))]
    assert len(rows) == 3 and rows[0] == encoded[0] and rows[2] == encoded[2]
    assert rows[1] == encoded[1][:15] + [tokenizer.sep_token_id] and lines.truncated == 1


def vocab_file(directory, words):
    path = directory / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return path


def test_masks_follow_the_language_modeling_collator(tmp_path):
    """On the same 40,000 tokens, the tokens predicted and what they become have the shares of transformers'
    DataCollatorForLanguageModeling (15% of the maskable tokens; 80% [MASK], 10% random, 10% kept); special
    tokens and padding are never predicted, and the labels hold the original ids there and -100 elsewhere."""
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    torch.manual_seed(0)
    ids = torch.randint(5, 200, (160, 250))
    maskable = torch.rand(ids.shape) > 0.1
    draws = draw_masks(list(range(160)), 250, 250, 200, seed=3, stream=(1, 0))
    inputs, labels = mask_tokens(ids, maskable, draws, mask_token_id=4, mlm_probability=0.15)
    chosen = labels != IGNORE_INDEX

    def shares(chosen, inputs):
        return (
            float(chosen[maskable].float().mean()),
            float((inputs[chosen] == 4).float().mean()),
            float((inputs[chosen] == ids[chosen]).float().mean()),
        )

    ours = shares(chosen, inputs)
    assert not chosen[~maskable].any() and torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    # The reference, over the same tokens (its special-token mask marks the unmaskable ones).
    # Both draw random tokens from the same 200 ids (which include [MASK]).
    tokenizer = build_wordpiece_tokenizer(vocab_file(tmp_path, [f"w{i}" for i in range(195)]), model_max_length=512)
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.mask_token_id == 4 and len(tokenizer) == 200
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    collator.generator = torch.Generator().manual_seed(3)
    ref_inputs, ref_labels = collator.torch_mask_tokens(ids.clone(), special_tokens_mask=(~maskable).long())
    reference = shares(ref_labels != IGNORE_INDEX, ref_inputs)
    for share, expected, ref in zip(ours, (0.15, 0.8 + 0.1 / 200, 0.1 + 0.1 / 200), reference, strict=True):
        assert share == pytest.approx(expected, abs=0.015) and ref == pytest.approx(expected, abs=0.015)


def test_a_samples_masks_depend_on_its_index_and_stream_only():
    ids = torch.arange(10, 30).reshape(2, 10)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    both = draw_masks([3, 7], 10, 16, 50, seed=1, stream=(1, 0))
    alone = draw_masks([7], 6, 16, 50, seed=1, stream=(1, 0))  # another batch, padded to another length
    assert torch.equal(both.select[1, :6], alone.select[0]) and torch.equal(both.random_ids[1, :6], alone.random_ids[0])
    again = draw_masks([3, 7], 10, 16, 50, seed=1, stream=(1, 0))
    assert torch.equal(mask_tokens(ids, maskable, both, 4, 0.5)[1], mask_tokens(ids, maskable, again, 4, 0.5)[1])
    for other in (
        draw_masks([3, 7], 10, 16, 50, seed=1, stream=(1, 1)),
        draw_masks([3, 7], 10, 16, 50, 1, (EVAL_STREAM,)),
    ):
        assert not torch.equal(other.select, both.select)  # a new epoch, or evaluation, draws anew


def test_whole_word_masking_predicts_every_piece_of_a_chosen_word(tmp_path):
    """Words split into word pieces are predicted whole, about 15% of the words; the words are those transformers'
    whole-word collator finds (from the offsets) in text without punctuation."""
    from transformers import DataCollatorForLanguageModeling

    stems = ["play", "walk", "jump", "talk", "cook", "paint", "read", "clean"]
    tokenizer = build_wordpiece_tokenizer(vocab_file(tmp_path, [*stems, "##ing", "##ed", "##er", "##s"]), 512)
    rng = torch.Generator().manual_seed(0)
    suffixes = ["", "ing", "ed", "er", "s", "ers"]
    docs = [
        " ".join(stems[i] + suffixes[j] for i, j in torch.randint(0, 6, (40, 2), generator=rng).tolist())
        for _ in range(30)
    ]
    data = build_masked_lm_data(raw(train={"text": docs}), tokenizer, 48, whole_word_masking=True)
    batch = MaskedLMCollator(0)([data.train[i] for i in range(len(data.train))])
    words = batch["word_ids"]
    assert int(words.max()) > 0 and (words[~batch["maskable"]] == -1).all()
    draws = draw_masks(batch["index"], words.shape[1], 48, len(tokenizer), seed=2, stream=(1, 0))
    _, labels = mask_tokens(batch["input_ids"], batch["maskable"], draws, 4, 0.15, words)
    chosen_words = 0
    for row in range(words.shape[0]):
        for word in words[row].unique().tolist():
            if word < 0:
                continue
            picked = (labels[row][words[row] == word] != IGNORE_INDEX).tolist()
            assert all(picked) or not any(picked)
            chosen_words += picked[0]
    total_words = sum(len([w for w in words[r].unique().tolist() if w >= 0]) for r in range(words.shape[0]))
    assert chosen_words / total_words == pytest.approx(0.15, abs=0.04)
    # The same word groups as transformers' whole-word masking (it needs offsets; the text has no punctuation).
    enc = tokenizer(docs[:3], return_offsets_mapping=True, return_special_tokens_mask=True, padding=True)
    theirs, _ = DataCollatorForLanguageModeling._calc_word_ids_and_prob_mask(
        np.array(enc["offset_mapping"]), np.array(enc["special_tokens_mask"])
    )
    lines = build_masked_lm_data(
        raw(train={"text": docs[:3]}), tokenizer, 512, line_by_line=True, whole_word_masking=True
    )
    for i in range(3):
        ours = lines.train[i]["word_ids"]
        assert [w - 1 if w > 0 else -1 for w in theirs[i][: len(ours)]] == ours


def test_cli_run_exports_a_masked_lm_and_its_evaluation_is_repeatable(tiny_assets, tmp_path):
    """jsonl with the text in a column named by --text-keys: the run logs loss and ppl = exp(loss) (the mean over
    the masked tokens), exports a model AutoModelForMaskedLM loads with its tokenizer, and --eval-only of the
    export scores the same masks: the run's last validation loss, to the bit."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model_dir, data_dir = tiny_assets
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation"):
        docs = (data_dir / f"{split}.txt").read_text().splitlines()
        rows = [{"id": i, "body": d} for i, d in enumerate(docs)] + [{"id": -1, "body": ""}]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(task_args(model_dir, data, "--text-keys", "body", "--whole-word-masking", "--save", str(out))) == 0
    final = [r for r in read_metrics(out) if r.get("split") == "validation"][-1]
    assert final["ppl"] == pytest.approx(math.exp(final["loss"])) and final["masked_tokens"] > 0
    model = AutoModelForMaskedLM.from_pretrained(out / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert type(model).__name__ == "BertForMaskedLM"
    logits = model(**tokenizer(["the patient reports [MASK] ."], return_tensors="pt")).logits
    assert logits.shape[-1] == len(tokenizer)
    again = tmp_path / "again"
    argv = task_args(out / "hf", data, "--text-keys", "body", "--whole-word-masking", "--eval-only")
    assert main([*argv, "--save", str(again)]) == 0
    assert read_metrics(again)[0]["loss"] == pytest.approx(final["loss"], rel=1e-6)


def test_eval_only_loss_is_the_models_own_masked_lm_loss(tiny_assets, tmp_path, tokenizer):
    """--eval-only's loss is the mean cross-entropy over every masked validation token, computed here by hand from
    the same draws (seed, each block's index, the evaluation stream) with the model's own masked-LM loss over the
    whole split at once; ppl is its exponential."""
    from transformers import AutoModelForMaskedLM

    model_dir, data_dir = tiny_assets
    out = tmp_path / "eval"
    assert main(task_args(model_dir, data_dir, "--eval-only", "--seed", "7", "--save", str(out))) == 0
    scored = read_metrics(out)[0]
    docs = (data_dir / "validation.txt").read_text().splitlines()
    data = build_masked_lm_data(raw(train={"text": docs}), tokenizer, seq_length=32)
    batch = MaskedLMCollator(tokenizer.pad_token_id)([data.train[i] for i in range(len(data.train))])
    draws = draw_masks(batch["index"], batch["input_ids"].shape[1], 32, len(tokenizer), 7, (EVAL_STREAM,))
    inputs, labels = mask_tokens(batch["input_ids"], batch["maskable"], draws, tokenizer.mask_token_id, 0.15)
    model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = model(input_ids=inputs, attention_mask=batch["attention_mask"], labels=labels).loss
    assert scored["masked_tokens"] == int((labels != IGNORE_INDEX).sum())
    assert scored["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert scored["ppl"] == pytest.approx(math.exp(float(expected)), rel=1e-5)


def test_lora_adapts_a_masked_lm(tiny_assets, tmp_path):
    """Adapters on the encoder; the head's transform trained in full when named (the decoder stays tied)."""
    from safetensors.torch import load_file

    model_dir, data_dir = tiny_assets
    out = tmp_path / "lora"
    lora = ["--lora-rank", "4", "--lora-modules-to-save", "transform", "--train-iters", "2", "--save", str(out)]
    assert main(task_args(model_dir, data_dir, *lora)) == 0
    adapter = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert any("lora_A" in k for k in adapter) and any("predictions.transform.dense" in k for k in adapter)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_keeps_the_tied_head_unquantised(tiny_assets, tmp_path):
    """``--load-in-4bit`` quantises the encoder's linear layers but not the masked-LM head, whose decoder shares
    the (unquantised) input embeddings: quantising it broke the first forward."""
    model_dir, data_dir = tiny_assets
    out = tmp_path / "qlora"
    argv = task_args(
        model_dir, data_dir, "--lora-rank", "4", "--load-in-4bit", "--train-iters", "2", "--save", str(out)
    )
    assert main(argv) == 0
    assert len(train_losses(out)) == 2 and all(math.isfinite(loss) for loss in train_losses(out))


def test_line_by_line_documents_are_grouped_by_length(tiny_assets, tmp_path):
    """``--group-by-length`` measures the samples (one per document with --line-by-line) by their own tokens."""
    model_dir, data_dir = tiny_assets
    out = tmp_path / "grouped"
    argv = task_args(model_dir, data_dir, "--line-by-line", "--group-by-length", "--train-iters", "2")
    assert main([*argv, "--save", str(out)]) == 0
    assert len(train_losses(out)) == 2


@pytest.mark.parametrize(
    "flags, rows, words",
    [
        (["--text-keys", "nope"], [{"body": "a b"}], "--text-keys nope: no such column"),
        ([], [{"title": "x", "summary": "y"}], "no text column found"),
        (["--text-keys", "body"], [{"body": ""}, {"body": None}], "the train split has no text"),
        (["--text-keys", "n"], [{"body": "a", "n": 3}], "--text-keys n: the column holds int64, not text"),
        (["--seq-length", "4096"], [{"text": "a"}], "--seq-length 4096: the model takes at most 128 tokens"),
        (["--mlm-probability", "0"], [{"text": "a"}], "--mlm-probability 0: must be in (0, 1)"),
        (["--padding-free"], [{"text": "a"}], "--padding-free: --task masked_lm draws each sample's masks"),
    ],
)
def test_bad_data_is_one_line_exit_2_and_nothing_written(tiny_assets, tmp_path, capsys, flags, rows, words):
    model_dir, _ = tiny_assets
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    save = tmp_path / "save"
    assert main(task_args(model_dir, data, "--split", "100,0,0", "--save", str(save), *flags)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and words in err, err
    assert not save.exists() or not any(save.iterdir())


def test_a_text_file_that_is_not_utf8_is_one_line(tiny_assets, tmp_path, capsys):
    model_dir, _ = tiny_assets
    data = tmp_path / "notes.txt"
    data.write_bytes(b"the patient reports \xff\xfe nausea .\n")
    assert main(task_args(model_dir, data, "--save", str(tmp_path / "save"))) == 2
    err = capsys.readouterr().err
    assert "notes.txt: cannot be read as text" in err and "UnicodeDecodeError" in err and err.count("\n") == 1, err
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


@pytest.mark.slow
def test_demo_perplexity_falls(tmp_path, monkeypatch):
    """``--task masked_lm --demo`` as the README runs it: the validation perplexity, scored before training and
    after each epoch on the same masks, falls from the untrained model's (about the vocabulary's size) to a
    small fraction of it."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "masked_lm", "--demo", "--save", str(tmp_path / "run"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["ppl"] > 150
    assert evals[-1]["ppl"] < evals[0]["ppl"] / 10


@pytest.mark.distributed
def test_two_ranks_train_and_evaluate_as_one_process(tiny_assets, tmp_path):
    """Data parallel and ZeRO-3 over 2 ranks draw the masks one process draws (per sample, not per batch): the
    same loss at every step and the same validation loss (token-weighted over the ranks) as one process with the
    same global batch, dropout off."""
    model_dir, data_dir = tiny_assets
    common = task_args(model_dir, data_dir, "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0")
    common += ["--global-batch-size", "8", "--whole-word-masking"]
    assert rapidlite_here(*common, "--micro-batch-size", "8", "--save", str(tmp_path / "one")) == 0
    expected = train_losses(tmp_path / "one"), read_metrics(tmp_path / "one")[-1]["loss"]
    two = ["--micro-batch-size", "4", "--nproc-per-node", "2"]
    for name, layout in (("ddp", two), ("zero3", [*two, "--zero-3-memory-optimization"])):
        proc = rapidlite(*common, *layout, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert train_losses(tmp_path / name) == pytest.approx(expected[0], rel=1e-4), name
        assert read_metrics(tmp_path / name)[-1]["loss"] == pytest.approx(expected[1], rel=1e-5), name
