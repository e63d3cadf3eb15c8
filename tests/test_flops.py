"""Model FLOPs per token, device peaks, the measured matmul peak, and TFLOP/s + MFU in the training logs."""

import pytest
import torch

from helpers import TINY, rapidlite_captured, read_metrics, write_tiny_corpus
from rapidlite.cli.bench import bench_main
from rapidlite.models.flops import ModelFlops, device_peak_flops, matmul_parameters, measure_matmul_peak
from rapidlite.models.gpt import GPTConfig, GPTModel


def unique_numel(params):
    return sum({id(p): p.numel() for p in params}.values())


def test_gpt2_counts_the_tied_output_layer_once_and_no_position_table():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=100)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    total = unique_numel(model.parameters())
    assert matmul_parameters(model) == total - model.transformer.wpe.weight.numel()
    flops = ModelFlops.of(model)
    assert (flops.num_layers, flops.hidden_size) == (2, 64)
    assert flops.per_token(32) == 6 * (total - 32 * 64) + 12 * 2 * 64 * 32


def test_llama_untied_embedding_table_is_not_a_matmul():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100
    )
    model = LlamaForCausalLM(config)
    total = unique_numel(model.parameters())
    assert matmul_parameters(model) == total - model.model.embed_tokens.weight.numel()
    assert ModelFlops.of(model).per_token(16) == 6 * matmul_parameters(model) + 12 * 2 * 64 * 16


def test_bert_tables_excluded_mlm_decoder_counted():
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    model = BertForPreTraining(config)
    emb = model.bert.embeddings
    tables = emb.position_embeddings.weight.numel() + emb.token_type_embeddings.weight.numel()
    assert matmul_parameters(model) == unique_numel(model.parameters()) - tables
    assert ModelFlops.of(model).num_layers == 2


def test_builtin_gpt_tied_and_untied():
    config = GPTConfig(vocab_size=128, num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
    tied = GPTModel(config)
    untied = GPTModel(GPTConfig(**{**config.__dict__, "untie_embeddings_and_output_weights": True}))
    # Without the word and position tables; the output layer is a matmul whether tied or not.
    assert matmul_parameters(tied) == tied.num_parameters(exclude_embeddings=True) + tied.output.weight.numel()
    assert matmul_parameters(untied) == untied.num_parameters(exclude_embeddings=True)
    assert matmul_parameters(tied) == matmul_parameters(untied)
    assert tied.flops_per_token() == 6 * matmul_parameters(tied) + 12 * 2 * 64 * 16


def test_a_model_without_a_transformer_config_gets_6n():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    flops = ModelFlops.of(model)
    assert flops.per_token(100) == 6 * (4 * 3 + 3)
    assert flops.describe().startswith("6 N (")


def test_known_gpu_peaks_by_name_and_precision(monkeypatch):
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) is None
    cuda = torch.device("cuda", 0)
    for name, half, fp32 in (
        ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12),
        ("NVIDIA A10", 125e12, 31.2e12),
        ("NVIDIA H100 PCIe", 756e12, 51e12),
        ("NVIDIA H100 80GB HBM3", 989e12, 67e12),
        ("NVIDIA L40S", 362e12, 91.6e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_peak_flops(cuda, torch.bfloat16) == half
        assert device_peak_flops(cuda, None) == fp32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert device_peak_flops(cuda, torch.float16) is None


def test_measured_peak_and_the_bench_command(capsys):
    flops, size = measure_matmul_peak(torch.float32, sizes=(64, 128), repeats=2)
    assert flops > 1e6 and size in (64, 128)
    assert bench_main(["peak", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "fp32" in out and "bf16" in out and "--peak-flops" in out
    assert bench_main([]) == 2 and bench_main(["nonsense"]) == 2


@pytest.mark.slow
def test_training_logs_tflops_and_mfu(tmp_path):
    """The logged TFLOP/s per device is the formula times the logged tokens/s, and MFU is it over
    --peak-flops; without a peak on CPU there is TFLOP/s but no MFU."""
    prefix = tmp_path / "tiny_text_document"
    write_tiny_corpus(prefix)
    base = ["--task", "pretraining", "--data-path", str(prefix), *TINY, "--train-iters", "3", "--eval-interval", "3"]
    peak = 2.5e11
    proc = rapidlite_captured(*base, "--save", str(tmp_path / "a"), "--peak-flops", str(peak))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model FLOPs per token: 6 N + 12 L d T" in proc.stdout
    records = [r for r in read_metrics(tmp_path / "a") if "split" not in r]
    model = GPTModel(GPTConfig(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32))
    for r in records:
        expected = model.flops_per_token() * r["tokens_per_s"] / 1e12
        assert r["tflops_per_device"] == pytest.approx(expected, rel=1e-3)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] * 1e12 / peak, rel=1e-6)
    proc = rapidlite_captured(*base, "--save", str(tmp_path / "b"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = [r for r in read_metrics(tmp_path / "b") if "split" not in r][-1]
    assert record["tflops_per_device"] > 0 and "mfu" not in record
    assert "pass --peak-flops for MFU" in proc.stdout


def test_peak_flops_must_be_positive():
    proc = rapidlite_captured("--task", "pretraining", "--peak-flops", "0")
    assert proc.returncode == 2 and "--peak-flops 0.0: must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr
