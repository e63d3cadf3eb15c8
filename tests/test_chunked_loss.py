"""The chunked output layer and loss (``rapidlite.models.chunked_loss``, ``rapidlite.models.head``): the same numbers
as the whole logits and ``F.cross_entropy``, for the function, each model family it serves, every task path
that uses it, tensor parallelism (vocabulary-parallel) and data parallelism; and the memory it saves, measured."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    REPO,
    assert_close_lists,
    bert_run_args,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    train_losses,
    write_tiny_corpus,
)
from rapidlite.models.chunked_loss import IGNORE, PASSING, chunk_rows, planned_share, token_logps
from rapidlite.models.head import MIN_VOCAB, chunkable_head, output_logps
from rapidlite.tasks.pretraining import bert_loss

VOCAB = MIN_VOCAB  # the smallest vocabulary the chunked path serves


@pytest.mark.parametrize("sum_only", [False, True], ids=["per_token", "sum"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_chunks_equal_the_whole_logits(sum_only, bias):
    torch.manual_seed(0)
    n, hidden, vocab = 37, 16, 50
    h = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (n,))
    targets[::3] = IGNORE
    weights = torch.randn(n)  # a per-token loss that is not a plain sum (DPO's shape of use)
    inputs = [h, w] + ([b] if bias else [])

    plain = -F.cross_entropy(F.linear(h, w, b).float(), targets, ignore_index=IGNORE, reduction="none")
    expected = plain.sum() if sum_only else (plain * weights).sum()
    expected_grads = torch.autograd.grad(expected, inputs)
    chunked = token_logps(h, w, b, targets, chunk=5, sum_only=sum_only)  # 8 chunks of the 25 scored rows
    if not sum_only:
        assert chunked.shape == (n,) and (chunked[targets == IGNORE] == 0).all()
        torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    actual = chunked if sum_only else (chunked * weights).sum()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    for got, want in zip(torch.autograd.grad(actual, inputs), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("share", [1.0, 0.15])
def test_the_plans_profile_projects_the_rows_the_run_scores(share):
    """--dry-run's meta profile keeps one chunk's logits as the real path does for the rows it scores: all of a
    causal LM's, a masked LM's --mlm-probability of them (``planned_share``)."""
    rows, hidden, vocab = 1024, 64, 32000
    passing = []

    def pack(t):
        if getattr(t, PASSING, False):
            passing.append(t.shape)
        return t

    with torch.device("meta"):
        h = torch.empty(rows, hidden, requires_grad=True)
        w = torch.empty(vocab, hidden, requires_grad=True)
        targets = torch.zeros(rows, dtype=torch.long)
    with planned_share(share), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logps(h, w, None, targets, sum_only=True)
    out.backward()
    scored = -(-rows * 15 // 100) if share < 1 else rows  # 154 of 1024 at 0.15
    assert passing == [(chunk_rows(scored, hidden, vocab), vocab)]
    assert h.grad.shape == h.shape


def test_a_target_outside_the_vocabulary_is_an_error_not_a_zero():
    with pytest.raises(IndexError, match="outside the 8-token vocabulary"):
        token_logps(torch.randn(3, 4), torch.randn(8, 4), None, torch.tensor([1, 8, IGNORE]))


def test_a_gpu_kernel_takes_the_sums_where_it_runs(monkeypatch):
    import rapidlite.models.chunked_loss as chunked_loss

    assert chunked_loss.gpu_kernel(torch.zeros(1, 4)) is None  # on the CPU: the PyTorch path
    h, w, targets = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, IGNORE, 3, 9, 0, IGNORE])
    expected = token_logps(h, w, None, targets, sum_only=True)
    rows = []

    def kernel(hidden):  # Liger's loss module: (weight, hidden, targets, bias) -> the summed cross-entropy
        def loss(weight, picked, picked_targets, bias):
            rows.append(picked.shape[0])
            return F.cross_entropy(F.linear(picked, weight, bias), picked_targets, reduction="sum")

        return loss

    monkeypatch.setattr(chunked_loss, "gpu_kernel", kernel)
    torch.testing.assert_close(token_logps(h, w, None, targets, sum_only=True), expected)
    assert rows == [4]  # the scored rows only
    token_logps(h, w, None, targets)  # per-token log-probabilities: no kernel has them
    assert rows == [4]


def test_cut_cross_entropy_serves_where_liger_is_missing(monkeypatch):
    """Without liger-kernel, an installed cut-cross-entropy takes the sums in its exact variant."""
    import sys
    import types

    import rapidlite.models.chunked_loss as chunked_loss

    calls = []

    def linear_cross_entropy(e, c, targets, bias=None, ignore_index=-100, reduction="mean", impl="cce"):
        calls.append((impl, reduction, ignore_index))
        return F.cross_entropy(F.linear(e, c, bias), targets, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setitem(
        sys.modules, "cut_cross_entropy", types.SimpleNamespace(linear_cross_entropy=linear_cross_entropy)
    )
    kernel = chunked_loss.installed_kernel()
    h, w, targets = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, 3, 9, 0, 5])
    expected = -token_logps(h, w, None, targets, sum_only=True)
    torch.testing.assert_close(kernel(w, h, targets, None), expected)
    assert calls == [("cce_exact", "sum", IGNORE)]
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    assert chunked_loss.installed_kernel() is None


def tiny(model_type, vocab=VOCAB, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    sizes = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 64, "num_key_value_heads": 2}  # fmt: skip
    if model_type == "gpt2":
        sizes = {"vocab_size": vocab, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    if model_type in ("t5", "mt5"):
        sizes = {"vocab_size": vocab, "d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8}
        sizes |= {"decoder_start_token_id": 0, "pad_token_id": 0}
    if model_type in ("bert", "roberta"):
        sizes.pop("num_key_value_heads")
    config = AutoConfig.for_model(model_type, **sizes, **extra)
    auto = AutoModelForMaskedLM if model_type in ("bert", "roberta") else AutoModelForCausalLM
    auto = AutoModelForSeq2SeqLM if model_type in ("t5", "mt5") else auto
    torch.manual_seed(0)
    return auto.from_config(config).float().eval()


def loss_and_grads(model, inputs, labels, shift, chunked, sum_only):
    model.zero_grad()
    out = output_logps(model, inputs, labels, shift=shift, sum_only=sum_only, chunked=chunked)
    loss = out.sum() if sum_only else (out * torch.linspace(0.5, 1.5, out.shape[1])).sum()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gpt2", "bert", "roberta", "t5", "mt5"])
def test_each_family_scores_and_trains_as_with_the_whole_logits(model_type):
    model = tiny(model_type)
    assert chunkable_head(model) is model.get_output_embeddings()
    shift = model_type not in ("bert", "roberta", "t5", "mt5")
    ids = torch.randint(5, VOCAB, (2, 16))
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt
    if not shift:
        labels[:, ::2] = IGNORE  # unmasked positions, or a target's padding
    inputs = {"input_ids": ids}
    if model_type in ("t5", "mt5"):  # the decoder reads the targets shifted right; T5 scales the head's input
        inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    for sum_only in (True, False):
        chunked, chunked_grads = loss_and_grads(model, inputs, labels, shift, True, sum_only)
        plain, plain_grads = loss_and_grads(model, inputs, labels, shift, False, sum_only)
        torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=2e-6)
        assert chunked_grads.keys() == plain_grads.keys()
        for name, grad in plain_grads.items():
            # 1e-6 of the gradient's scale (mT5's reach 48, where fp32 sums in another order differ by 3e-5)
            atol = 1e-6 * max(1.0, grad.abs().max().item())
            torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=atol, msg=name)
    logits = model(**inputs).logits  # the head is itself again after the call
    assert logits.shape == (2, 16, VOCAB)


def test_heads_the_chunked_path_does_not_serve_keep_the_whole_logits():
    assert chunkable_head(tiny("llama", vocab=MIN_VOCAB - 1)) is None  # small logits: as they were
    gemma = tiny("gemma2", final_logit_softcapping=30.0, head_dim=8)  # a soft-cap after the head
    assert chunkable_head(gemma) is None
    ids = torch.randint(0, VOCAB, (1, 8))
    logps = torch.log_softmax(gemma(input_ids=ids).logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    # the plain path, soft-cap included
    torch.testing.assert_close(output_logps(gemma, {"input_ids": ids}, ids, shift=True), F.pad(logps, (0, 1)))


@pytest.mark.parametrize("next_sentence", [True, False], ids=["mlm_nsp", "mlm_only"])
def test_bert_pretraining_loss_equals_the_models_own(next_sentence):
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = (BertForPreTraining if next_sentence else BertForMaskedLM)(config).eval()
    ids = torch.randint(5, VOCAB, (3, 16))
    labels = torch.full_like(ids, IGNORE)
    labels[:, 2::5] = ids[:, 2::5]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    if next_sentence:
        batch["next_sentence_label"] = torch.tensor([0, 1, 1])
    results = []
    for chunked in (True, False):
        model.zero_grad()
        loss = bert_loss(model, batch, chunked=chunked)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss, grads), (expected, expected_grads) = results
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rapidlite_eval_scores_the_same_through_chunks():
    from rapidlite.evaluation.scoring import CausalLMScorer

    class Tokenizer:  # _batch reads token ids only
        bos_token_id = eos_token_id = 1

    model = tiny("llama")
    requests = [([1, 7, 9, 12], [40, 41]), ([1, 300], [5000, 17, 8000]), ([1, 2, 3, 4, 5, 6], [9])]
    scorer = CausalLMScorer(model, Tokenizer(), max_length=32)
    chunked = scorer._batch(requests)
    scorer.chunked = False
    plain = scorer._batch(requests)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 300, 5000, 17]])).logits.float().log_softmax(-1)
    by_hand = float(logits[0, 1, 5000] + logits[0, 2, 17] + logits[0, 3, 8000])
    assert plain[1] == pytest.approx(by_hand, rel=1e-6)
    assert chunked == pytest.approx(plain, rel=1e-6)


# ---------------------------------------------------------------- end to end, on every layout
MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--num-layers", "2"]  # + EOD
MODEL += ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0"]
MODEL += ["--attention-dropout", "0"]
COMMON = ["--task", "pretraining", *MODEL, "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1"]
COMMON += ["--lr-decay-iters", "6", "--eval-interval", "6", "--eval-iters", "1", "--train-iters", "6"]
TWO = ["--nproc-per-node", "2"]
TP2 = [*TWO, "--tensor-model-parallel-size", "2", "--micro-batch-size", "4"]
LAYOUTS = {
    "single_plain": ["--micro-batch-size", "2", "--no-chunked-loss"],
    "single": ["--micro-batch-size", "2"],  # accumulation of 2 micro-batches
    "tp2_sp_plain": [*TP2, "--sequence-parallel", "--no-chunked-loss"],
    "tp2_sp": [*TP2, "--sequence-parallel"],
    "zero3_plain": [*TWO, "--micro-batch-size", "2", "--zero-3-memory-optimization", "--no-chunked-loss"],
    "zero3": [*TWO, "--micro-batch-size", "2", "--zero-3-memory-optimization"],
    "ds_zero3_plain": [
        *TWO,
        "--micro-batch-size",
        "2",
        "--deepspeed",
        "--zero-3-memory-optimization",
        "--no-chunked-loss",
    ],
    "ds_zero3": [*TWO, "--micro-batch-size", "2", "--deepspeed", "--zero-3-memory-optimization"],
    # Each stage holds one of the two blocks; the last computes the loss in place of the logits.
    "pp2": [*TWO, "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp2_sp_pp2": [*TP2, "--nproc-per-node", "4", "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    write_tiny_corpus(root / "corpus")
    from transformers import LlamaConfig

    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    LlamaConfig(**sizes, intermediate_size=64, vocab_size=98, max_position_embeddings=64).save_pretrained(
        root / "llama"
    )
    models = {"gpt": [], "llama": ["--pretrained-model-name-or-path", str(root / "llama")]}
    done = {}

    def get(model, layout):
        if (model, layout) not in done:
            save = root / f"{model}_{layout}"
            argv = [*COMMON, "--data-path", str(root / "corpus"), *models[model], *LAYOUTS[layout]]
            # a one-process run in this process (its launch is not what these tests are about)
            proc = (rapidlite if "--nproc-per-node" in argv else rapidlite_captured)(*argv, "--save", str(save))
            assert proc.returncode == 0, proc.stderr[-3000:]
            plain = "--no-chunked-loss" in LAYOUTS[layout]
            line = "loss: the whole logits" if plain else f"loss: the output layer's {VOCAB} logits a chunk of tokens"
            assert line in proc.stdout + proc.stderr  # the path the run took, said once
            done[model, layout] = save
        return done[model, layout]

    return get


def assert_same_run(run, reference, rtol):
    assert len(train_losses(run)) == 6
    assert_close_lists(train_losses(run), train_losses(reference), rtol=rtol)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=rtol)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pretraining_through_chunks_trains_as_the_whole_logits(runs, model):
    assert_same_run(runs(model, "single"), runs(model, "single_plain"), rtol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_vocabulary_parallel_chunks_train_as_the_whole_sharded_logits(runs, model):
    # Tensor parallelism itself moves the gradient norm by up to ~3e-5 against one process at this vocabulary
    # (its sums run in another order); the chunked path adds nothing to that.
    assert_same_run(runs(model, "tp2_sp"), runs(model, "tp2_sp_plain"), rtol=1e-6)
    assert_same_run(runs(model, "tp2_sp"), runs(model, "single"), rtol=1e-4)


@pytest.mark.distributed
def test_fsdp2_zero3_through_chunks_trains_as_the_whole_logits(runs):
    # FSDP2 itself moves the gradient norm by ~2e-5 against one process at this vocabulary (its reduce-scatter
    # sums in another order); the chunked path adds nothing to that.
    assert_same_run(runs("llama", "zero3"), runs("llama", "zero3_plain"), rtol=1e-6)
    assert_same_run(runs("llama", "zero3"), runs("llama", "single"), rtol=1e-4)


@pytest.mark.distributed
def test_deepspeed_zero3_gathers_the_output_layer_for_its_chunks(runs):
    # The partitioned weight's rows are counted from DeepSpeed's ds_shape; its data is gathered for the call.
    assert_same_run(runs("llama", "ds_zero3"), runs("llama", "ds_zero3_plain"), rtol=1e-6)
    assert_same_run(runs("llama", "ds_zero3"), runs("llama", "single"), rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("model,layout", [("gpt", "pp2"), ("llama", "pp2"), ("llama", "tp2_sp_pp2")])
def test_a_pipelines_last_stage_computes_the_loss_through_chunks(runs, model, layout):
    # Training and evaluation (the forward-only schedule) both take the chunks on the last stage.
    assert_same_run(runs(model, layout), runs(model, "single"), rtol=1e-5 if layout == "pp2" else 1e-4)
    validation = [[r["loss"] for r in read_metrics(runs(model, name)) if r.get("split") == "validation"]
                  for name in (layout, "single")]  # fmt: skip
    assert len(validation[0]) == 1
    assert_close_lists(*validation, rtol=1e-5)


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked_bert")
    argv = [*bert_run_args(root / "data", vocab_size=VOCAB), "--micro-batch-size", "2"]
    layouts = {"single": [], "pp2": [*TWO, "--pipeline-model-parallel-size", "2"], "tp2": TP2[:-2]}
    saves = {}
    for name, layout in layouts.items():
        proc = (rapidlite if layout else rapidlite_captured)(*argv, *layout, "--save", str(root / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"loss: the output layer's {VOCAB} logits a chunk of tokens" in proc.stdout + proc.stderr
        saves[name] = root / name
    return saves


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_bert_pretraining_takes_the_chunks_in_a_pipeline_and_under_tensor_parallelism(bert_runs, layout):
    # Tensor parallelism gathers BERT's logits whole (its decoder's layout); the chunks' log-probabilities
    # leave the layer replicated, as that layout wants them.
    run, single = bert_runs[layout], bert_runs["single"]
    assert len(train_losses(run)) == 5
    assert_close_lists(train_losses(run), train_losses(single), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(single, "grad_norm"), rtol=1e-4)


def test_a_gpt_pipeline_stage_returns_the_chunked_loss_not_the_logits():
    from types import SimpleNamespace

    from rapidlite.models.gpt import GPTConfig, GPTModel
    from rapidlite.models.spec import spec_of

    torch.manual_seed(0)
    config = GPTConfig(VOCAB, num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, hidden_dropout=0)
    model, split = GPTModel(config).eval(), spec_of(GPTModel(config)).pipeline
    ids, labels = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    labels[0, :3] = IGNORE
    loss_mask = torch.ones(2, 8)
    loss_mask[1, 5:] = 0
    layers = torch.nn.ModuleDict({str(i): block for i, block in enumerate(model.layers)})
    parts = {"embedding": model.embedding, "final_norm": model.final_norm, "output": model.output}
    stage = SimpleNamespace(first=True, last=True, config=model.config, layers=layers, **parts)  # one stage: all
    for chunked in (True, False):
        model.chunked_loss = chunked
        call = split.bind(model, (ids,), {"labels": labels, "loss_mask": loss_mask})
        out = split.run(stage, ids, call)
        assert out.shape == (() if chunked else (2, 8, model.output.weight.shape[0]))  # the loss, or the logits
        loss, count = split.finish(model, out, call)
        expected, expected_count = model(ids, labels=labels, loss_mask=loss_mask)
        assert count == expected_count == 10  # 5 labelled in the first row, 5 the mask keeps in the second
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------- memory, measured
MEASURE = """
import sys, torch, torch.nn.functional as F
from rapidlite.models.chunked_loss import token_logps
from rapidlite.observe.logging import peak_memory_bytes
chunked, n, hidden, vocab = sys.argv[1] == "chunked", 2048, 64, 32768
torch.manual_seed(0)
peak_memory_mb = lambda: peak_memory_bytes(torch.device("cpu")) / 2**20


def step(n, vocab):
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    before = peak_memory_mb()
    if chunked:
        loss = -token_logps(h, w, None, targets, sum_only=True)
    else:
        loss = F.cross_entropy((h @ w.t()).float(), targets, reduction="sum")
    loss.backward()
    return peak_memory_mb() - before


step(4, 64)  # the kernels' first use (their libraries' pages) is not what is measured
print(step(n, vocab))
"""


def test_the_whole_logits_never_exist():
    """2048 tokens over a 32k vocabulary: the logits alone are 256 MiB (and their gradient as much again)."""
    grown = {}
    for mode in ("chunked", "plain"):
        proc = subprocess.run([sys.executable, "-c", MEASURE, mode], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        grown[mode] = float(proc.stdout.split()[-1])
    logits_mib = 2048 * 32768 * 4 / 2**20
    assert grown["plain"] > 1.5 * logits_mib, grown  # the logits and their gradient, at least
    # The weight's gradient (8 MiB) and one chunk of 256 tokens' logits (32 MiB), its softmax made in place
    assert grown["chunked"] < 0.5 * logits_mib and grown["chunked"] < 0.2 * grown["plain"], grown
    print(json.dumps(grown))


MEASURE_DPO = """
import sys, types, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rapidlite.observe.logging import peak_memory_bytes
from rapidlite.tasks.dpo import DPOFinetuner
from rapidlite.tasks.preference_losses import PairScores, pair_loss
chunked, vocab = sys.argv[1] == "chunked", 32768
torch.manual_seed(0)
peak_memory_mb = lambda: peak_memory_bytes(torch.device("cpu")) / 2**20
sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, max_position_embeddings=1024, **sizes))
# forward_logps reads two things of its trainer: the flag, and the context-parallel group (none here)
trainer = types.SimpleNamespace(settings=types.SimpleNamespace(model=types.SimpleNamespace(chunked_loss=chunked)),
                                engine=types.SimpleNamespace(dist=types.SimpleNamespace(cp_group=None)))


def step(pairs, length):
    ids = torch.randint(0, vocab, (pairs, 2, length))  # each pair's chosen and rejected sequence
    labels = ids.clone()
    labels[..., : length // 8] = -100  # the prompts
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    before = peak_memory_mb()
    logps, tokens = DPOFinetuner.forward_logps(trainer, model, batch)
    (chosen, rejected), (chosen_tokens, rejected_tokens) = logps.chunk(2), tokens.chunk(2)
    ref = torch.zeros_like(chosen)
    scores = PairScores(chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen=ref, ref_rejected=ref)
    pair_loss("sigmoid", scores, 0.1, 0.0, 0.0).losses.sum().backward()
    return peak_memory_mb() - before


step(1, 8)  # the kernels' first use (their libraries' pages) is not what is measured
print(step(2, 512))
"""


def test_dpo_through_chunks_never_holds_the_whole_logits():
    """DPO's forward and backward (``DPOFinetuner.forward_logps``, the sigmoid loss) of 2 pairs x 512 tokens over a
    32k vocabulary: the whole logits are 256 MiB (and their float copies and gradients more)."""
    grown = {}
    for mode in ("chunked", "plain"):
        proc = subprocess.run([sys.executable, "-c", MEASURE_DPO, mode], capture_output=True, text=True, timeout=300,
                              cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                             "HF_HUB_OFFLINE": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        grown[mode] = float(proc.stdout.split()[-1])
    logits_mib = 4 * 512 * 32768 * 4 / 2**20
    assert grown["plain"] > 1.5 * logits_mib, grown
    assert grown["chunked"] < 0.5 * logits_mib and grown["chunked"] < 0.2 * grown["plain"], grown
    print(json.dumps(grown))


STATS_SHARDED = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from rapidlite.models.chunked_loss import IGNORE, token_stats


def run(rank):
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
    torch.manual_seed(0)
    h, w, b = torch.randn(9, 8), torch.randn(21, 8), torch.randn(21)
    targets = torch.tensor([1, IGNORE, 3, 20, 0, IGNORE, 5, 6, 7])
    rows = slice(0, 11) if rank == 0 else slice(11, 21)  # a vocabulary-parallel output layer's shards
    sharded = token_stats(h, w[rows], b[rows], targets, chunk=4, group=dist.group.WORLD, vocab=21)
    for got, want in zip(sharded, token_stats(h, w, b, targets, chunk=4), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dist.destroy_process_group()


mp.start_processes(run, nprocs=2, start_method="fork")
print("equal")
"""


def test_token_stats_equal_the_whole_logits_and_their_vocabulary_shards(tmp_path):
    """KTO's entropy and mean logit a chunk at a time: as from the whole logits (``logits_stats``), and from two
    vocabulary shards all-reduced (tensor parallelism) as from the whole output layer."""
    from rapidlite.models.chunked_loss import token_stats
    from rapidlite.models.head import logits_stats

    torch.manual_seed(0)
    h, w = torch.randn(2, 7, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (2, 7))
    targets[0, :3] = IGNORE
    for got, want in zip(token_stats(h, w, None, targets, chunk=3), logits_stats(h @ w.t(), targets), strict=True):
        assert got.shape == (2, 7) and (got[0, :3] == 0).all()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", STATS_SHARDED, str(tmp_path / "store")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0 and "equal" in proc.stdout, proc.stderr[-2000:]
