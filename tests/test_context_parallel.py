"""Context parallelism: its attention (``rapidlite.parallel.cp_attention``) against SDPA on the whole sequence, and
whole runs split over ranks (``rapidlite.parallel.context_parallel``) against one process."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import (
    REPO,
    assert_close_lists,
    bert_run_args,
    layout_runs,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    stopped_copy,
    train_losses,
    write_tiny_corpus,
)
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.parallel.context_parallel import shard, unshard
from rapidlite.parallel.cp_attention import shard_indices

# Every case on N forked ranks over gloo: each rank attends its load-balanced shard and compares its output and
# its shard of the input gradients with SDPA on the whole sequence (fp32); rank 0 prints the largest errors.
ATTENTION = r"""
import json, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.nn.functional as F
from rapidlite.models.padding_free import segments as documents_of
from rapidlite.parallel.context_parallel import shard
from rapidlite.parallel.cp_attention import context_parallel_attention

def reference(q, k, v, causal, segments):
    mask = None
    if segments is not None:
        mask = (segments[:, :, None] == segments[:, None, :])[:, None]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])

def run(rank, n):
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=n)
    group = dist.new_group(list(range(n)))
    errors = {}
    for comm in ("p2p", "a2a"):
        for causal in (True, False):
            for kv_heads in (4, 2):
                for packed in (False, True):
                    if comm == "a2a" and kv_heads % n:
                        continue
                    g = torch.Generator().manual_seed(0)
                    b, s, d = 2, 8 * n, 8
                    q = torch.randn(b, 4, s, d, generator=g, requires_grad=True)
                    k = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
                    v = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
                    grad = torch.randn(b, 4, s, d, generator=g)
                    segments = None
                    if packed:  # documents of 3..9 tokens, crossing the shards' borders
                        positions = torch.cat([torch.arange(s) % 5, (torch.arange(s) + 2) % 7]).view(b, s)
                        segments = documents_of(positions)
                    want = reference(q, k, v, causal, segments)
                    want.backward(grad)
                    expected = [want] + [t.grad for t in (q, k, v)]
                    local = [shard(t.detach(), n, rank, dim=2).requires_grad_() for t in (q, k, v)]
                    out = context_parallel_attention(*local, group, comm, causal=causal,
                        segment_ids=None if segments is None else shard(segments, n, rank, dim=1))
                    out.backward(shard(grad, n, rank, dim=2))
                    got = [out] + [t.grad for t in local]
                    errors[f"{comm} causal={causal} kv_heads={kv_heads} packed={packed}"] = max(
                        (a - shard(e, n, rank, dim=2)).abs().max().item() for a, e in zip(got, expected))
    gathered = [None] * n
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        print(json.dumps({case: max(e[case] for e in gathered) for case in errors}))
    dist.destroy_process_group()

n = int(sys.argv[2])
mp.start_processes(run, args=(n,), nprocs=n, start_method="fork")
"""


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_and_ulysses_attention_equal_sdpa_on_the_whole_sequence(tmp_path, ranks):
    """Outputs and the gradients of q, k and v within 1e-5 of one process's SDPA: causal and not, with grouped
    key/value heads, with packed documents whose borders fall inside and across the shards."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", ATTENTION, str(tmp_path / "store"), str(ranks)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.splitlines()[-1])
    expected_cases = 16 if ranks == 2 else 12  # a2a needs the 2 key/value heads divisible by the ranks
    assert len(errors) == expected_cases, errors
    assert all(error < 1e-5 for error in errors.values()), errors


def test_the_split_balances_causal_work_and_reassembles():
    """Rank i holds chunks i and 2N-1-i; every token is held once; under a causal mask each rank's queries see
    the same number of keys."""
    assert shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for n in (2, 4):
        seen = [(shard_indices(32, n, r) + 1).sum().item() for r in range(n)]  # keys seen by the rank's queries
        assert len(set(seen)) == 1, seen
        x = torch.arange(64).view(2, 32)
        assert torch.equal(unshard([shard(x, n, r) for r in range(n)]), x)
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        shard_indices(12, 4, 0)


# ---------------------------------------------------------------------------------------- whole runs, 1 process

MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32"]
MODEL += ["--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0"]
COMMON = ["--task", "pretraining", *MODEL, "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1"]
COMMON += ["--lr-decay-iters", "6", "--eval-interval", "6", "--eval-iters", "1"]
CP2 = ["--micro-batch-size", "4", "--nproc-per-node", "2", "--context-parallel-size", "2"]
LAYOUTS = {
    "single": ["--micro-batch-size", "4"],
    "cp2_p2p": CP2,
    "cp2_a2a": [*CP2, "--cp-comm-type", "a2a"],
    "cp2_dp2_zero3": ["--micro-batch-size", "2", "--nproc-per-node", "4", "--context-parallel-size", "2",
                      "--zero-3-memory-optimization"],
    "cp2_tp2": ["--micro-batch-size", "4", "--nproc-per-node", "4", "--context-parallel-size", "2",
                "--tensor-model-parallel-size", "2"],
    # Each stage's attention over the 2 ranks of its sequence: 2 micro-batches of 4 through 2 stages.
    "cp2_pp2_a2a": ["--micro-batch-size", "4", "--nproc-per-node", "4", "--context-parallel-size", "2",
                "--pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a", "--zero-2-memory-optimization"],
}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("cp_data") / "tiny_text_document"
    write_tiny_corpus(prefix)
    return ["--data-path", str(prefix)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return layout_runs(tmp_path_factory.mktemp("cp_runs"), [*COMMON, *data], LAYOUTS)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp2_p2p", "cp2_a2a", "cp2_dp2_zero3", "cp2_tp2", "cp2_pp2_a2a"])
def test_context_parallel_trains_like_one_process(runs, layout):
    """The built-in GPT, each sequence split over 2 ranks (and with 2 data-parallel replicas under ZeRO-3, 2
    tensor-parallel shards, or 2 pipeline stages under ZeRO-2, on 4 ranks): the same losses, gradient norms,
    evaluation and parameters as one process."""

    reference, run = runs("single"), runs(layout)
    comm = "a2a" if "a2a" in layout else "p2p"
    output = (run.parent / f"{layout}.log").read_text()
    assert f"context parallelism: this rank trains 16 of the 32 tokens of each sequence ({comm})" in output
    assert len(train_losses(run)) == 6
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)
    evaluations = [
        [r["loss"] for r in read_metrics(save) if r.get("split") == "validation"] for save in (run, reference)
    ]
    assert len(evaluations[0]) == 1
    assert_close_lists(*evaluations, rtol=1e-5)
    expected, actual = read_model_tensors(reference / "iter_0000006"), read_model_tensors(run / "iter_0000006")
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-5, k


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny LLaMA config (grouped-query attention: 4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("cp_llama") / "config"
    LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=98, max_position_embeddings=64, bos_token_id=96, eos_token_id=96,
    ).save_pretrained(path)  # fmt: skip
    return ["--pretrained-model-name-or-path", str(path)]


def _pair(root, argv, layout, iterations="4"):
    """``argv`` trained in one process and under ``layout`` (4 iterations each); the two save directories."""

    saves = {}
    for name, run, flags in (("single", rapidlite_captured, LAYOUTS["single"]), ("split", rapidlite, layout)):
        saves[name] = root / name
        proc = run(*argv, *flags, "--train-iters", iterations, "--save", str(saves[name]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return saves["single"], saves["split"]


def _same_curve(run, reference, iterations=4):

    assert len(train_losses(run)) == iterations
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["llama_a2a_packed", "gpt_p2p_packed_recomputed", "llama_lora_offloaded"])
def test_more_context_parallel_runs_train_like_one_process(data, llama, tmp_path, case):
    """A Hugging Face LLaMA (grouped-query attention) by all-to-all, and by ring with LoRA adapters and
    activation offload; packed documents that cross the shards (the built-in GPT's --reset-attention-mask,
    LLaMA's restarting positions), with activation checkpointing."""
    model = [*COMMON, *llama] if case.startswith("llama") else [*COMMON]
    if "packed" in case:
        model += ["--reset-position-ids"] + (["--reset-attention-mask"] if case.startswith("gpt") else [])
    if case.endswith("recomputed"):  # the checkpointed blocks' ring attention runs again in the backward
        model += ["--checkpoint-activations"]
    if case == "llama_lora_offloaded":  # the ring's saved tensors go through the offload hooks too
        model += ["--lora-rank", "4", "--offload-activations"]
    layout = [*CP2, "--cp-comm-type", "a2a"] if "a2a" in case else CP2
    reference, run = _pair(tmp_path, [*model, *data], layout)
    _same_curve(run, reference)


@pytest.mark.distributed
def test_a_context_parallel_checkpoint_resumes_on_one_process(runs, data, tmp_path):
    """Stopped after iteration 3 of the CP2 run, resumed on one process: the rest of the one-process curve."""

    resumed = stopped_copy(runs("cp2_p2p"), tmp_path / "resumed", 3)
    argv = [*COMMON, *data, *LAYOUTS["single"], "--train-iters", "6", "--load", str(resumed), "--save", str(resumed)]
    proc = rapidlite_captured(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(resumed), train_losses(runs("single")), rtol=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seq-length", "30"], "--seq-length 30 is not divisible by 2 x 2"),
        (["--attention-dropout", "0.1"], "attention dropout 0.1 is not split over ranks; add --attention-dropout 0"),
        (["--num-attention-heads", "1", "--hidden-size", "32", "--cp-comm-type", "a2a"],
         "1 attention heads are not all divisible by 2; use --cp-comm-type p2p"),
        (["--nproc-per-node", "3"], "is not divisible by tensor x pipeline x context parallel size 1 x 1 x 2"),
    ],
)  # fmt: skip
def test_what_context_parallelism_cannot_split_is_one_line(data, flags, message):

    argv = [*COMMON, *data, *CP2, "--train-iters", "1", *flags]
    launched = "--num-attention-heads" in flags  # found on the model, in the launched ranks
    proc = (rapidlite if launched else rapidlite_captured)(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_hugging_face_decoder_in_a_pipeline_is_refused(data, llama):
    """The pipeline's stages pass the built-in GPT's documents (segment ids) on; a Hugging Face decoder's split is
    not built: one line before any process starts."""
    argv = [*COMMON, *llama, *data, *CP2, "--nproc-per-node", "4", "--pipeline-model-parallel-size", "2"]
    proc = rapidlite_captured(*argv, "--train-iters", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--context-parallel-size 2 with --pipeline-model-parallel-size 2: built for the built-in GPT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_encoders_and_other_tasks_are_refused(tmp_path):

    proc = rapidlite_captured(*bert_run_args(tmp_path), "--context-parallel-size", "2", "--nproc-per-node", "2")
    assert proc.returncode == 2 and "BERT is an encoder" in proc.stderr, proc.stderr[-2000:]
    proc = rapidlite_captured("--task", "sequence_classification", "--demo", *CP2[2:])
    assert proc.returncode == 2 and "--task sequence_classification does not split its sequences" in proc.stderr
    proc = rapidlite_captured("--task", "causal_lm", "--demo", "--cp-comm-type", "a2a")
    assert proc.returncode == 2 and "--cp-comm-type chooses context parallelism's attention" in proc.stderr
    proc = rapidlite_captured("--task", "causal_lm", "--demo", *CP2[2:], "--eval-generate", "2")
    assert proc.returncode == 2 and "with --eval-generate: not built for split sequences" in proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_causal_lm_fine_tuning_splits_like_one_process(tmp_path_factory, tmp_path, packing):
    """``--task causal_lm``: right-padded batches of varying length (padded further to a multiple of 4) by ring,
    and packed rows with restarting positions by all-to-all, split over 2 ranks: the one-process losses,
    gradient norms and token-exact validation loss."""
    from rapidlite.tasks.causal_lm_demo import write_demo_assets

    model_dir, data_dir = write_demo_assets(tmp_path_factory.mktemp("cp_causal"), 5, num_train=48, num_validation=8)
    argv = [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--global-batch-size", "8", "--lr", "2e-3", "--seq-length", "96", "--train-iters", "4", "--log-interval",
        "1", "--eval-interval", "4", *(["--packing"] if packing else []),
    ]  # fmt: skip
    saves = {}
    split = [*CP2, "--cp-comm-type", "a2a"] if packing else CP2
    for name, run, layout in (("single", rapidlite_captured, ["--micro-batch-size", "4"]), ("cp2", rapidlite, split)):
        saves[name] = tmp_path / name
        proc = run(*argv, *layout, "--save", str(saves[name]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(saves["cp2"], saves["single"], iterations=len(train_losses(saves["single"])))  # packed: 3 fill it
    evaluations = [[r["loss"] for r in read_metrics(s) if r.get("split") == "validation"] for s in saves.values()]
    assert len(evaluations[0]) >= 1
    assert_close_lists(evaluations[1], evaluations[0], rtol=1e-5)


def test_a_user_script_is_refused(tmp_path):
    """A user's forward step would hand whole sequences to attention that expects the rank's shard."""
    script = tmp_path / "train.py"
    script.write_text("from rapidlite import RapidliteEngine\nRapidliteEngine()\n")
    proc = rapidlite_captured("--user-script", str(script), *CP2[2:])
    assert proc.returncode == 2, proc.stderr
    assert "--context-parallel-size is read by the tasks that cut sequences" in proc.stderr
    assert "(causal_lm, dpo, grpo, kto, pretraining, rloo)" in proc.stderr
