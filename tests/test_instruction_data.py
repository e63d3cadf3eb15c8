"""Causal-LM fine-tuning data: formats are detected, prompts are masked so exactly the response (and EOS)
trains, chats train their assistant turns, and packed rows give the same per-token loss as unpacked ones."""

from __future__ import annotations

import json

import pytest
import torch

from rapidlite.data import instruction as ins
from rapidlite.data import packing
from rapidlite.errors import DataError

TEXTS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs", "sort: b a c"] * 30


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    out = tmp_path_factory.mktemp("bpe")
    return GPT2BPETokenizer(*train_byte_level_bpe(TEXTS, 400, out)).hf_tokenizer()


@pytest.mark.parametrize(
    ("columns", "keys", "kind", "pair"),
    [
        (["instruction", "input", "output"], (None, None), "alpaca", ("instruction", "output")),
        (["instruction", "output"], (None, None), "alpaca", ("instruction", "output")),
        (["instruction", "context", "response", "category"], (None, None), "alpaca", ("instruction", "response")),
        (["prompt", "completion"], (None, None), "prompt_response", ("prompt", "completion")),
        (["question", "answer", "id"], (None, None), "prompt_response", ("question", "answer")),
        (["q", "a"], ("q", "a"), "prompt_response", ("q", "a")),
        (["messages"], (None, None), "chat", ("messages", None)),
        (["text", "meta"], (None, None), "text", (None, None)),
    ],
)
def test_formats_are_detected(columns, keys, kind, pair):
    fmt = ins.detect_format(columns, *keys)
    assert (fmt.kind, fmt.prompt_key, fmt.response_key) == (kind, *pair)


def test_dolly_rows_read_as_alpaca_with_context_as_input(tok):
    dolly = {"instruction": "sort", "context": "b a c", "response": "a b c", "category": "closed_qa"}
    alpaca = {"instruction": "sort", "input": "b a c", "output": "a b c"}
    dolly_fmt, alpaca_fmt = ins.detect_format(list(dolly)), ins.detect_format(list(alpaca))
    assert dolly_fmt.input_key == "context" and alpaca_fmt.input_key == "input"
    assert ins.render(dolly, dolly_fmt, "auto", tok) == ins.render(alpaca, alpaca_fmt, "auto", tok)
    assert "### Input:\nb a c" in ins.render(dolly, dolly_fmt, "auto", tok)[0][0]


def test_unknown_columns_are_one_line_naming_the_formats():
    with pytest.raises(DataError, match=r"columns \(body, title\) are in no known format.*--prompt-key"):
        ins.detect_format(["title", "body"])
    with pytest.raises(DataError, match="no column answer"):
        ins.detect_format(["q", "a"], "q", "answer")


def _trained_text(tok, encoded):
    return tok.decode([t for t in encoded.labels if t != -100])


def test_only_the_response_and_eos_train(tok):
    row = {"instruction": "sort the words", "input": "b a c", "output": "a b c"}
    fmt = ins.detect_format(list(row))
    segments = ins.render(row, fmt, "auto", tok)
    assert segments[0][0] == ins.ALPACA_PROMPT.format(instruction="sort the words", input="b a c")
    enc = ins.encode(segments, tok, seq_length=512)
    assert _trained_text(tok, enc) == "a b c" + tok.eos_token
    assert enc.input_ids[-1] == tok.eos_token_id and not enc.truncated
    everything = ins.encode(segments, tok, seq_length=512, train_on_prompt=True)
    assert everything.labels == everything.input_ids
    cut = ins.encode(segments, tok, seq_length=8)
    assert cut.truncated and len(cut.input_ids) == 8


def test_prompt_templates(tok, tmp_path):
    row = {"prompt": "reverse: x y", "completion": "y x"}
    fmt = ins.detect_format(list(row))
    assert ins.render(row, fmt, "none", tok) == [("reverse: x y", False), ("y x", True)]
    assert (
        ins.render(row, fmt, "chatml", tok)[0][0] == "<|im_start|>user\nreverse: x y<|im_end|>\n<|im_start|>assistant\n"
    )
    template = tmp_path / "t.txt"
    template.write_text("Q: {prompt}\nA: ")
    assert ins.render(row, fmt, ins.load_template(str(template)), tok)[0] == ("Q: reverse: x y\nA: ", False)
    template.write_text("Q: {question}\nA: ")
    with pytest.raises(DataError, match="names 'question'"):
        ins.render(row, fmt, ins.load_template(str(template)), tok)
    with pytest.raises(DataError, match="--prompt-template nope: not one of"):
        ins.load_template("nope")


def test_chats_train_their_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sort: b a c"},
        {"role": "assistant", "content": "a b c"},
        {"role": "user", "content": "reverse it"},
        {"role": "assistant", "content": "c b a"},
    ]
    fmt = ins.detect_format(["messages"])
    with pytest.raises(DataError, match="needs a chat template.*--chat-template chatml"):
        ins.render({"messages": messages}, fmt, "auto", tok)
    ins.set_chat_template(tok, "chatml")
    enc = ins.encode(ins.render({"messages": messages}, fmt, "auto", tok), tok, seq_length=512)
    assert _trained_text(tok, enc) == "a b c<|im_end|>\nc b a<|im_end|>\n" + tok.eos_token
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(messages, tokenize=False) + tok.eos_token


def test_sharegpt_and_openai_part_messages_render_as_role_content(tok):
    ins.set_chat_template(tok, "chatml")
    fmt = ins.detect_format(["conversations"])
    plain = [{"role": "user", "content": "sort: b a c"}, {"role": "assistant", "content": "a b c"}]
    sharegpt = [{"from": "human", "value": "sort: b a c"}, {"from": "gpt", "value": "a b c"}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "sort: "}, {"type": "text", "text": "b a c"}]},
        {"role": "assistant", "content": "a b c"},
    ]
    want = ins.render({"conversations": plain}, fmt, "auto", tok)
    assert want[-1] == ("a b c<|im_end|>\n", True)
    assert ins.render({"conversations": json.dumps(plain)}, fmt, "auto", tok) == want  # a CSV cell's JSON text
    with pytest.raises(DataError, match="messages are text that is not a JSON list"):
        ins.render({"conversations": "user: hi"}, fmt, "auto", tok)
    assert ins.render({"conversations": sharegpt}, fmt, "auto", tok) == want
    assert ins.render({"conversations": parts}, fmt, "auto", tok) == want
    with pytest.raises(DataError, match="a chat message has no role: its keys are text; give each message role"):
        ins.render({"conversations": [{"text": "hi"}]}, fmt, "auto", tok)


@pytest.mark.parametrize("packing", [False, True])
def test_a_long_text_trains_every_token_in_windows(tok, packing):
    import datasets

    text = " ".join(TEXTS[:12])
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [text, "sort: b a c"]})})
    data = ins.build_instruction_data(raw, tok, 16, packing=packing)
    assert data.windowed == 1 and data.truncated == 0 and data.rows == 2
    assert all(len(row["input_ids"]) <= 16 for row in data.train)
    targets = [t for row in data.train for t in (row["labels"] if packing else row["labels"][1:]) if t != -100]
    short = tok("sort: b a c")["input_ids"][1:] + [tok.eos_token_id]
    assert targets == ids[1:] + short  # every token but the text's first is a target once, in order


def test_a_template_that_writes_bos_or_eos_gets_one_of_each(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # adds BOS
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    chat = {"messages": [{"role": "user", "content": "sort: b a c"}, {"role": "assistant", "content": "a b c"}]}
    enc = ins.encode(ins.render(chat, ins.detect_format(["messages"]), "auto", tok), tok, seq_length=64)
    assert enc.input_ids[0] == 0 and enc.input_ids[1] != 0
    assert ins.encode([("sort: b a c", True)], tok, seq_length=64).input_ids[:1] == [0]  # plain text keeps its BOS
    # A template that closes each turn with the EOS token (LLaMA 2's) gets no second one.
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    enc = ins.encode(ins.render(chat, ins.detect_format(["messages"]), "auto", tok), tok, seq_length=64)
    assert enc.input_ids[-2:] != [1, 1] and enc.input_ids[-1] == enc.labels[-1] == 1


def test_a_template_that_refuses_a_conversation_is_one_line(tok):
    saved = tok.chat_template
    tok.chat_template = (  # Gemma's: no system role
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "a b c"}]}
    try:
        with pytest.raises(DataError, match=r"refuses a conversation \(system/assistant\): System role not supported"):
            ins.render(chat, ins.detect_format(["messages"]), "auto", tok)
    finally:
        tok.chat_template = saved


def test_rows_missing_a_field_are_skipped_and_counted(tok):
    import datasets

    rows = {"prompt": ["sort: b a c", "sort: c a", None, "sort: a"], "completion": ["a b c", None, "x", "  "]}
    data = ins.build_instruction_data(datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}), tok, 64)
    assert data.rows == 4 and data.skipped == {"completion": 2, "prompt": 1} and len(data.train) == 1
    alpaca = {"instruction": ["sort: b a c", "sort: c a"], "input": [None, ""], "output": ["a b c", "a c"]}
    data = ins.build_instruction_data(datasets.DatasetDict({"train": datasets.Dataset.from_dict(alpaca)}), tok, 256)
    assert data.skipped == {} and len(data.train) == 2  # an absent input is a row without context
    numbers = {"question": ["2 - 2 =", "1 + 1 ="], "answer": [0, 2]}  # 0 is an answer, not a missing one
    data = ins.build_instruction_data(datasets.DatasetDict({"train": datasets.Dataset.from_dict(numbers)}), tok, 64)
    assert data.skipped == {} and len(data.train) == 2
    assert tok.decode([t for t in data.train[0]["labels"] if t != -100]) == "0" + tok.eos_token
    empty = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [None, ""]})})
    with pytest.raises(DataError, match="every training row lacks its text"):
        ins.build_instruction_data(empty, tok, 64)


def test_packed_rows_give_the_unpacked_per_token_loss(tok):
    """A tiny LLaMA (transformers' packed-sequence masking from restarting position ids) and the built-in
    GPT (the block-diagonal mask): every row's logits in a pack equal the row's logits alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.models.gpt import GPTConfig, GPTModel

    fmt = ins.detect_format(["text"])
    rows = [ins.encode(ins.render({"text": t}, fmt, "auto", tok), tok, 64) for t in TEXTS[:7]]
    packs = packing.pack(rows, seq_length=40)
    assert all(len(p["input_ids"]) <= 40 for p in packs) and len(packs) < len(rows)
    assert sum(len(p["input_ids"]) for p in packs) == sum(len(r.input_ids) for r in rows)
    torch.manual_seed(0)
    vocab = len(tok)
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    ).eval()
    gpt_config = GPTConfig(vocab_size=vocab, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64,
                           position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    gpt = GPTModel(gpt_config).eval()

    def unpacked_loss(forward):
        total, count = 0.0, 0
        for row in rows:
            ids, labels = torch.tensor([row.input_ids]), torch.tensor([row.labels])
            logits = forward(ids, None)
            losses = torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum")
            total, count = total + float(losses), count + int((labels[0, 1:] != -100).sum())
        return total / count

    def packed_loss(forward):
        total, count = 0.0, 0
        for p in packs:
            ids, labels, pos = (torch.tensor([p[k]]) for k in ("input_ids", "labels", "position_ids"))
            logits = forward(ids, pos)
            losses = torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum")
            total, count = total + float(losses), count + int((labels[0, 1:] != -100).sum())
        return total / count

    with torch.no_grad():
        for forward in (
            # Training runs without the key/value cache, which turns transformers' packed-sequence masking off.
            lambda ids, pos: llama(input_ids=ids, position_ids=pos, use_cache=False).logits,
            lambda ids, pos: gpt(ids, pos, None if pos is None else packing.packed_attention_mask(pos)),
        ):
            assert packed_loss(forward) == pytest.approx(unpacked_loss(forward), rel=1e-5)
