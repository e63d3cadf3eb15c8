"""Graph optimisation: ``--torch-compile`` trains the eager model's numbers, composes with activation
checkpointing and bf16, and ``--onnx-runtime-training`` falls back to it in one line where ORTModule cannot
run (here: it is not installed; on torch 2.13 it fails to import anyway)."""

import pytest

from helpers import assert_close_lists, rapidlite, read_metrics, train_losses, write_tiny_corpus
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.graph import ort_import_error

pytestmark = pytest.mark.slow

ARGS = ["--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2"]
ARGS += ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0"]
ARGS += ["--attention-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3"]
ARGS += ["--log-interval", "1", "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("compile_data") / "tiny_text_document"
    write_tiny_corpus(prefix)
    return ["--data-path", str(prefix)]


@pytest.fixture(scope="module")
def eager(data, tmp_path_factory):
    save = tmp_path_factory.mktemp("eager") / "run"
    proc = rapidlite(*ARGS, *data, "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


def test_torch_compile_trains_the_eager_numbers(data, eager, tmp_path):
    save = tmp_path / "compiled"
    proc = rapidlite(*ARGS, *data, "--torch-compile", "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "torch.compile: 2 modules" in out and "the first step took" in out
    assert_close_lists(train_losses(save), train_losses(eager), rtol=1e-4)
    # Blocks are compiled in place: the checkpoint has the eager model's names and (nearly) its values.
    expected, actual = read_model_tensors(eager / "iter_0000004"), read_model_tensors(save / "iter_0000004")
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-3, k


def test_torch_compile_composes_with_recompute_and_bf16(data, eager, tmp_path):
    argv = [*ARGS, *data, "--torch-compile", "--checkpoint-activations", "--bf16", "--save", str(tmp_path)]
    proc = rapidlite(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(tmp_path), train_losses(eager), rtol=2e-2)  # bf16 tolerance


@pytest.mark.skipif(ort_import_error() is None, reason="ONNX Runtime training works here: no fallback to see")
def test_onnx_runtime_training_falls_back_to_torch_compile_in_one_line(data, eager, tmp_path):
    proc = rapidlite(*ARGS, *data, "--onnx-runtime-training", "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    notices = [line for line in out.splitlines() if "--onnx-runtime-training:" in line]
    assert len(notices) == 1 and "using torch.compile" in notices[0], out
    assert "torch.compile: 2 modules" in out
    assert_close_lists(train_losses(tmp_path), train_losses(eager), rtol=1e-4)
    assert read_metrics(tmp_path)


def test_compiled_blocks_shard_with_fsdp_on_two_ranks(data, eager, tmp_path):
    argv = [*ARGS, *data, "--torch-compile", "--nproc-per-node", "2", "--micro-batch-size", "2"]
    proc = rapidlite(*argv, "--zero-2-memory-optimization", "--save", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(tmp_path), train_losses(eager), rtol=1e-4)


def test_hf_blocks_compile_once_without_a_kv_cache(tmp_path):
    """A Hugging Face model trains without its key/value cache: with it, every compiled block guards on its
    own cache layer and recompiles, and past dynamo's limit of 8 the deeper blocks would run eagerly. The
    exported config keeps the user's use_cache."""
    import json

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import engine
    from rapidlite.checkpoint.export import export_hf

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = GPT2Config(n_layer=10, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=None)
    assert config.use_cache
    model = GPT2LMHeadModel(config)
    eng = engine("--torch-compile", "--micro-batch-size", "2", "--train-iters", "2")
    model, optimizer, _ = eng.compose(model)
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert model.config.use_cache is False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2, dict(torch._dynamo.utils.counters["stats"])
    export_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False
