"""``--padding-free``: a micro-batch's samples concatenated into one row (position ids restarting at each sample,
no attention mask) train exactly as the padded batch does, on every head and model family that can take it;
the others are refused in one line."""

import pytest
import torch
import transformers as T

from helpers import rapidlite, rapidlite_here, read_metrics, train_losses
from rapidlite.cli.main import main
from rapidlite.data.collate import FlatteningCollator, PadCollator, flatten_rows
from rapidlite.data.loader import batch_stats
from rapidlite.errors import ConfigError, DataError
from rapidlite.models import padding_free
from rapidlite.models.padding_free import MASK, PACKED_SDPA, POSITIONS, SEQUENCE, TOKEN, fit_padding_free
from rapidlite.tasks import causal_lm_demo, demo

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
GPT2_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT2_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2, pad_token_id=0, classifier_dropout=0.0),
    "gpt2": lambda: T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, **GPT2_IDS, **GPT2_NO_DROPOUT),
    "bert": lambda: T.BertConfig(**SMALL, **NO_DROPOUT),
    "roberta": lambda: T.RobertaConfig(**SMALL, **NO_DROPOUT, pad_token_id=1),
}
AUTO = {
    "sequence_classification": T.AutoModelForSequenceClassification,
    "token_classification": T.AutoModelForTokenClassification,
    "causal_lm": T.AutoModelForCausalLM,
    "masked_lm": T.AutoModelForMaskedLM,
}
# What the probe finds in transformers 5 with SDPA: decoders read restarting positions themselves; encoders get a
# block-diagonal mask (RoBERTa with its positions offset by pad_token_id + 1).
EXPECTED = {"llama": (POSITIONS, 0), "gpt2": (POSITIONS, 0), "bert": (MASK, 0), "roberta": (MASK, 2)}


def samples(task: str, lengths=(5, 9, 3, 7), seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 64, (n,), generator=g).tolist()
        if task == "sequence_classification":
            rows.append({"input_ids": ids, "labels": i % 2})
        elif task == "token_classification":
            rows.append({"input_ids": ids, "labels": torch.randint(0, 2, (n,), generator=g).tolist()})
        else:  # language models: the token ids are the labels (the model shifts them for a causal LM)
            rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def build(family: str, task: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AUTO[task].from_config(CONFIGS[family](), attn_implementation="sdpa")
    model.config.use_cache = False  # as compose leaves every model it trains
    return model.train()


def test_flattening_collator_keeps_real_tokens_and_restarts_positions():
    rows = [{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8, 9], "labels": 0}]
    flat = FlatteningCollator(PadCollator(pad_token_id=0, padding_side="left"))(rows)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert flat["labels"].tolist() == [1, 0] and "attention_mask" not in flat  # a label per sample stays per sample
    assert batch_stats(flat) == (2, 5)  # samples counted by the restarts, tokens are all real

    tokens = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    shifted = FlatteningCollator(PadCollator(), shift_labels=True)(tokens)
    assert shifted["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # no sample learns its neighbour's first token
    assert flatten_rows(tokens)["labels"].tolist() == [[5, 6, 7, 8, 9]]
    with pytest.raises(DataError, match="already"):
        FlatteningCollator(lambda s: {**PadCollator()(s), "position_ids": torch.zeros(2, 3)})(tokens)


@pytest.mark.parametrize(
    "family, task",
    [
        ("llama", "sequence_classification"),
        ("gpt2", "sequence_classification"),
        ("bert", "sequence_classification"),
        ("roberta", "sequence_classification"),
        ("llama", "token_classification"),
        ("bert", "token_classification"),
        ("llama", "causal_lm"),
        ("gpt2", "causal_lm"),
        ("bert", "masked_lm"),
    ],
)
def test_packed_batch_trains_as_the_padded_batch(family, task, monkeypatch):
    """Loss, every real token's (or sample's) logits and every gradient of a packed batch equal the padded
    batch's, attention run on each sample alone; the probe chose the plan expected of the family."""
    monkeypatch.setattr(padding_free, "SPLIT_SAVING", 0)  # these samples are short: split them all the same
    model = build(family, task)
    adapter = fit_padding_free(model)
    assert (adapter.plan.attention, adapter.plan.position_offset) == EXPECTED[family]
    rows = samples(task)
    pad = PadCollator(pad_token_id=model.config.pad_token_id or 0)
    padded = pad(rows)
    flat = FlatteningCollator(pad, shift_labels=adapter.plan.shift_labels)(rows)
    if task == "causal_lm":  # a padded causal batch masks its padding out of the labels too
        padded["labels"] = padded["labels"].masked_fill(padded["attention_mask"] == 0, -100)

    results = []
    for batch in (padded, flat):
        model.zero_grad()
        out = model(**batch)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (padded_out, padded_grads), (flat_out, flat_grads) = results
    torch.testing.assert_close(flat_out.loss, padded_out.loss, rtol=1e-5, atol=1e-6)
    if adapter.plan.head == SEQUENCE:
        torch.testing.assert_close(flat_out.logits, padded_out.logits, rtol=1e-4, atol=1e-5)
    else:
        real = padded["attention_mask"].bool()
        torch.testing.assert_close(flat_out.logits[0], padded_out.logits[real], rtol=1e-4, atol=1e-5)
    assert flat_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_classification_head_pools_each_samples_own_token(family):
    """Each sample of a packed row is classified as it is alone (no padding at all): the decoder's head pools
    the sample's last token, BERT's its first, and the batch's evaluation (padded rows) is left as it was."""
    model = build(family, "sequence_classification").eval()
    fit_padding_free(model)
    rows = samples("sequence_classification", lengths=(6, 2, 9))
    flat = FlatteningCollator(PadCollator())(rows)
    with torch.no_grad():
        packed = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits
        alone = torch.cat([model(input_ids=torch.tensor([r["input_ids"]])).logits for r in rows])
        padded = model(**{k: v for k, v in PadCollator()(rows).items() if k != "labels"}).logits
    assert packed.shape == (3, 2)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_attention_runs_on_each_sample_when_that_saves_work(family, monkeypatch):
    """SDPA sees each sample of a packed row alone (the padded batch's scores, not T x T) when splitting saves
    enough work, else the whole row under the block mask; the results are the padded batch's either way, and a
    padded batch goes through SDPA whole."""
    model = build(family, "token_classification")
    adapter = fit_padding_free(model)
    assert model.config._attn_implementation == PACKED_SDPA and "SDPA run on each sample alone" in adapter.describe()
    lengths = (5, 9, 3, 7)
    rows = samples("token_classification", lengths)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, *a, **k: seen.append(q.shape[2]) or sdpa(q, *a, **k),
    )
    padded = PadCollator()(rows)
    with torch.no_grad():
        reference = model(**padded).logits[padded["attention_mask"].bool()]
    assert seen == [max(lengths)] * 2
    for saving, calls in ((0, list(lengths)), (10**12, [sum(lengths)])):
        monkeypatch.setattr(padding_free, "SPLIT_SAVING", saving)
        seen.clear()
        logits = model(**FlatteningCollator(PadCollator())(rows)).logits
        logits.sum().backward()
        assert seen == calls * 2  # two layers
        torch.testing.assert_close(logits[0], reference, rtol=1e-4, atol=1e-5)
    adapter.remove()
    assert model.config._attn_implementation == "sdpa"


def test_heads_and_models_that_cannot_take_a_packed_row_are_refused():
    with pytest.raises(ConfigError, match="reads whole rows"):
        fit_padding_free(T.BertForQuestionAnswering(CONFIGS["bert"]()))
    deberta = T.DebertaV2ForTokenClassification(T.DebertaV2Config(**SMALL))  # relative attention: no 4-D mask
    with pytest.raises(ConfigError, match="does not give the samples of a packed row their own outputs"):
        fit_padding_free(deberta)
    with pytest.raises(ConfigError, match="not one"):
        fit_padding_free(torch.nn.Linear(2, 2))
    bert = build("bert", "token_classification")
    adapter = fit_padding_free(bert)
    assert adapter.plan.head == TOKEN
    adapter.remove()  # the hooks come off: a packed row attends across samples again
    flat = FlatteningCollator(PadCollator())(samples("token_classification"))
    with torch.no_grad():
        crossing = bert(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits
        fit_padding_free(bert)
        kept = bert(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits
    assert not torch.allclose(crossing, kept, atol=1e-4)


def test_padding_free_with_packing_is_refused(capsys):
    argv = ["--task", "causal_lm", "--demo", "--packing", "--padding-free"]
    assert main(argv) == 2
    assert "--padding-free and --packing both remove padding" in capsys.readouterr().err


@pytest.fixture(scope="module")
def classification_assets(tmp_path_factory):
    return demo.write_demo_assets(tmp_path_factory.mktemp("cls"), seed=3, num_train=96, num_validation=16, num_test=8)


@pytest.fixture(scope="module")
def causal_assets(tmp_path_factory):
    return causal_lm_demo.write_demo_assets(tmp_path_factory.mktemp("clm"), seed=5, num_train=48, num_validation=8)


@pytest.mark.parametrize("task", ["sequence_classification", "causal_lm"])
def test_black_box_padding_free_run_trains_the_padded_curve(task, classification_assets, causal_assets, tmp_path):
    model_dir, data_dir = classification_assets if task == "sequence_classification" else causal_assets
    argv = ["--task", task, "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir)]
    argv += ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "1"]
    argv += ["--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress"]
    argv += ["--seq-length", "64"]
    assert rapidlite_here(*argv, "--save", str(tmp_path / "padded")) == 0
    assert rapidlite_here(*argv, "--padding-free", "--save", str(tmp_path / "flat")) == 0
    padded, flat = train_losses(tmp_path / "padded"), train_losses(tmp_path / "flat")
    assert len(flat) == 4 and flat == pytest.approx(padded, rel=1e-5)
    # Samples counted by their restarts: the consumed samples and samples/s are the padded run's.
    assert train_losses(tmp_path / "flat", "consumed_samples") == train_losses(tmp_path / "padded", "consumed_samples")


@pytest.mark.distributed
def test_two_ranks_under_ddp_and_zero3_train_as_one_process(classification_assets, tmp_path):
    """--group-by-length --padding-free on 2 ranks (each its share of every length-grouped global batch, packed),
    under DDP and under ZeRO-3: the losses and the validation metric of one process."""
    model_dir, data_dir = classification_assets
    argv = ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model_dir)]
    argv += ["--data-path", str(data_dir), "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "1"]
    argv += ["--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress"]
    argv += ["--group-by-length", "--padding-free"]
    layouts = {
        "one": ["--micro-batch-size", "8"],
        "ddp": ["--micro-batch-size", "4", "--nproc-per-node", "2"],
        "zero3": ["--micro-batch-size", "4", "--nproc-per-node", "2", "--zero-3-memory-optimization"],
    }
    curves = {}
    for name, layout in layouts.items():
        proc = rapidlite(*argv, *layout, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_metrics(tmp_path / name)
        curves[name] = [r["loss"] for r in records if "split" not in r]
        curves[name] += [r["accuracy"] for r in records if r.get("split") == "validation"]
    assert len(curves["one"]) == 5
    assert curves["ddp"] == pytest.approx(curves["one"], rel=1e-4)
    assert curves["zero3"] == pytest.approx(curves["one"], rel=1e-4)
