"""``--task kto``: its tokenization, KL sequences, loss and metrics equal TRL 1.16's ``KTOTrainer`` on the same tiny
model, data and batch, and a split into micro-batches, ranks or a precomputed reference trains as one batch."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import (
    assert_same_metrics,
    big_vocab_llama,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    run_cli,
    write_jsonl,
)
from rapidlite import RapidliteEngine
from rapidlite.data.preference import Counts, UnpairedCollator, add_kl_completions, encode_unpaired, unpaired_rows
from rapidlite.models.head import MIN_VOCAB, loss_line
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import load_causal_lm
from rapidlite.tasks.causal_lm_demo import write_demo_assets
from rapidlite.tasks.kto import KTOFinetuner

trl = pytest.importorskip("trl")
TOL = dict(rel=1e-5, abs=1e-5)


def _near_miss(answer: str) -> str:
    words = answer.split()
    return " ".join(words[1:] + words[:1]) if len(words) > 1 else answer + " " + answer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The causal demo's tiny LLaMA and tokenizer, and unpaired rows: the correct word reversal (desirable) or a
    near miss (undesirable), alternating."""
    root = tmp_path_factory.mktemp("kto")
    model_dir, data_dir = write_demo_assets(root, seed=5, num_train=32, num_validation=8)
    data = root / "unpaired"
    data.mkdir()
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(data_dir / f"{split}.jsonl")]
        with open(data / f"{split}.jsonl", "w") as f:
            for i, r in enumerate(rows):
                good = i % 3 != 1
                completion = r["completion"] if good else _near_miss(r["completion"])
                f.write(json.dumps({"prompt": r["prompt"], "completion": completion, "label": good}) + "\n")
    return model_dir, data


def _rows(data, n=None):
    rows = [json.loads(line) for line in open(data / "train.jsonl")]
    return rows[:n] if n else rows


def kto_args(model_dir, data_dir, *extra):
    return [
        "--task", "kto", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--epochs", "1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def _trl_trainer(model_dir, rows, policy, ref=None, tok=None, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = tok or AutoTokenizer.from_pretrained(model_dir)
    args = trl.KTOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=1024, **config)
    return trl.KTOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )


# ------------------------------------------------------------------ data


@pytest.mark.parametrize("layout", ["text", "conversation", "paired"])
def test_tokenization_and_kl_completions_are_trls(assets, layout):
    """Prompt and completion ids equal TRL's ``KTOTrainer._prepare_dataset`` (text: EOS appended; chats: the chat
    template, the prompt with its generation prompt; pairs: unpaired as ``unpair_preference_dataset``), and the KL
    completions are its ``add_kl_completion_ids``: rotated by one within each run of ``per_device_train_batch_size``
    rows (here, of the global batch)."""
    from transformers import AutoTokenizer

    from rapidlite.data.instruction import CHATML_TEMPLATE

    model_dir, data = assets
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHATML_TEMPLATE
    rows = _rows(data, 7)
    if layout == "conversation":
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": r["completion"]}],
                "label": r["label"],
            }
            for r in rows
        ]
    elif layout == "paired":
        rows = [
            {"prompt": r["prompt"], "chosen": r["completion"], "rejected": _near_miss(r["completion"])} for r in rows
        ]
    trainer = _trl_trainer(model_dir, rows, load_causal_lm(str(model_dir)), tok=tok, per_device_train_batch_size=3)
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    expected = [{k: r[k] for k in keys} for r in trainer.train_dataset]
    ours = encode_unpaired(unpaired_rows(rows, list(rows[0])), tok, 1024, None, Counts())
    add_kl_completions(ours, 3)
    renamed = [{("KL_completion_ids" if k == "kl_completion_ids" else k): v for k, v in s.items()} for s in ours]
    assert renamed == expected


# ------------------------------------------------------------------ loss and metrics against TRL

WEIGHTS = ["--desirable-weight", "1.3", "--undesirable-weight", "0.6", "--beta", "0.5"]
METRICS = (
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
)


def _perturbed(model, seed=0, scale=0.05):
    """A policy apart from its reference, so rewards and the KL term are not zero."""
    policy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return policy


def test_loss_and_metrics_equal_trls_kto_trainer(assets):
    """One batch mixing desirable and undesirable rows, non-default weights and beta: the loss and every metric TRL
    1.16 logs for KTO and we can name alike (not ``num_tokens``, a running count of its trainer) equal
    ``KTOTrainer``'s. TRL 1.16's definitions: ``rewards/*`` and ``logps/*`` are means over the rows of each label,
    ``rewards/margins`` the difference of the two means, ``logits/*`` and ``entropy`` means over completion tokens,
    ``kl`` the clamped estimate."""
    model_dir, data = assets
    rows = _rows(data, 6)
    engine = RapidliteEngine(
        args=parse_args(kto_args(model_dir, data, *WEIGHTS, "--micro-batch-size", "6", "--global-batch-size", "6"))
    )
    trainer = KTOFinetuner(engine)
    trainer.train_valid_test_datasets_provider()
    samples = encode_unpaired(unpaired_rows(rows, list(rows[0])), trainer.tokenizer, 1024, None, Counts())
    add_kl_completions(samples, 6)
    batch = UnpairedCollator(trainer.tokenizer.pad_token_id, 1024)(samples)
    ref = load_causal_lm(str(model_dir)).eval()
    policy = _perturbed(ref, scale=0.02)

    trainer.model, trainer.ref_model = policy, ref
    policy.train()
    trainer.monitor.step_metrics.clear()
    trainer.before_step([batch])
    loss_sum, n = trainer.run_forward_step(batch, policy)
    ours = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())

    theirs_trainer = _trl_trainer(
        model_dir, rows, copy.deepcopy(policy), ref, beta=0.5, desirable_weight=1.3, undesirable_weight=0.6,
        per_device_train_batch_size=6,
    )  # fmt: skip
    trl_batch = theirs_trainer.data_collator([theirs_trainer.train_dataset[i] for i in range(6)])
    theirs_trainer.model.train()
    theirs = float(theirs_trainer.compute_loss(theirs_trainer.model, trl_batch))
    trl_metrics = {k: v[-1] for k, v in theirs_trainer._metrics["train"].items()}
    assert set(METRICS) <= set(trl_metrics) and set(trl_metrics) - set(METRICS) == {"num_tokens"}
    assert float(loss_sum) / n == pytest.approx(theirs, **TOL)
    for name in METRICS:
        assert ours[name] == pytest.approx(trl_metrics[name], **TOL), name
    assert ours["kl"] > 0 and ours["rewards/margins"] != 0  # the KL term and rewards are exercised


def test_chunked_output_layer_equals_the_whole_logits(assets, tmp_path):
    """A model the chunked output layer serves (``MIN_VOCAB`` rows): the policy's, the KL sequences' and the
    reference's log-probabilities through it, the entropy and mean-logit metrics computed a chunk at a time from
    the hidden states: the loss, every metric and every gradient equal ``--no-chunked-loss``'s in fp32."""
    model_dir, data = assets
    big = big_vocab_llama(model_dir, tmp_path / "model")
    ref = load_causal_lm(str(big)).eval()
    policy = _perturbed(ref, scale=0.02)
    widths = []  # the last dimension of each output-layer result: the vocabulary only where the logits are whole
    for model in (policy, ref):
        model.lm_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    results = {}
    for chunked in (True, False):
        widths.clear()
        flags = [*WEIGHTS, "--micro-batch-size", "6", "--global-batch-size", "6"]
        flags += [] if chunked else ["--no-chunked-loss"]
        trainer = KTOFinetuner(RapidliteEngine(args=parse_args(kto_args(big, data, *flags))))
        trainer.train_valid_test_datasets_provider()
        line = f"loss: the output layer's {MIN_VOCAB} logits a chunk" if chunked else "loss: the whole logits"
        assert loss_line(policy, trainer.settings).startswith(line)
        rows = _rows(data, 6)
        samples = encode_unpaired(unpaired_rows(rows, list(rows[0])), trainer.tokenizer, 1024, None, Counts())
        add_kl_completions(samples, 6)
        batch = UnpairedCollator(trainer.tokenizer.pad_token_id, 1024)(samples)
        trainer.model, trainer.ref_model = policy, ref
        policy.train()
        policy.zero_grad()
        trainer.monitor.step_metrics.clear()
        trainer.before_step([batch])
        loss_sum, _ = trainer.run_forward_step(batch, policy)
        loss_sum.backward()
        metrics = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())
        assert widths and (MIN_VOCAB not in widths if chunked else set(widths) == {MIN_VOCAB}), widths
        results[chunked] = float(loss_sum.detach()), metrics, {n: p.grad.clone() for n, p in policy.named_parameters()}
    (loss, metrics, grads), (plain_loss, plain_metrics, plain_grads) = results[True], results[False]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert metrics.keys() == plain_metrics.keys() and set(METRICS) <= metrics.keys()
    for name, value in plain_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------ splits train as one batch


def _step_params(model_dir, data, *flags):
    args = kto_args(model_dir, data, "--train-iters", "1", "--optimizer", "sgd", "--lr", "1.0", *flags)
    trainer = KTOFinetuner(RapidliteEngine(args=parse_args(args)))
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_accumulation_equals_one_big_batch(assets):
    """Micro-batches of 2 x 4 accumulated and one of 8: the KL estimate is the global batch's either way, the loss
    a mean over its rows, so one SGD step gives the same parameters."""
    model_dir, data = assets
    big = _step_params(model_dir, data, "--micro-batch-size", "8", *WEIGHTS)
    small = _step_params(model_dir, data, "--micro-batch-size", "2", *WEIGHTS)
    before = load_causal_lm(str(model_dir)).state_dict()
    assert max(float((big[k] - before[k]).abs().max()) for k in big) > 1e-3
    for name, value in big.items():
        torch.testing.assert_close(small[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """``get(name, *flags)``: the --save directory of 3 SGD steps and a validation, run once."""
    model_dir, data = assets
    root = tmp_path_factory.mktemp("kto-runs")
    done = {}

    def get(name, *flags):
        if name not in done:
            common = ["--train-iters", "3", "--optimizer", "sgd", "--lr", "1e-2", *WEIGHTS]
            proc = rapidlite(*kto_args(model_dir, data, *common, *flags, "--save", str(root / name)))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = root / name
        return done[name]

    return get


def _assert_same_run(run, reference):
    assert_same_metrics(run, reference, ("loss", *METRICS), rel=1e-5, at_least=11)


def test_precomputed_reference_trains_as_the_live_one(runs):
    """``--precompute-ref-logprobs`` (the completions and the KL sequences scored once) against a live frozen copy:
    the same losses and metrics, training and validation."""
    _assert_same_run(runs("precomputed", "--micro-batch-size", "8", "--precompute-ref-logprobs"), runs("one"))


def test_padding_free_trains_as_the_padded_rows(runs):
    """``--padding-free``: each micro-batch's completions packed into one row and its KL sequences into another,
    kept apart by their restarting positions: the same losses and metrics as the padded rows."""
    _assert_same_run(runs("padding_free", "--padding-free"), runs("one"))


TWO_RANKS = {
    "ddp": [],
    "zero3_offload": ["--zero-3-memory-optimization", "--cpu-offload"],
    "deepspeed_zero3": ["--deepspeed", "--zero-3-memory-optimization"],
    # every row split over the 2 ranks (one data-parallel replica: its micro-batch is one process's)
    "context_parallel": ["--context-parallel-size", "2", "--micro-batch-size", "4"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_ranks_train_as_one_process(runs, layout):
    """Two ranks of 2 x 2 micro-batches, the policy and its frozen reference replicated (DDP), sharded by FSDP2 with
    CPU offload, or partitioned by DeepSpeed ZeRO-3: the KL over the global batch, the losses and metrics equal
    one process's; so does each row split over the 2 ranks (context parallelism: completions and KL sequences
    scored shard by shard, the log-probabilities gathered whole)."""
    flags = ["--micro-batch-size", "2", "--nproc-per-node", "2", *TWO_RANKS[layout]]
    _assert_same_run(runs(layout, *flags), runs("one"))


@pytest.mark.slow
def test_demo_separates_the_completions_and_raises_exact_match(tmp_path, monkeypatch):
    """``--task kto --demo`` as the docs run it (the DPO demo's pairs, unpaired): the validation margin between
    desirable and undesirable completions opens, and ``--eval-generate``'s exact match rises over the SFT model's."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "kto", "--demo", "--save", str(tmp_path / "run"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    first, last = evals[0], evals[-1]
    assert first["iteration"] == 0 and 0.05 <= first["exact_match"] <= 0.6
    assert last["rewards/margins"] > 0.5 and last["exact_match"] >= first["exact_match"] + 0.05


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_label", "KTO data needs prompt/completion/label"),
        ("no_completion", "KTO data needs prompt/completion/label"),
        ("prompt_fills", "the prompt fills --max-length 8"),
        ("loss_type", "--loss-type: --task kto does not use it"),
        ("one_row_batches", "raise --global-batch-size"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(assets, tmp_path, case, expected):
    model_dir, data = assets
    rows = _rows(data)
    extra = {
        "prompt_fills": ["--max-length", "8"],
        "loss_type": ["--loss-type", "ipo"],
        "one_row_batches": ["--micro-batch-size", "1", "--global-batch-size", "1"],
    }.get(case, [])
    if case == "no_label":
        rows = [{k: v for k, v in r.items() if k != "label"} for r in rows]
    elif case == "no_completion":
        rows = [{k: v for k, v in r.items() if k != "completion"} for r in rows]
    directory = write_jsonl(tmp_path / case, "train", rows)
    proc = rapidlite_captured(*kto_args(model_dir, directory, *extra, "--save", str(tmp_path / "run")))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
