"""``--task dpo``: its tokenization, losses and metrics equal TRL's trainers on the same tiny model, data and batch
(TRL 1.16, the ``test`` extra's pin), and every layout trains as one process does."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from helpers import (
    as_layout,
    assert_same_metrics,
    big_vocab_llama,
    rapidlite,
    rapidlite_captured,
    read_jsonl,
    read_metrics,
    run_cli,
    write_jsonl,
)
from rapidlite import RapidliteEngine
from rapidlite.data.preference import Counts, encode_pairs, implicit_prompt, read_pair
from rapidlite.models.head import MIN_VOCAB, loss_line
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import load_causal_lm
from rapidlite.tasks.causal_lm_demo import write_demo_assets
from rapidlite.tasks.dpo import DPOFinetuner

trl = pytest.importorskip("trl")
TOL = dict(rel=1e-5, abs=1e-5)


def _near_miss(answer: str) -> str:
    words = answer.split()
    return " ".join(words[1:] + words[:1]) if len(words) > 1 else answer + " " + answer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The causal demo's tiny LLaMA and tokenizer, and pairs: the correct word reversal against a near miss."""
    root = tmp_path_factory.mktemp("dpo")
    model_dir, data_dir = write_demo_assets(root, seed=5, num_train=48, num_validation=16)
    pairs = root / "pairs"
    pairs.mkdir()
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(data_dir / f"{split}.jsonl")]
        with open(pairs / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(
                    json.dumps(
                        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": _near_miss(r["completion"])}
                    )
                    + "\n"
                )
    return model_dir, pairs


def dpo_args(model_dir, data_dir, *extra):
    return [
        "--task", "dpo", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--epochs", "1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def _trainer(model_dir, data_dir, *extra):
    trainer = DPOFinetuner(RapidliteEngine(args=parse_args(dpo_args(model_dir, data_dir, *extra))))
    train, _, _, collate = trainer.train_valid_test_datasets_provider()
    return trainer, train, collate


def _perturbed(model, seed=0, scale=0.05):
    """A policy apart from its reference, so rewards and margins are not all zero."""
    policy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return policy


def _ours(trainer, policy, ref, batch):
    """Our loss and metrics of one training batch."""
    trainer.ref_model = ref
    policy.train()
    trainer.monitor.step_metrics.clear()
    loss_sum, pairs = trainer.run_forward_step(batch, policy)
    metrics = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())
    return float(loss_sum) / pairs, metrics


# ------------------------------------------------------------------ data


def test_implicit_prompt_is_trls_extract_prompt():
    from trl.data_utils import extract_prompt

    chat_c = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat_r = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]
    for chosen, rejected in ((chat_c, chat_r), ("Human: hi Assistant: hello", "Human: hi Assistant: go")):
        expected = extract_prompt({"chosen": chosen, "rejected": rejected})
        assert implicit_prompt(chosen, rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


def test_ultrafeedback_rows_take_their_prompt_from_the_conversations():
    row = {
        "prompt": "What is 2+2?",
        "chosen": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}],
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    }
    pair = read_pair(row)
    assert pair.prompt == [{"role": "user", "content": "What is 2+2?"}]
    assert pair.chosen == [{"role": "assistant", "content": "4"}] and pair.rejected[0]["content"] == "5"


@pytest.mark.parametrize("layout", ["text", "conversation", "implicit"])
def test_tokenization_is_trls(assets, layout):
    """Prompt, chosen and rejected ids equal TRL's DPOTrainer._prepare_dataset (text: EOS appended; chats: the
    chat template, the prompt with its generation prompt)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rapidlite.data.instruction import CHATML_TEMPLATE

    model_dir, pairs = assets
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHATML_TEMPLATE
    rows = as_layout(read_jsonl(pairs)[:6], layout)
    config = trl.DPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=1024)
    model = load_causal_lm(str(model_dir))
    trainer = trl.DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok)
    expected = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in trainer.train_dataset]
    assert encode_pairs(rows, tok, 1024, None, Counts()) == expected


# ------------------------------------------------------------------ losses and metrics against TRL


def _trl_dpo(model_dir, pairs, policy, ref, rows, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    args = trl.DPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=1024, **config)
    trainer = trl.DPOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    policy.train()
    loss = trainer.compute_loss(policy, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), metrics


METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@pytest.mark.parametrize(
    "loss_type, flags, trl_config",
    [
        ("sigmoid", [], {}),
        ("ipo", [], {}),
        ("hinge", [], {}),
        ("robust", ["--label-smoothing", "0.1"], {"label_smoothing": 0.1}),
        # TRL 1.16 has no rpo_alpha: it is loss_type ["sigmoid", "sft"] with weights [1, alpha].
        ("sigmoid", ["--rpo-alpha", "0.5"], {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    ],
)
def test_dpo_losses_and_metrics_equal_trls_dpo_trainer(assets, loss_type, flags, trl_config):
    model_dir, pairs = assets
    trainer, train, collate = _trainer(model_dir, pairs, "--loss-type", loss_type, *flags)
    ref = load_causal_lm(str(model_dir))
    policy = _perturbed(ref)
    rows = read_jsonl(pairs)[:6]
    batch = collate(train[:6])
    ours, metrics = _ours(trainer, policy, ref, batch)
    trl_config = {"loss_type": [loss_type], **trl_config}
    theirs, trl_metrics = _trl_dpo(model_dir, pairs, copy.deepcopy(policy), ref, rows, **trl_config)
    assert ours == pytest.approx(theirs, **TOL)
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], **TOL), name
    assert metrics["rewards/accuracies"] not in (0.0, 1.0)  # the pairs disagree: the metric is exercised


def _cpo_batch(samples, pad_id):
    """TRL's CPO/ORPO batch layout (chosen_* and rejected_* tensors, labels -100 on the prompt), of our samples."""
    batch = {}
    for key in ("chosen", "rejected"):
        seqs = [s["prompt_ids"] + s[f"{key}_ids"] for s in samples]
        labels = [[-100] * len(s["prompt_ids"]) + s[f"{key}_ids"] for s in samples]
        length = max(map(len, seqs))
        batch[f"{key}_input_ids"] = torch.tensor([q + [pad_id] * (length - len(q)) for q in seqs])
        batch[f"{key}_attention_mask"] = torch.tensor([[1] * len(q) + [0] * (length - len(q)) for q in seqs])
        batch[f"{key}_labels"] = torch.tensor([q + [-100] * (length - len(q)) for q in labels])
    return batch


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_equal_trls_cpo_and_orpo_trainers(assets, loss_type):
    """SimPO against CPOTrainer(loss_type="simpo", cpo_alpha=0); ORPO against ORPOTrainer (whose NLL covers the
    chosen sequence's prompt and response: TRL 1.16's ``orpo chosen nll loss is computed over the full prompt and
    response``), on the same batch."""
    from datasets import Dataset

    model_dir, pairs = assets
    flags = ["--loss-type", loss_type, "--beta", "2.0", "--simpo-gamma", "0.3", "--orpo-alpha", "0.2"]
    trainer, train, collate = _trainer(model_dir, pairs, *flags)
    policy = _perturbed(load_causal_lm(str(model_dir)))
    samples = train[:6]
    ours, metrics = _ours(trainer, policy, None, collate(samples))

    tok = trainer.tokenizer  # its pad token chosen (EOS), as TRL's trainers need one
    rows = Dataset.from_list(read_jsonl(pairs)[:6])
    common = dict(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=1024)
    if loss_type == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.3, **common)
        ref_trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=rows, processing_class=tok)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(beta=0.2, **common)
        ref_trainer = ORPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=rows, processing_class=tok)
    model = ref_trainer.model
    model.train()
    loss, trl_metrics = ref_trainer.get_batch_loss_metrics(
        model, _cpo_batch(samples, trainer.tokenizer.pad_token_id), "train"
    )
    assert ours == pytest.approx(float(loss), **TOL)
    names = METRICS + (("nll_loss", "log_odds_ratio", "log_odds_chosen") if loss_type == "orpo" else ())
    for name in names:
        assert metrics[name] == pytest.approx(float(trl_metrics[name]), **TOL), name


# ------------------------------------------------------------------ every layout trains as one process


def _step_params(model_dir, pairs, *flags):
    args = dpo_args(model_dir, pairs, "--train-iters", "1", "--optimizer", "sgd", "--lr", "1.0", *flags)
    trainer = DPOFinetuner(RapidliteEngine(args=parse_args(args)))
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_accumulation_equals_one_big_batch(assets):
    """Pairs of different lengths over 4 micro-batches, with the NLL term (--rpo-alpha): one SGD step equals the
    big batch's (the pair losses divided by the global batch's pairs, the NLL by its chosen tokens)."""
    model_dir, pairs = assets
    big = _step_params(model_dir, pairs, "--micro-batch-size", "8", "--rpo-alpha", "0.5")
    small = _step_params(model_dir, pairs, "--micro-batch-size", "2", "--rpo-alpha", "0.5")
    before = load_causal_lm(str(model_dir)).state_dict()
    assert max(float((big[k] - before[k]).abs().max()) for k in big) > 1e-3
    for name, value in big.items():
        torch.testing.assert_close(small[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_reference_with_disabled_adapters_equals_a_frozen_copy_of_the_base(assets):
    """The same LoRA policy scored against its own base (adapters disabled, no second copy) and against a frozen
    full copy of the base: the same loss and metrics."""
    model_dir, pairs = assets
    trainer, train, collate = _trainer(model_dir, pairs, "--lora-rank", "4", "--train-iters", "1")
    trainer.setup_model(1)
    assert trainer.reference == "adapters" and trainer.ref_model is None
    with torch.no_grad():  # adapters that change the model (LoRA's B starts at zero)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    batch = collate(train[:6])
    trainer.model.train()
    trainer.monitor.step_metrics.clear()
    loss, pairs_n = trainer.run_forward_step(batch, trainer.model)
    adapters = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())
    frozen_loss, frozen = _ours(trainer, trainer.model, load_causal_lm(str(model_dir)).eval(), batch)
    assert float(loss) / pairs_n == pytest.approx(frozen_loss, **TOL)
    assert adapters["rewards/margins"] != 0.0
    for name in METRICS:
        assert adapters[name] == pytest.approx(frozen[name], **TOL), name


TWO = ["--micro-batch-size", "4", "--nproc-per-node", "2"]
LAYOUTS = {
    "one": ["--micro-batch-size", "8"],
    "padding_free": ["--micro-batch-size", "8", "--padding-free"],
    "precomputed": ["--micro-batch-size", "8", "--precompute-ref-logprobs"],
    "ddp": TWO,
    "zero3_offload": [*TWO, "--zero-3-memory-optimization", "--cpu-offload"],
    "deepspeed_zero3": [*TWO, "--deepspeed", "--zero-3-memory-optimization"],
    "tensor_parallel": ["--micro-batch-size", "8", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
    "context_parallel": ["--micro-batch-size", "8", "--nproc-per-node", "2", "--context-parallel-size", "2"],
    "lora_one": ["--micro-batch-size", "8", "--lora-rank", "4"],
    "lora_zero3": [*TWO, "--zero-3-memory-optimization", "--lora-rank", "4"],
    "lora_deepspeed_zero3": [*TWO, "--deepspeed", "--zero-3-memory-optimization", "--lora-rank", "4"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """``get(name)``: the --save directory of layout ``name`` (2 SGD steps with --rpo-alpha, then validation), run
    once (a one-process layout in this process)."""
    model_dir, pairs = assets
    root = tmp_path_factory.mktemp("dpo-layouts")
    done = {}

    def get(name):
        if name not in done:
            common = ["--train-iters", "2", "--optimizer", "sgd", "--lr", "1e-2", "--rpo-alpha", "0.5"]
            run = rapidlite if "--nproc-per-node" in LAYOUTS[name] else rapidlite_captured
            proc = run(*dpo_args(model_dir, pairs, *common, *LAYOUTS[name], "--save", str(root / name)))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = root / name
        return done[name]

    return get


def _assert_same_run(run, reference, rel):
    assert_same_metrics(run, reference, ("loss", "nll_loss", *METRICS), rel)


@pytest.mark.parametrize("layout", ["padding_free", "precomputed"])
def test_padding_free_and_precomputed_reference_train_as_the_padded_live_run(runs, layout):
    """Chosen and rejected packed into one row (no padding, no attention between them); the reference's scores
    precomputed before the first step instead of a live frozen copy: the same losses and metrics."""
    _assert_same_run(runs(layout), runs("one"), rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "zero3_offload", "deepspeed_zero3", "tensor_parallel", "context_parallel"])
def test_two_ranks_train_as_one_process(runs, layout):
    """The policy and its frozen reference laid out alike (replicated, FSDP2-sharded with CPU offload, DeepSpeed
    ZeRO-3 partitioned, split by tensor parallelism, each sequence split by context parallelism): each step's loss
    and metrics, and the validation's, equal one process's."""
    _assert_same_run(runs(layout), runs("one"), rel=1e-5)
    if layout == "context_parallel":
        (state,) = [r for r in read_metrics(runs(layout)) if r.get("split") == "model_state"]
        assert state["strategy"] == "DDP x context parallel 2 (p2p)"


def _adapter(save_dir):
    from safetensors.torch import load_file

    return load_file(str(save_dir / "hf" / "adapter" / "adapter_model.safetensors"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["lora_zero3", "lora_deepspeed_zero3"])
def test_lora_on_two_ranks_trains_the_adapters_of_one_process(runs, layout):
    """LoRA, the reference being the base with the adapters disabled, under FSDP2 ZeRO-3 and DeepSpeed ZeRO-3: the
    losses, metrics and the exported adapters equal one process's."""
    _assert_same_run(runs(layout), runs("lora_one"), rel=1e-5)
    ours, expected = _adapter(runs(layout)), _adapter(runs("lora_one"))
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------ the chunked output layer

CHUNKED_LINE = f"loss: the output layer's {MIN_VOCAB} logits a chunk of tokens at a time"


@pytest.fixture(scope="module")
def big_vocab(assets, tmp_path_factory):
    """The pairs with a tiny LLaMA whose output layer the chunked path serves (``MIN_VOCAB`` rows)."""
    model_dir, pairs = assets
    return big_vocab_llama(model_dir, tmp_path_factory.mktemp("dpo-big-vocab") / "model"), pairs


@pytest.mark.parametrize(
    "flags",
    [
        ["--loss-type", "sigmoid", "--rpo-alpha", "0.5"],
        ["--loss-type", "ipo"],
        ["--loss-type", "simpo", "--simpo-gamma", "0.3"],
        ["--loss-type", "orpo"],
        ["--loss-type", "orpo", "--padding-free"],
    ],
    ids=["sigmoid_rpo", "ipo", "simpo", "orpo", "orpo_padding_free"],
)
def test_chunked_output_layer_equals_the_whole_logits(big_vocab, flags):
    """The policy's and the frozen reference's log-probabilities through the chunked output layer (ORPO's NLL over
    every chosen token from the same per-token call): the loss, every logged metric and every gradient equal
    ``--no-chunked-loss``'s in fp32."""
    model_dir, pairs = big_vocab
    ref = load_causal_lm(str(model_dir)).eval()
    policy = _perturbed(ref)
    widths = []  # the last dimension of each output-layer result: the vocabulary only where the logits are whole
    for model in (policy, ref):
        model.lm_head.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1]))
    results = {}
    for chunked in (True, False):
        widths.clear()
        trainer, train, collate = _trainer(model_dir, pairs, *flags, *([] if chunked else ["--no-chunked-loss"]))
        assert loss_line(policy, trainer.settings).startswith(CHUNKED_LINE if chunked else "loss: the whole logits")
        trainer.ref_model = ref
        policy.train()
        policy.zero_grad()
        trainer.monitor.step_metrics.clear()
        loss_sum, _ = trainer.run_forward_step(collate(train[:6]), policy)
        loss_sum.backward()
        metrics = trainer.monitor.step_metrics.means(trainer.monitor.step_metrics.vector())
        assert widths and (MIN_VOCAB not in widths if chunked else set(widths) == {MIN_VOCAB}), widths
        results[chunked] = float(loss_sum.detach()), metrics, {n: p.grad.clone() for n, p in policy.named_parameters()}
    (loss, metrics, grads), (plain_loss, plain_metrics, plain_grads) = results[True], results[False]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert metrics.keys() == plain_metrics.keys() and {"nll_loss", *METRICS} <= metrics.keys()
    for name, value in plain_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
def test_chunked_output_layer_on_two_zero3_ranks_trains_as_the_whole_logits(big_vocab, tmp_path):
    """FSDP2 ZeRO-3 on 2 ranks, the policy and its frozen reference sharded, with the NLL term: each step's and the
    validation's loss and metrics equal ``--no-chunked-loss``'s, and the run says which path it took."""
    model_dir, pairs = big_vocab
    common = ["--train-iters", "2", "--optimizer", "sgd", "--lr", "1e-2", "--rpo-alpha", "0.5"]
    for name, extra in (("chunked", []), ("plain", ["--no-chunked-loss"])):
        argv = dpo_args(model_dir, pairs, *common, *TWO, "--zero-3-memory-optimization", *extra)
        proc = run_cli(*argv, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (CHUNKED_LINE if not extra else "loss: the whole logits") in proc.stdout + proc.stderr
    assert_same_metrics(tmp_path / "chunked", tmp_path / "plain", ("loss", "nll_loss", *METRICS), 1e-6, at_least=8)


# ------------------------------------------------------------------ bad data


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_rejected", "has no rejected column"),
        ("all_equal", "chosen equals rejected"),
        ("prompt_fills", "the prompt fills --max-length 8"),
    ],
)
def test_bad_data_is_one_line_exit_2_and_nothing_written(assets, tmp_path, case, expected):
    model_dir, pairs = assets
    rows = read_jsonl(pairs)
    if case == "no_rejected":
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in rows]
    elif case == "all_equal":
        rows = [{**r, "rejected": r["chosen"]} for r in rows]
    extra = ["--max-length", "8"] if case == "prompt_fills" else []
    data = write_jsonl(tmp_path / case, "train", rows)
    proc = rapidlite_captured(*dpo_args(model_dir, data, *extra, "--save", str(tmp_path / "run")))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_dropped_and_truncated_rows_are_counted_in_the_data_line(assets, tmp_path, capfd):
    model_dir, pairs = assets
    rows = read_jsonl(pairs)[:10]
    rows[0]["rejected"] = rows[0]["chosen"]
    rows[1]["prompt"] = "word " * 40 + rows[1]["prompt"]
    data = write_jsonl(tmp_path / "data", "train", rows)
    _, train, _ = _trainer(model_dir, data, "--max-length", "30", "--max-prompt-length", "20", "--split", "1,0,0")
    line = next(x for x in capfd.readouterr().out.splitlines() if "data: prompt/chosen/rejected" in x)
    assert "train: 10 rows, 1 prompts cut to --max-prompt-length 20" in line
    assert "1 dropped (chosen equals rejected)" in line
    assert len(train) == 9 and all(len(s["prompt_ids"]) <= 20 for s in train)
    assert all(len(s["prompt_ids"]) + len(s[k]) <= 30 for s in train for k in ("chosen_ids", "rejected_ids"))


# ------------------------------------------------------------------ --dry-run


def test_dry_run_counts_the_reference_the_run_uses(assets):
    """A frozen copy holds the model's fp32 weights per rank (halved by ZeRO-3 over 2 ranks, in host memory with
    --cpu-offload); disabled adapters, precomputed scores and SimPO hold nothing."""
    from rapidlite.planning import plan

    model_dir, pairs = assets
    n_params = sum(p.numel() for p in load_causal_lm(str(model_dir)).parameters())

    def reference_bytes(*flags):
        p = plan(parse_args(dpo_args(model_dir, pairs, "--seq-length", "64", "--dry-run", *flags)).sections)
        rank = p.ranks[0]
        return rank.reference, rank.peak - rank.runtime, p.notes[-1]  # the runtime: this process's own memory

    copy_bytes, copy_peak, note = reference_bytes()
    assert copy_bytes == 4 * n_params and "a frozen copy" in note
    for flags in (["--lora-rank", "4"], ["--precompute-ref-logprobs"], ["--loss-type", "simpo"]):
        assert reference_bytes(*flags)[0] == 0
    none_bytes, none_peak, _ = reference_bytes("--precompute-ref-logprobs")
    assert copy_peak - none_peak == pytest.approx(copy_bytes, rel=0.05)
    dry = ["--seq-length", "64", "--dry-run", *TWO, "--zero-3-memory-optimization"]
    proc = rapidlite_captured(*dpo_args(model_dir, pairs, *dry))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"a frozen copy, {2 * n_params / 2**20:.2f} MiB per rank in the device" in proc.stdout


def test_dry_run_plans_the_chunked_output_layer(big_vocab):
    """A model the chunked path serves: the plan counts no whole logits (2 x 16 sequences of 64 tokens over 8192
    entries: 64 MiB in fp32, and their gradient), as the run computes none; --no-chunked-loss counts them."""
    from rapidlite.planning import plan

    model_dir, pairs = big_vocab

    def planned(*flags):
        argv = dpo_args(model_dir, pairs, "--micro-batch-size", "16", "--global-batch-size", "16", "--seq-length", "64")
        rank = plan(parse_args([*argv, "--dry-run", *flags]).sections).ranks[0]
        return rank.activations + rank.transient

    logits = 2 * 16 * 64 * MIN_VOCAB * 4
    assert planned("--no-chunked-loss") - planned() > logits


# ------------------------------------------------------------------ the demo


@pytest.mark.slow
def test_demo_ranks_the_pairs_and_raises_exact_match_over_the_sft_model(tmp_path, monkeypatch):
    """``--task dpo --demo`` as the docs run it: from the SFT demo model, the share of validation pairs ranked
    right and of exact greedy answers both rise."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "dpo", "--demo", "--save", str(tmp_path / "run"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    first, last = evals[0], evals[-1]
    assert first["iteration"] == 0 and 0.05 <= first["exact_match"] <= 0.6  # the SFT model half knows the skill
    assert last["rewards/accuracies"] >= 0.85 and last["rewards/margins"] > 0
    assert last["exact_match"] >= first["exact_match"] + 0.15


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--beta", "0"], "--beta 0.0: must be positive"),
        (["--max-prompt-length", "0"], "--max-prompt-length 0: must be a positive integer"),
        (["--label-smoothing", "0.5"], "--label-smoothing 0.5: must be in [0, 0.5)"),
        (["--loss-type", "hinge", "--label-smoothing", "0.1"], "--loss-type hinge does not use it"),
        (["--loss-type", "simpo", "--precompute-ref-logprobs"], "--loss-type simpo uses no reference model"),
        (["--loss-type", "orpo", "--rpo-alpha", "1"], "ORPO's loss has its NLL term already"),
    ],
)
def test_flags_out_of_range_or_unused_by_the_loss_are_one_line(assets, flags, expected):
    from rapidlite.errors import ConfigError

    model_dir, pairs = assets
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_args(dpo_args(model_dir, pairs, *flags))
