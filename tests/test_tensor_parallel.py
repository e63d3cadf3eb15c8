"""Tensor parallelism (with sequence parallelism, and with data parallelism on 4 processes) of the built-in
GPT through ``rapidlite --task pretraining``, compared with one process."""

import pytest
import torch

from helpers import (
    assert_close_lists,
    bert_run_args,
    layout_runs,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    train_losses,
    write_tiny_corpus,
)
from rapidlite.checkpoint.dcp import read_model_tensors

pytestmark = pytest.mark.distributed

MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32"]
MODEL += ["--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0"]
COMMON = ["--task", "pretraining", *MODEL, "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1"]
COMMON += ["--lr-decay-iters", "6", "--eval-interval", "6", "--eval-iters", "1"]
LAYOUTS = {
    "single": ["--micro-batch-size", "4"],
    "tp2": ["--micro-batch-size", "4", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--micro-batch-size", "4", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
               "--sequence-parallel"],
    "tp2_dp2": ["--micro-batch-size", "2", "--nproc-per-node", "4", "--tensor-model-parallel-size", "2"],
    "tp2_sp_dp2_fsdp": ["--micro-batch-size", "2", "--nproc-per-node", "4", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--zero-3-memory-optimization"],
}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tp_data") / "tiny_text_document"
    write_tiny_corpus(prefix)
    return ["--data-path", str(prefix)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return layout_runs(tmp_path_factory.mktemp("tp_runs"), [*COMMON, *data], LAYOUTS)


def state(save):
    (record,) = [r for r in read_metrics(save) if r.get("split") == "model_state"]
    return record


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, data):
    """``get(name, model_args)``: the one-process reference run of a Hugging Face model (6 iterations,
    checkpoints at 3 and 6), trained once in this process and shared by the module's tests."""
    root, done = tmp_path_factory.mktemp("tp_single"), {}

    def get(name, model):
        if name not in done:
            argv = [*COMMON, *data, *model, *LAYOUTS["single"], "--train-iters", "6", "--save-interval", "3"]
            proc = rapidlite_captured(*argv, "--save", str(root / name))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = root / name
        return done[name]

    return get


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_dp2", "tp2_sp_dp2_fsdp"])
def test_tensor_parallel_trains_like_one_process(runs, layout):
    reference, run = runs("single"), runs(layout)
    assert len(train_losses(run)) == 6
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)
    expected = read_model_tensors(reference / "iter_0000006")
    actual = read_model_tensors(run / "iter_0000006")  # DTensor shards read back whole
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


def test_parameters_are_split_over_tensor_parallel_ranks(runs):
    single, tp2, tp2_fsdp = state(runs("single")), state(runs("tp2")), state(runs("tp2_sp_dp2_fsdp"))
    assert state(runs("tp2"))["strategy"] == "DDP x tensor parallel 2"
    # Every matrix (embeddings, projections, output) is halved; norms and biases (< 3% here) are replicated.
    assert tp2["param_bytes"] == pytest.approx(single["param_bytes"] / 2, rel=0.05)
    assert tp2["optimizer_bytes"] == pytest.approx(single["optimizer_bytes"] / 2, rel=0.05)
    # FSDP over the 2 data-parallel ranks shards those halves again.
    assert tp2_fsdp["param_bytes"] == pytest.approx(single["param_bytes"] / 4, rel=0.05)


@pytest.mark.parametrize("first,then", [("tp2", "single"), ("single", "tp2_sp_dp2_fsdp")])
def test_checkpoints_reshard_across_layouts(runs, data, tmp_path, first, then):
    """Iteration 3's checkpoint of one layout, resumed in another, continues the one-process loss curve."""
    import shutil

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(runs(first) / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3")
    argv = [*COMMON, *data, *LAYOUTS[then], "--train-iters", "6", "--load", str(resumed), "--save", str(resumed)]
    proc = (rapidlite if "--nproc-per-node" in LAYOUTS[then] else rapidlite_captured)(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(resumed), train_losses(runs("single"))[3:], rtol=1e-5)


def test_mixed_precision_and_recompute_run_under_tensor_parallel(data, tmp_path):
    argv = [*COMMON, *data, *LAYOUTS["tp2_sp"], "--train-iters", "3", "--bf16", "--checkpoint-activations"]
    argv += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
    proc = rapidlite(*argv, "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(tmp_path)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(
    "argv,message,launched",
    [
        (["--hidden-size", "48", "--num-attention-heads", "3"], "--num-attention-heads 3 is not divisible by", True),
        (["--nproc-per-node", "3"], "is not divisible by tensor x pipeline parallel size 2 x 1", False),
        (["--zero-1-memory-optimization"], "--zero-1-memory-optimization does not combine", False),
    ],
)
def test_bad_layouts_are_one_line(data, argv, message, launched):
    """``launched``: the workers find the error (a launch); else the launcher refuses before it starts any, so
    the command runs in this process."""
    base = [*COMMON, *data, "--micro-batch-size", "4", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]
    argv = [*base, *argv, "--train-iters", "2"]
    proc = rapidlite(*argv, timeout=120) if launched else rapidlite_captured(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rapidlite: error:")]
    assert len(errors) == 1, proc.stderr


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny LLaMA config (grouped-query attention: 4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama") / "config"
    LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=98, max_position_embeddings=64, bos_token_id=96, eos_token_id=96,
    ).save_pretrained(path)  # fmt: skip
    return ["--pretrained-model-name-or-path", str(path)]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_dp2_fsdp"])
def test_hugging_face_llama_tensor_parallel_trains_like_one_process(data, llama, single_run, tmp_path, layout):
    layouts = {"tp2": LAYOUTS["tp2"], "tp2_sp": LAYOUTS["tp2_sp"]}
    layouts["tp2_dp2_fsdp"] = [*LAYOUTS["tp2_dp2"], "--zero-3-memory-optimization"]
    saves = {"single": single_run("llama", llama), layout: tmp_path / layout}
    proc = rapidlite(*COMMON, *data, *llama, *layouts[layout], "--train-iters", "6", "--save", str(saves[layout]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(train_losses(saves[layout])) == 6
    assert_close_lists(train_losses(saves[layout]), train_losses(saves["single"]), rtol=1e-5)
    assert_close_lists(train_losses(saves[layout], "grad_norm"), train_losses(saves["single"], "grad_norm"), rtol=1e-5)
    single_bytes, split_bytes = state(saves["single"])["param_bytes"], state(saves[layout])["param_bytes"]
    assert split_bytes < 0.55 * single_bytes  # every projection, the embedding and the output are split


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 config (fused q/k/v in one Conv1D, tied embedding and output layer)."""
    from transformers import GPT2Config

    path = tmp_path_factory.mktemp("gpt2") / "config"
    GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=98, bos_token_id=96, eos_token_id=96,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    ).save_pretrained(path)  # fmt: skip
    return ["--pretrained-model-name-or-path", str(path)]


@pytest.fixture(scope="module")
def gpt2_tp2(tmp_path_factory, data, gpt2):
    """GPT-2 under tensor parallelism 2 (6 iterations, checkpoints at 3 and 6), trained once for the module."""
    save = tmp_path_factory.mktemp("gpt2_tp2") / "tp2"
    argv = [*COMMON, *data, *gpt2, *LAYOUTS["tp2"], "--train-iters", "6", "--save-interval", "3"]
    proc = rapidlite(*argv, "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_dp2_fsdp"])
def test_hugging_face_gpt2_tensor_parallel_trains_like_one_process(data, gpt2, single_run, gpt2_tp2, tmp_path, layout):
    """GPT-2's fused q/k/v projection is split column-wise in its original layout and regrouped per head
    after the projection, so checkpoints and the export stay Hugging Face's."""
    from transformers import AutoModelForCausalLM

    layouts = {"tp2": LAYOUTS["tp2"], "tp2_sp": LAYOUTS["tp2_sp"]}
    layouts["tp2_dp2_fsdp"] = [*LAYOUTS["tp2_dp2"], "--zero-3-memory-optimization"]
    saves = {"single": single_run("gpt2", gpt2), layout: gpt2_tp2 if layout == "tp2" else tmp_path / layout}
    if layout != "tp2":
        proc = rapidlite(*COMMON, *data, *gpt2, *layouts[layout], "--train-iters", "6", "--save", str(saves[layout]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(saves[layout]), train_losses(saves["single"]), rtol=1e-5)
    assert_close_lists(train_losses(saves[layout], "grad_norm"), train_losses(saves["single"], "grad_norm"), rtol=1e-5)
    single_bytes, split_bytes = state(saves["single"])["param_bytes"], state(saves[layout])["param_bytes"]
    assert split_bytes < 0.6 * single_bytes  # the position embedding, norms and row-parallel biases are whole
    expected = AutoModelForCausalLM.from_pretrained(saves["single"] / "hf").state_dict()
    actual = AutoModelForCausalLM.from_pretrained(saves[layout] / "hf").state_dict()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


def test_gpt2_tensor_parallel_checkpoint_resumes_on_one_process(data, gpt2, single_run, gpt2_tp2, tmp_path):
    saves = {"single": single_run("gpt2", gpt2), "tp2": gpt2_tp2}
    import shutil

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(saves["tp2"] / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3")
    argv = [*COMMON, *data, *gpt2, *LAYOUTS["single"], "--train-iters", "6", "--load", str(resumed)]
    proc = rapidlite_captured(*argv, "--save", str(resumed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(resumed), train_losses(saves["single"])[3:], rtol=1e-5)


def test_families_without_a_plan_are_one_line(data, tmp_path):
    from transformers import GPTNeoConfig

    path = tmp_path / "gpt_neo"
    GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, attention_types=[[["global"], 2]], vocab_size=98
    ).save_pretrained(path)
    argv = [*COMMON, *data, "--pretrained-model-name-or-path", str(path), *LAYOUTS["tp2"], "--train-iters", "2"]
    proc = rapidlite(*argv, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no tensor-parallel plan for" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """The BERT pretraining flags (micro-batches of 2) and their one-process reference run, trained once for the
    module in this process."""
    root = tmp_path_factory.mktemp("bert")
    argv = [*bert_run_args(root), "--micro-batch-size", "2"]
    proc = rapidlite_captured(*argv, "--save", str(root / "single"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return argv, root / "single"


@pytest.mark.parametrize("layout", ["tp2", "tp2_dp2_fsdp"])
def test_hugging_face_bert_tensor_parallel_trains_like_one_process(bert, tmp_path, layout):
    """BertForPreTraining (masked LM + next sentence): its own loss, on the gathered decoder logits. Its loss
    is a mean per micro-batch, so every layout and the one-process run use the same micro-batches (of 2)."""
    argv, single = bert
    layouts = {"tp2": ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]}
    layouts["tp2_dp2_fsdp"] = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "2"]
    layouts["tp2_dp2_fsdp"] += ["--zero-3-memory-optimization"]
    saves = {"single": single, layout: tmp_path / layout}
    proc = rapidlite(*argv, *layouts[layout], "--save", str(saves[layout]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(train_losses(saves[layout])) == 5
    assert_close_lists(train_losses(saves[layout]), train_losses(saves["single"]), rtol=1e-5)
    assert_close_lists(train_losses(saves[layout], "grad_norm"), train_losses(saves["single"], "grad_norm"), rtol=1e-5)
    expected = read_model_tensors(saves["single"] / "iter_0000005")
    actual = read_model_tensors(saves[layout] / "iter_0000005")
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


COUNT_COLLECTIVES = """
import json, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed._functional_collectives as funcol


def model(family, layers):
    import transformers
    from rapidlite.models.gpt import GPTConfig, GPTModel

    torch.manual_seed(0)
    if family.startswith("gpt"):
        return GPTModel(GPTConfig(vocab_size=96, num_layers=layers, hidden_size=32, num_attention_heads=4,
                                  seq_length=16, swiglu=family == "gpt-swiglu"))
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16))
    return transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=16))


def run(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from rapidlite.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
    mesh, counts, original = init_device_mesh("cpu", (2,)), {}, funcol.all_reduce

    def counted(*args, **kwargs):
        counts[phase] += 1
        return original(*args, **kwargs)

    funcol.all_reduce = counted
    found = {}
    for family in ("gpt", "gpt-swiglu", "llama", "bert"):
        for layers in (1, 2):
            m = apply_tensor_parallel(model(family, layers), mesh, sequence_parallel=False)
            counts = {"forward": 0, "backward": 0}
            phase = "forward"
            out = m(torch.randint(0, 96, (2, 16)))
            logits = out if torch.is_tensor(out) else out[0]
            phase = "backward"
            (logits.to_local() if hasattr(logits, "to_local") else logits).float().sum().backward()
            found[f"{family}-{layers}"] = counts
    if rank == 0:
        print(json.dumps(found))
    dist.destroy_process_group()


mp.start_processes(run, nprocs=2, start_method="fork")
"""


def test_a_tensor_parallel_block_all_reduces_twice_forward_and_twice_backward(tmp_path):
    """Megatron's layout: a block's attention and MLP each all-reduce their output in the forward pass and
    their input's gradient in the backward, once each. The q, k and v projections (gate and up with SwiGLU)
    read one shared input, so their gradients are summed before that one all-reduce, not reduced one by one;
    the step-time model counts four per block."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", COUNT_COLLECTIVES, str(tmp_path / "store")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    for family in ("gpt", "gpt-swiglu", "llama", "bert"):
        one, two = found[f"{family}-1"], found[f"{family}-2"]
        per_block = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
        assert per_block == {"forward": 2, "backward": 2}, (family, one, two)
