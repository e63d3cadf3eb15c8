"""``rapidlite export DIR``: a run's checkpoint as a Hugging Face model (merged, or the LoRA adapter alone) or a
GGUF file (LLaMA, GPT-2, the built-in GPT in their layouts), each read back before it is kept; what it refuses."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_causal_lm_families import added_tokens_llama, run, save_llama, tokenizer

from helpers import rapidlite, rapidlite_here
from rapidlite.checkpoint.dcp import read_model_tensors

gguf = pytest.importorskip("gguf", reason="the [export] extra is not installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-iteration causal_lm runs of a tiny LLaMA (GQA) with LoRA, and of a tiny GPT-2 trained in full."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("runs")
    tok = tokenizer()
    llama = save_llama(root / "llama", tok)
    gpt2 = root / "gpt2"
    tok.save_pretrained(gpt2)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    assert run(llama, root / "d.jsonl", root / "lora", "--lora-rank", "4", "--lr", "1e-2") == 0
    assert run(gpt2, root / "d.jsonl", root / "gpt2-run", "--lr", "1e-2") == 0
    return {"llama": llama, "lora": root / "lora", "gpt2": root / "gpt2-run"}


def export(run_dir, out, *flags) -> int:
    return rapidlite_here("export", str(run_dir), "--out", str(out), *flags)


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def llama_with_the_runs_adapter(runs):
    """The run's model as the run itself exported it (DIR/hf/adapter on the pretrained base), not as export
    rebuilds it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(runs["llama"])
    return PeftModel.from_pretrained(base, runs["lora"] / "hf" / "adapter").eval()


PROBE = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits_of(model):
    return model(PROBE).logits


def test_hf_merged_export_of_a_lora_run_has_the_runs_logits(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert export(runs["lora"], tmp_path / "out", "--merged") == 0
    printed = capsys.readouterr().out
    assert "hf round trip: the merged model: max |logit difference|" in printed
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    expected = logits_of(llama_with_the_runs_adapter(runs))
    assert torch.allclose(logits_of(merged), expected, atol=1e-5, rtol=0)
    # The adapter moved the model: the merged weights are not the base's.
    base = AutoModelForCausalLM.from_pretrained(runs["llama"]).eval()
    assert (logits_of(base) - expected).abs().max() > 1e-3
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".tmp_*"))


def test_adapter_export_loads_with_peft_and_holds_the_checkpoints_adapters(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert export(runs["lora"], tmp_path / "out", "--adapter", "--dtype", "fp16") == 0
    assert not (tmp_path / "out" / "config.json").exists()  # the adapter alone
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    trained = read_model_tensors(next(runs["lora"].glob("iter_*")))
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float16}
    for name, value in adapter.items():
        assert torch.equal(value, trained[name.replace(".weight", ".default.weight")].half()), name
    base = AutoModelForCausalLM.from_pretrained(runs["llama"])
    loaded = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").float().eval()
    expected = logits_of(llama_with_the_runs_adapter(runs))
    assert torch.allclose(logits_of(loaded), expected, atol=1e-2, rtol=0)


def inverse_rope_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows back to Hugging Face's halves, written out independently."""
    rows = weight.shape[0] // heads
    out = np.empty_like(weight)
    for h in range(heads):
        block = weight[h * rows : (h + 1) * rows]
        out[h * rows : h * rows + rows // 2] = block[0::2]
        out[h * rows + rows // 2 : (h + 1) * rows] = block[1::2]
    return out


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gguf_round_trip(runs, tmp_path, capsys, family, gguf_type):
    run_dir = runs["lora" if family == "llama" else "gpt2"]
    assert export(run_dir, tmp_path / "out", "--format", "gguf", "--gguf-type", gguf_type) == 0
    assert f"gguf round trip: {21 if family == 'llama' else 29} tensors read back" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == family
    assert fields[f"{family}.block_count"] == 2 and fields[f"{family}.embedding_length"] == 32
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == 300
    assert fields["tokenizer.ggml.merges"] and fields["tokenizer.ggml.eos_token_id"] == 1
    tensors = {t.name: t for t in reader.tensors}
    stored = {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2}
    assert stored == {gguf_type.upper()}
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 1} == {"F32"}  # norms, biases
    if gguf_type != "f32":
        return
    weights = read_model_tensors(next(run_dir.glob("iter_*")))
    if family == "llama":
        assert fields["llama.attention.head_count_kv"] == 2 and fields["llama.rope.dimension_count"] == 8
        # The q/k rows in llama.cpp's rotary order: undone, they are the merged model's.
        merged = llama_with_the_runs_adapter(runs).merge_and_unload().state_dict()
        for name, heads in (("q", 4), ("k", 2)):
            got = inverse_rope_permute(tensors[f"blk.1.attn_{name}.weight"].data, heads)
            assert np.array_equal(got, merged[f"model.layers.1.self_attn.{name}_proj.weight"].numpy()), name
        assert np.array_equal(tensors["token_embd.weight"].data, merged["model.embed_tokens.weight"].numpy())
    else:  # Conv1D [in, out] → [out, in]; the tied output written as the embedding
        qkv = weights["transformer.h.0.attn.c_attn.weight"].numpy()
        assert np.array_equal(tensors["blk.0.attn_qkv.weight"].data, qkv.T)
        assert np.array_equal(tensors["output.weight"].data, tensors["token_embd.weight"].data)


def test_a_gguf_tensor_written_wrong_fails_the_check_with_exit_1(runs, tmp_path, capsys, monkeypatch):
    add_tensor = gguf.GGUFWriter.add_tensor

    def perturbed(self, name, tensor, *args, **kwargs):
        if name == "blk.1.attn_k.weight":
            tensor = tensor.copy()
            tensor.flat[5] += np.float16(0.25)
        return add_tensor(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", perturbed)
    out = tmp_path / "out"
    assert export(runs["lora"], out, "--format", "gguf", "--gguf-type", "f16") == 1
    line = one_error_line(capsys)
    assert "tensor blk.1.attn_k.weight (f16) differs from the source by 0.2" in line
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing kept, no temporary left


def test_hf_logits_that_differ_fail_the_check_with_exit_1(runs, tmp_path, capsys, monkeypatch):
    from rapidlite.cli import export as export_command

    reload = export_command.reload_hf

    def perturbed(directory):
        model = reload(directory)
        with torch.no_grad():
            model.lm_head.weight[7] += 1.0
        return model

    monkeypatch.setattr(export_command, "reload_hf", perturbed)
    assert export(runs["gpt2"], tmp_path / "out") == 1
    assert "hf round trip: the model: max |logit difference|" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_the_built_in_gpt_exports_in_its_hugging_face_layout_or_is_refused(tmp_path):
    from rapidlite.checkpoint.gguf_file import ExportCheckFailed, SourceTensor, check_gguf, source_tensors
    from rapidlite.cli.export import export_gguf_checked
    from rapidlite.errors import ConfigError
    from rapidlite.models import gpt_hf
    from rapidlite.models.gpt import GPTConfig, GPTModel

    args = argparse.Namespace(adapter=False, gguf_type="f32")
    llama_like = GPTModel(GPTConfig(vocab_size=100, num_layers=2, hidden_size=32, num_attention_heads=4,
                                    normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                                    bias=False, seq_length=32))  # fmt: skip
    lines = export_gguf_checked(llama_like, None, tmp_path / "a", args, "gpt")
    assert lines[0].startswith("no tokenizer") and "gguf round trip:" in lines[1]
    assert gguf.GGUFReader(str(tmp_path / "a" / "model.gguf")).fields["general.architecture"].contents() == "llama"
    odd = GPTModel(GPTConfig(vocab_size=100, num_layers=1, hidden_size=32, num_attention_heads=4,
                             normalization="RMSNorm", seq_length=32))  # fmt: skip
    with pytest.raises(ConfigError, match="supports the LLaMA family .* and GPT-2"):
        export_gguf_checked(odd, None, tmp_path / "b", args, "gpt")
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                   num_attention_heads=4, word_embed_proj_dim=32))  # fmt: skip
    with pytest.raises(ConfigError, match="this run's model is OPTForCausalLM"):
        export_gguf_checked(opt, None, tmp_path / "c", args, "opt")
    # The check reads what was written: a tensor the file lacks is named.
    written = source_tensors(gpt_hf.hf_model(llama_like), "f32")
    extra = SourceTensor("blk.9.attn_q.weight", written[1].data, "f32")
    with pytest.raises(ExportCheckFailed, match=r"lacks tensors \['blk.9.attn_q.weight'\]"):
        check_gguf(tmp_path / "a" / "model.gguf", [*written, extra])


def test_a_built_in_gpt_run_exports_as_gpt2_for_transformers_and_llama_cpp(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from rapidlite.models.gpt import GPTModel

    save = tmp_path / "gpt"
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
    assert rapidlite_here("--task", "pretraining", "--demo", "--train-iters", "2", *tiny, "--save", str(save)) == 0
    assert export(save, tmp_path / "hf") == 0
    assert export(save, tmp_path / "gguf", "--format", "gguf", "--gguf-type", "f32") == 0
    printed = capsys.readouterr().out
    assert "hf round trip: the model:" in printed and "gguf round trip:" in printed
    trained = GPTModel.from_pretrained(save / "hf").eval()  # the run's own export, in its own class
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, trained(ids), atol=1e-5, rtol=0)
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model.gguf"))
    assert reader.fields["general.architecture"].contents() == "gpt2"
    assert reader.fields["gpt2.context_length"].contents() == 32
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == trained.output.weight.shape[0] and tokens[-1].startswith("[PAD")  # the padded vocabulary


def test_embeddings_the_run_grew_for_added_tokens_are_exported_grown(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    tok, model, data = added_tokens_llama(tmp_path)
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model), "--data-path", str(data),
            "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1", "--seq-length", "64",
            "--chat-template", "chatml", "--save", str(tmp_path / "run")]  # fmt: skip
    assert rapidlite_here(*argv) == 0
    assert export(tmp_path / "run", tmp_path / "out") == 0
    assert "the run grew the embeddings to 302 rows" in capsys.readouterr().out
    grown = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert grown.get_input_embeddings().num_embeddings == 302


def test_bad_input_is_one_line_exit_2_and_damages_nothing(runs, tmp_path, capsys, monkeypatch):
    import sys

    assert export(tmp_path, tmp_path / "o") == 2
    assert "not a rapidlite checkpoint" in one_error_line(capsys)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert export(runs["lora"], taken) == 2
    assert "exists and is not empty; give --overwrite" in one_error_line(capsys)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    checkpoint = next(runs["lora"].glob("iter_*"))
    before = sorted(p.name for p in checkpoint.iterdir())
    for inside in (checkpoint / "x", runs["lora"], runs["lora"].parent):
        assert export(runs["lora"], inside, "--overwrite") == 2
        assert "lies in or over the run's checkpoints" in one_error_line(capsys)
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    assert export(runs["gpt2"], tmp_path / "o", "--adapter") == 2
    assert "--adapter: the run trained no LoRA adapters" in one_error_line(capsys)
    assert export(runs["lora"], tmp_path / "o", "--format", "gguf", "--dtype", "fp16") == 2
    assert "--dtype is for --format hf" in one_error_line(capsys)
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    assert export(runs["lora"], tmp_path / "o", "--format", "gguf") == 2
    assert "needs the gguf package: pip install 'rapidlite[export]'" in one_error_line(capsys)
    assert not (tmp_path / "o").exists()


LAYOUTS = {
    "zero3": ["--micro-batch-size", "2", "--zero-3-memory-optimization"],
    "tp2": ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"],  # one replica: 2 micro-batches
    "deepspeed": ["--micro-batch-size", "2", "--deepspeed", "--zero-2-memory-optimization"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=[pytest.mark.deepspeed] if n == "deepspeed" else []) for n in LAYOUTS]
)
def test_a_two_rank_checkpoint_exports_the_weights_one_process_trains(runs, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    if layout == "deepspeed":
        pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")

    common = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(runs["llama"]),
              "--data-path", str(runs["lora"].parent / "d.jsonl"), "--global-batch-size", "4", "--train-iters", "2",
              "--seq-length", "48", "--split", "80,20", "--lr", "1e-2"]  # fmt: skip
    two = rapidlite(*common, *LAYOUTS[layout], "--nproc-per-node", "2", "--save", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert rapidlite_here(*common, "--micro-batch-size", "4", "--save", str(tmp_path / "one")) == 0
    for name in ("one", "two"):
        assert export(tmp_path / name, tmp_path / f"{name}-out") == 0
    exported = {n: load_file(tmp_path / f"{n}-out" / "model.safetensors") for n in ("one", "two")}
    sharded = read_model_tensors(next((tmp_path / "two").glob("iter_*")))
    the_runs_own = load_file(tmp_path / "two" / "hf" / "model.safetensors")
    assert exported["two"].keys() == the_runs_own.keys()
    for key, value in exported["two"].items():
        assert torch.equal(value, sharded[key]) and torch.equal(value, the_runs_own[key]), key
        assert torch.allclose(value, exported["one"][key], atol=1e-5, rtol=1e-4), key
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two-out")
    assert model.config.num_key_value_heads == 2


def test_a_sentencepiece_style_byte_fallback_tokenizer_is_written_as_llamas_vocabulary(tmp_path):
    """A BPE with byte fallback (LLaMA's SentencePiece tokenizer, here built with ``tokenizers``): llama.cpp's
    "llama" vocabulary, its 256 byte tokens typed BYTE, one score a token (rank order), the merges and the
    special ids; a character outside the vocabulary encodes to those byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rapidlite.checkpoint.gguf_file import write_gguf

    specials = ["<unk>", "<s>", "</s>"]
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab"]
    tokens = [*specials, *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b")]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok.convert_ids_to_tokens(tok("é", add_special_tokens=False).input_ids)[-2:] == ["<0xC3>", "<0xA9>"]

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    _, note = write_gguf(LlamaForCausalLM(config), tok, tmp_path / "model.gguf", "f32", "byte-fallback")
    assert note is None
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.tokens"] == tokens
    types = fields["tokenizer.ggml.token_type"]
    byte, control = int(gguf.TokenType.BYTE), int(gguf.TokenType.CONTROL)
    assert [i for i, t in enumerate(types) if t == byte] == list(range(3, 259))
    assert types[1] == types[2] == control and types[-1] == int(gguf.TokenType.NORMAL)
    assert fields["tokenizer.ggml.scores"] == [-float(i) for i in range(len(tokens))]
    assert fields["tokenizer.ggml.merges"] == ["▁ a", "a b", "▁a b"]
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert fields["tokenizer.ggml.unknown_token_id"] == 0
