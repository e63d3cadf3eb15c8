"""``--task causal_lm`` beyond the demo's LLaMA: tiny models of other decoder families (GPT-2, Falcon, OPT, Phi-3)
and tokenizers that lack a pad, BOS or EOS token or hold more tokens than the model's embeddings."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers import rapidlite_here, read_metrics
from rapidlite.config.sections import LoraConfig
from rapidlite.errors import ConfigError
from rapidlite.evaluation.scoring import CausalLMScorer, load_scorer, text_windows
from rapidlite.models import lora
from rapidlite.tasks.causal_lm import choose_pad, honours_packed_positions

TEXTS = ["red fox moon sun tree river", "cat dog blue green house", "reverse: red fox -> fox red"] * 20
SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def tokenizer(specials=("<s>", "</s>", "<pad>"), bos="<s>", eos="</s>", pad="<pad>"):
    """A byte-level BPE tokenizer of about 300 tokens with the given special tokens (None: the tokenizer has none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), initial_alphabet=alphabet)
    )
    named = {k: v for k, v in {"bos_token": bos, "eos_token": eos, "pad_token": pad}.items() if v}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named)


def save_llama(directory, tok, vocab_size=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok.save_pretrained(directory)
    config = LlamaConfig(vocab_size=vocab_size or len(tok), intermediate_size=64, num_key_value_heads=2, **SIZES)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def run(model_dir, data, save, *extra):
    rows = [{"prompt": f"reverse: {t} ->", "completion": " " + " ".join(reversed(t.split()))} for t in TEXTS[:16]]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rapidlite_here(
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data),
        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2", "--seq-length", "48",
        "--split", "80,20", "--save", str(save), *extra,
    )  # fmt: skip


def test_the_pad_token_is_one_the_model_has():
    log = logging.getLogger("test")
    tok = tokenizer()
    assert choose_pad(tok, 300, log) == tok.pad_token_id  # its own pad, inside the vocabulary
    # A tokenizer class that adds a pad token past the model's vocabulary (Qwen2's in transformers 5) pads with EOS.
    assert choose_pad(tok, tok.pad_token_id, log) == tok.eos_token_id and tok.pad_token == "</s>"
    bare = tokenizer(specials=("<x>",), bos=None, eos=None, pad=None)
    assert choose_pad(bare, 300, log) == 0 and bare.pad_token is None  # no special token at all: any id is masked
    bos_only = tokenizer(specials=("<s>",), eos=None, pad=None)
    assert choose_pad(bos_only, 300, log) == bos_only.bos_token_id


def test_a_tokenizer_without_pad_bos_or_eos_trains_and_exports(tmp_path):
    model = save_llama(tmp_path / "m", tokenizer(specials=("<x>",), bos=None, eos=None, pad=None))
    assert run(model, tmp_path / "d.jsonl", tmp_path / "out") == 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path / "out") if "loss" in r)


def added_tokens_llama(tmp_path):
    """A tiny LLaMA whose tokenizer gained ChatML's two special tokens (its embeddings did not), and chat rows."""
    tok = tokenizer()
    model = save_llama(tmp_path / "m", tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(model)
    chat = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]} for t in TEXTS]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat))
    return tok, model, data


def test_added_tokens_grow_the_embeddings_and_adapters_refuse_them(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    tok, model, data = added_tokens_llama(tmp_path)
    common = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(model), "--data-path", str(data),
              "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1", "--seq-length", "64",
              "--chat-template", "chatml"]  # fmt: skip
    assert rapidlite_here(*common, "--save", str(tmp_path / "out")) == 0
    grown = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    assert grown.get_input_embeddings().num_embeddings == len(tok) == 302
    capsys.readouterr()
    assert rapidlite_here(*common, "--lora-rank", "4", "--save", str(tmp_path / "lora")) == 2
    err = capsys.readouterr().err.strip()
    assert "--lora-rank: the data has token id 301 but the model's embeddings end at 299" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "lora").exists()


def test_phi3_default_lora_targets_include_its_fused_projections():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=64, intermediate_size=64, num_key_value_heads=2, pad_token_id=0, **SIZES)
    model = Phi3ForCausalLM(config)
    chosen = {name.rsplit(".", 1)[-1] for name in lora.target_modules(model, LoraConfig(lora_rank=4))}
    assert chosen == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_the_packing_probe_answers_for_a_head_that_bypasses_its_base_model():
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    # OPT's head calls its decoder, not its base model: no hidden state reaches the probe's hook.
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, ffn_dim=64, word_embed_proj_dim=32, **SIZES))
    assert honours_packed_positions(opt) in (True, False)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, intermediate_size=64, **SIZES))
    assert honours_packed_positions(llama)


def test_linear_subclasses_are_quantised_and_a_model_with_none_is_refused():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import FalconConfig, FalconForCausalLM

    settings = LoraConfig(lora_rank=4, load_in_4bit=True)
    # Falcon's FalconLinear subclasses nn.Linear; transformers' quantisation on load leaves it full precision.
    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, **SIZES))
    peft_model = lora.prepare(falcon, settings, torch.float32, torch.device("cpu"))
    quantized = [m for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 8 and type(peft_model.get_base_model().lm_head) is torch.nn.Linear
    head_only = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    with pytest.raises(ConfigError, match="--load-in-4bit: Sequential has no linear layer to quantise"):
        lora.prepare(head_only, settings, torch.float32, torch.device("cpu"))


def test_gpt2_4bit_merged_export_loads_with_its_conv1d_layout(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from rapidlite.checkpoint.export import export_hf

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    settings = LoraConfig(lora_rank=4, load_in_4bit=True)
    kwargs = lora.load_kwargs(settings, torch.float32, torch.device("cpu"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", **kwargs)  # Conv1D layers become [out, in]
    model = lora.prepare(base, settings, torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # a trained adapter's delta
    export_hf(model, tmp_path / "hf", merge_adapters=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_perplexity_without_bos_or_eos_conditions_on_the_first_token():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer(specials=("<x>",), bos=None, eos=None, pad=None)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), intermediate_size=64, **SIZES))
    scorer = CausalLMScorer(model, tok, max_length=4)
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    windows = text_windows(scorer, TEXTS[0])
    assert [t for _, cont in windows for t in cont] == ids[1:] and windows[0][0] == ids[:1]
    cont = tok.encode(" red fox", add_special_tokens=False)
    assert scorer.encode_pair("", " red fox") == (cont[:1], cont[1:])  # an empty context: the first token


def test_a_lora_runs_adapter_export_evaluates_and_trains_on_its_base(tmp_path):
    model = save_llama(tmp_path / "m", tokenizer())
    assert run(model, tmp_path / "d.jsonl", tmp_path / "lora", "--lora-rank", "4") == 0
    trained = [r for r in read_metrics(tmp_path / "lora") if r.get("split") == "validation"][-1]
    assert sorted(p.name for p in (tmp_path / "lora" / "hf").iterdir()) == ["adapter"]  # no --merge-lora
    # DIR/hf names the adapter: its base comes from adapter_config.json, the tokenizer from beside the adapter.
    assert run(tmp_path / "lora" / "hf", tmp_path / "d.jsonl", tmp_path / "eval", "--eval-only") == 0
    evaluated = [r for r in read_metrics(tmp_path / "eval") if r.get("split") == "validation"][-1]
    assert evaluated["eval_only"] and evaluated["loss"] == pytest.approx(trained["loss"], rel=1e-6)
    # rapidlite-eval scores it too, with the adapter applied.
    scorer = load_scorer(str(tmp_path / "lora" / "hf"))
    assert any("lora_A" in name for name, _ in scorer.model.named_parameters())
    adapter = tmp_path / "lora" / "hf" / "adapter"
    assert run(adapter, tmp_path / "d.jsonl", tmp_path / "more", "--lora-rank", "4", "--merge-lora") == 0
    assert (tmp_path / "more" / "hf" / "model.safetensors").is_file()


def test_the_sequence_length_stays_within_a_learned_position_table(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

    from rapidlite.tasks.causal_lm import causal_seq_length

    gpt2 = GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0, eos_token_id=1)
    assert causal_seq_length(None, gpt2, explicit=False) == 40 and causal_seq_length(32, gpt2) == 32
    with pytest.raises(ConfigError, match="--seq-length 512: the model's learned positions end at 40 tokens"):
        causal_seq_length(512, gpt2)
    assert causal_seq_length(None, LlamaConfig(max_position_embeddings=64), explicit=False) == 512  # rotary
    tok = tokenizer()
    tok.save_pretrained(tmp_path / "gpt2")
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(TEXTS[i : i + 8])}) + "\n" for i in range(20)))
    flags = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(tmp_path / "gpt2"), "--data-path",
             str(data), "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1"]  # fmt: skip
    assert rapidlite_here(*flags, "--save", str(tmp_path / "out")) == 0  # 512 by default: lowered to 40
    captured = capsys.readouterr()
    assert "0 truncated to --seq-length 40, 20 texts split into windows of it" in captured.out + captured.err
