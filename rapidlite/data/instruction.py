"""Causal-LM fine-tuning data: rows in the formats people have, turned into token ids whose labels train the
response only, optionally packed into full sequences.

Formats (``detect_format``): Alpaca (``instruction``/``input``/``output``), prompt/response pairs
(``prompt``/``completion``, ``prompt``/``response``, ``question``/``answer``, or the keys given), chat
(``messages`` or ``conversations``: lists of ``{"role", "content"}``, or ShareGPT's ``{"from", "value"}`` with its
``human``/``gpt`` roles, rendered with the tokenizer's chat template) and plain ``text`` (continued pretraining:
every token trains; a text longer than ``seq_length`` becomes consecutive windows, ``windows``).

A row renders to segments of text, each marked as trained or not (``render``); ``encode`` tokenizes their
concatenation once (so tokens across a segment boundary are what the tokenizer makes of the whole text) and
labels a token by the segment its first character falls in, through the fast tokenizer's offsets. The EOS
token closes every row and is trained with the response. Packing (``rapidlite.data.packing``) concatenates
encoded rows into sequences of at most ``seq_length`` tokens with position ids restarting at every row: attention
is kept inside each row by the model's packed-sequence masking (``transformers`` reads restarting position ids with
no attention mask and no key/value cache so; the built-in GPT takes the block-diagonal mask that
``packed_attention_mask`` builds). ``build_instruction_data`` does all of it for every split of a data set, and
``CausalLMCollator`` pads the rows into batches (packed ones without an attention mask).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rapidlite.data.packing import Encoded, pack, windows
from rapidlite.errors import DataError, first_line
from rapidlite.observe.progress import progress_bar

ALPACA, PROMPT_RESPONSE, CHAT, TEXT = "alpaca", "prompt_response", "chat", "text"

# Stanford Alpaca's prompts, word for word: models tuned on them expect exactly these.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
CHATML_PROMPT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = ("auto", "alpaca", "chatml", "none")
_PAIRS = (("prompt", "completion"), ("prompt", "response"), ("question", "answer"), ("input", "output"))


@dataclass(frozen=True)
class RowFormat:
    """Which columns hold what: ``kind`` is one of alpaca, prompt_response, chat, text; an Alpaca row's
    instruction, response (``output``, Dolly's ``response``) and optional input (``input``, Dolly's ``context``)."""

    kind: str
    prompt_key: str | None = None
    response_key: str | None = None
    input_key: str | None = None


def detect_format(columns: Sequence[str], prompt_key: str | None = None, response_key: str | None = None) -> RowFormat:
    """The row format of a data set with ``columns``; ``prompt_key``/``response_key`` (``--prompt-key``,
    ``--response-key``) name a prompt/response pair explicitly."""
    cols = set(columns)
    if prompt_key or response_key:
        missing = [k for k in (prompt_key, response_key) if k and k not in cols]
        if missing or not (prompt_key and response_key):
            raise DataError(
                f"--prompt-key/--response-key: the data has no column {missing[0] if missing else '(both needed)'}; "
                f"its columns are {', '.join(sorted(cols))}"
            )
        return RowFormat(PROMPT_RESPONSE, prompt_key, response_key)
    for key in ("messages", "conversations"):
        if key in cols:
            return RowFormat(CHAT, prompt_key=key)
    for response in ("output", "response"):  # Alpaca's, and Dolly's instruction/context/response
        if {"instruction", response} <= cols:
            extra = next((key for key in ("input", "context") if key in cols), None)
            return RowFormat(ALPACA, "instruction", response, extra)
    for prompt, response in _PAIRS:
        if {prompt, response} <= cols:
            return RowFormat(PROMPT_RESPONSE, prompt, response)
    if "text" in cols:
        return RowFormat(TEXT)
    raise DataError(
        f"the data's columns ({', '.join(sorted(cols))}) are in no known format: give instruction/input/output "
        "(Alpaca; instruction/context/response as Dolly), prompt/completion (or --prompt-key/--response-key), "
        "messages (chat) or text"
    )


def load_template(template: str) -> str:
    """``--prompt-template``: a known name, or a file whose text has ``{instruction}``/``{input}``/``{prompt}``
    (or any column) in braces."""
    if template in TEMPLATES:
        return template
    if not os.path.isfile(template):
        raise DataError(f"--prompt-template {template}: not one of {', '.join(TEMPLATES)} and no such file")
    with open(template, encoding="utf-8") as f:
        return f.read()


def _fill(template: str, row: dict[str, Any], flag: str = "--prompt-template") -> str:
    try:
        return template.format(**{k: "" if v is None else v for k, v in row.items()})
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(f"{flag}: the template names {e}, which the data has no column for") from None


def _text(value: Any) -> str:
    """A field as text: null is empty, a number is its digits (an answer of 0 is "0", not empty)."""
    return "" if value is None else str(value)


def _prompt_text(row: dict[str, Any], fmt: RowFormat, template: str) -> str:
    """The prompt of an Alpaca or prompt/response row under ``template`` (a name or a template's text)."""
    if fmt.kind == ALPACA:
        instruction = _text(row.get(fmt.prompt_key))
        extra = _text(row.get(fmt.input_key)) if fmt.input_key else ""
        if template in ("auto", "alpaca"):
            return (ALPACA_PROMPT if extra else ALPACA_PROMPT_NO_INPUT).format(instruction=instruction, input=extra)
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
    else:
        prompt = _text(row.get(fmt.prompt_key))
    if template in ("auto", "none"):
        return prompt
    if template == "chatml":
        return CHATML_PROMPT.format(prompt=prompt)
    if template == "alpaca":
        return ALPACA_PROMPT_NO_INPUT.format(instruction=prompt)
    return _fill(template, {**row, "prompt": prompt})


def _response_key(fmt: RowFormat) -> str:
    return fmt.response_key


def render(row: dict[str, Any], fmt: RowFormat, template: str, tokenizer: Any) -> list[tuple[str, bool]]:
    """The row as ``(text, trained)`` segments: a prompt and its response, a chat with its assistant turns
    trained, or a text trained whole."""
    if fmt.kind == TEXT:
        return [(_text(row.get("text")), True)]
    if fmt.kind == CHAT:
        return _render_chat(row[fmt.prompt_key], tokenizer)
    response = _text(row.get(_response_key(fmt)))
    if template == "chatml":
        response += "<|im_end|>"
    return [(_prompt_text(row, fmt, template), False), (response, True)]


def _render_chat(messages: Sequence[dict[str, Any]], tokenizer: Any) -> list[tuple[str, bool]]:
    """Each assistant turn is what rendering the conversation up to it adds to the rendering up to the turn
    before it with the generation prompt; everything else is prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "chat data (messages) needs a chat template: the tokenizer has none; pass --chat-template chatml or "
            "a Jinja template file"
        )
    if isinstance(messages, str):  # a CSV (or any text column) holds the conversation as JSON text
        try:
            messages = json.loads(messages)
        except ValueError:
            messages = None
        if not isinstance(messages, list):
            raise DataError(
                "a chat row's messages are text that is not a JSON list of messages; give a list of "
                '{"role", "content"} objects (or its JSON text)'
            )
    messages = [_message(m) for m in messages]

    def rendered(turns: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError from the template's raise_exception, or its own slip
            roles = "/".join(m["role"] for m in messages)
            raise DataError(
                f"the chat template refuses a conversation ({roles}): {first_line(e, 160)}; fix the data or pass "
                "--chat-template chatml or a Jinja template file"
            ) from None

    return [(text, trained) for text, trained, _ in turn_segments(messages, rendered)]


def turn_segments(messages: Sequence[dict[str, Any]], rendered: Any) -> list[tuple[str, bool, int]]:
    """A conversation as ``(text, trained, end)`` segments of what ``rendered(turns, add_generation_prompt)`` (its
    chat template) makes of it: each assistant turn is what rendering up to it adds to the rendering before it with
    the generation prompt, and trains; everything else is prompt. ``end``: the messages rendered through the
    segment's end (a vision model's processor takes the images of those)."""
    segments: list[tuple[str, bool, int]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = rendered(messages[:i], add_generation_prompt=True)
        through = rendered(messages[: i + 1])
        if not (before.startswith(done) and through.startswith(before)):
            raise DataError(
                "the chat template renders a conversation differently as it grows: its turns cannot be told apart"
            )
        segments += [(before[len(done) :], False, i), (through[len(before) :], True, i + 1)]
        done = through
    whole = rendered(messages)
    segments.append((whole[len(done) :], False, len(messages)))
    return [s for s in segments if s[0]]


# ShareGPT's roles (and a few other exports') as chat templates name them.
_ROLES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bot": "assistant", "model": "assistant"}
# The roles chat templates know (OpenAI's, and the tool roles of Llama's and Qwen's templates). Another one is a
# typo or an export's own name: no turn would be the assistant's, and nothing would train.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _message(message: Any) -> dict[str, str]:
    """One chat message as ``{"role", "content"}``: OpenAI's layout (content a string or a list of text parts) or
    ShareGPT's ``{"from", "value"}`` (``human``/``gpt`` roles); a missing content is empty."""
    if not isinstance(message, dict):
        raise DataError(f"a chat message is {type(message).__name__}, not an object with role and content: {message!r}")
    role = message.get("role") if message.get("role") is not None else message.get("from")
    if role is None:
        keys = ", ".join(k for k, v in message.items() if v is not None)
        raise DataError(
            f"a chat message has no role: its keys are {keys or 'none'}; give each message role and content "
            "(or ShareGPT's from and value)"
        )
    content = message.get("content") if message.get("content") is not None else message.get("value")
    if isinstance(content, list):  # OpenAI's parts: [{"type": "text", "text": ...}, ...]
        if any(isinstance(p, dict) and p.get("type") == "image" and p.get("text") is None for p in content):
            raise DataError(
                "a chat message holds an image, but this run reads the data as text (its first rows brought no "
                "images); put the rows with images first, or give every image an images column"
            )
        content = "".join(str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
    role = _ROLES.get(str(role).lower(), str(role))
    if role not in CHAT_ROLES:
        raise DataError(
            f"a chat message has role {role!r}, which is not one chat templates know: use {', '.join(CHAT_ROLES)} "
            f"(or ShareGPT's {', '.join(_ROLES)})"
        )
    return {"role": role, "content": "" if content is None else str(content)}


def set_chat_template(tokenizer: Any, chat_template: str | None) -> None:
    """``--chat-template chatml|FILE``: the Jinja template the tokenizer renders chats with."""
    if chat_template is None:
        return
    if chat_template == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
        return
    if not os.path.isfile(chat_template):
        raise DataError(f"--chat-template {chat_template}: not chatml and no such file")
    with open(chat_template, encoding="utf-8") as f:
        tokenizer.chat_template = f.read()


def doubled_bos(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether ``ids`` start with two BOS tokens: a chat template that writes the BOS token itself (LLaMA 3's,
    Gemma's) and a tokenizer that adds one; the model was trained with one, so the first is dropped."""
    bos = tokenizer.bos_token_id
    return bos is not None and list(ids[:2]) == [bos, bos]


def encode(
    segments: Sequence[tuple[str, bool]], tokenizer: Any, seq_length: int, train_on_prompt: bool = False
) -> Encoded:
    """Token ids of the segments' text (with the tokenizer's own special tokens, e.g. LLaMA's BOS) and EOS;
    labels are the ids where a token's text is trained (everywhere with ``train_on_prompt``), else -100.
    Longer than ``seq_length``: cut at the end."""
    text, spans, start = "", [], 0
    for piece, trained in segments:
        text += piece
        if trained or train_on_prompt:
            spans.append((start, start + len(piece)))
        start += len(piece)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if doubled_bos(tokenizer, ids):
        ids, offsets = ids[1:], offsets[1:]
    # A token trains when its text starts inside a trained span; special tokens (empty offsets) do not.
    labels = [
        token if end > begin and any(lo <= begin < hi for lo, hi in spans) else -100
        for token, (begin, end) in zip(ids, offsets, strict=True)
    ]
    eos = tokenizer.eos_token_id
    if eos is not None:
        closing = eos if segments and (segments[-1][1] or train_on_prompt) else -100  # EOS ends the response
        if ids and ids[-1] == eos and offsets[-1][0] == offsets[-1][1]:  # the tokenizer added it already
            labels[-1] = closing
        elif ids and ids[-1] == eos:
            pass  # the text ends with it (a chat template that closes each turn with EOS): labelled by its segment
        else:
            ids.append(eos)
            labels.append(closing)
    return Encoded(ids[:seq_length], labels[:seq_length], truncated=len(ids) > seq_length)


@dataclass
class EncodedRow:
    """One row as ``encode_row`` leaves it: its samples (``pieces``: one, or a long text's windows; none when
    skipped or dropped), the field it lacks (``skipped``), whether it was ``dropped`` (no trained token left) or
    ``truncated``, and its prompt with the reference response (for greedy completions), if it has one."""

    pieces: list[Encoded]
    skipped: str | None = None
    dropped: bool = False
    truncated: bool = False
    prompt: tuple[str, str] | None = None


def encode_row(
    row: dict[str, Any], fmt: RowFormat, template: str, tokenizer: Any, seq_length: int, train_on_prompt: bool = False
) -> EncodedRow:
    """A row rendered and encoded as ``build_instruction_data`` and a streaming run (``rapidlite.data.streaming``)
    both take it: a row missing a field of ``fmt`` is skipped, a text longer than ``seq_length`` becomes its
    windows (continued pretraining trains every token, not the start), another row is cut at ``seq_length``, and a
    row with no trained token left is dropped."""
    missing = missing_field(row, fmt)
    if missing is not None:
        return EncodedRow([], skipped=missing)
    segments = render(row, fmt, template, tokenizer)
    if fmt.kind == TEXT:
        pieces = windows(encode(segments, tokenizer, sys.maxsize, train_on_prompt), seq_length)
        truncated = False
    else:
        pieces = [encode(segments, tokenizer, seq_length, train_on_prompt)]
        truncated = pieces[0].truncated
    if all(label == -100 for label in pieces[0].labels[1:]):
        return EncodedRow([], dropped=True, truncated=truncated)
    prompt = (
        (segments[0][0], segments[1][0]) if fmt.kind != TEXT and len(segments) >= 2 and not segments[0][1] else None
    )
    return EncodedRow(pieces, truncated=truncated, prompt=prompt)


def row_pieces(
    row: dict[str, Any], fmt: RowFormat, template: str, tokenizer: Any, seq_length: int, train_on_prompt: bool = False
) -> list[Encoded]:
    """``encode_row``'s samples alone: a streaming run's encoder (``functools.partial`` of it pickles into its
    loader workers)."""
    return encode_row(row, fmt, template, tokenizer, seq_length, train_on_prompt).pieces


@dataclass
class InstructionData:
    """Encoded splits (lists of ``{"input_ids", "labels"[, "position_ids"]}``), the validation prompts with
    their reference responses (for greedy completions), and what encoding did, for the log."""

    train: list[dict[str, list[int]]]
    validation: list[dict[str, list[int]]] | None
    test: list[dict[str, list[int]]] | None
    prompts: list[tuple[str, str]]
    fmt: RowFormat
    rows: int
    truncated: int
    windowed: int
    dropped: int
    skipped: dict[str, int]
    trained_tokens: int
    tokens: int


def build_instruction_data(
    raw: Any,
    tokenizer: Any,
    seq_length: int,
    *,
    prompt_key: str | None = None,
    response_key: str | None = None,
    template: str = "auto",
    train_on_prompt: bool = False,
    packing: bool = False,
    progress: bool = False,
) -> InstructionData:
    """Every split of ``raw`` (a ``datasets.DatasetDict``) rendered, encoded and, with ``packing``, packed.
    Rows with no trained token left (a response cut away by ``seq_length``) are dropped: they cost FLOPs and
    teach nothing. Rows missing a field of the format (null or absent, or an empty response or text) are
    skipped and counted by field (``skipped``): they would teach the model to answer with EOS alone.
    ``progress``: a bar per split on a terminal (``rapidlite.observe.progress``)."""
    template = load_template(template)
    first = "train" if "train" in raw else next(iter(raw))  # a streaming run's validation file comes alone
    fmt = detect_format(raw[first].column_names, prompt_key, response_key)
    splits: dict[str, list[dict[str, list[int]]] | None] = {"train": None, "validation": None, "test": None}
    prompts: list[tuple[str, str]] = []
    rows = truncated = windowed = dropped = trained = tokens = 0
    skipped: dict[str, int] = {}
    for name in splits:
        if name not in raw:
            continue
        missing = sorted(set(fmt_columns(fmt)) - set(raw[name].column_names))
        if missing:
            raise DataError(f"the {name} split lacks the columns {', '.join(missing)} that its {first} split has")
        encoded: list[Encoded] = []
        bar = progress_bar(len(raw[name]), desc=f"encoding {name}", unit="rows", leave=False, enabled=progress)
        for row in raw[name]:
            if bar is not None:
                bar.update()
            rows += 1
            out = encode_row(row, fmt, template, tokenizer, seq_length, train_on_prompt)
            if out.skipped is not None:
                skipped[out.skipped] = skipped.get(out.skipped, 0) + 1
                continue
            windowed += len(out.pieces) > 1
            truncated += out.truncated
            if out.dropped:
                dropped += 1
                continue
            encoded += out.pieces
            trained += sum(label != -100 for enc in out.pieces for label in enc.labels[1:])
            tokens += sum(len(enc.input_ids) for enc in out.pieces)
            if name == "validation" and out.prompt is not None:
                prompts.append(out.prompt)
        if bar is not None:
            bar.close()
        if packing:
            splits[name] = pack(encoded, seq_length)
        else:
            splits[name] = [{"input_ids": e.input_ids, "labels": e.labels} for e in encoded]
    if first == "train" and not splits["train"] and skipped:
        fields = ", ".join(sorted(skipped))
        raise DataError(f"every training row lacks its {fields} (null, absent or empty); fill it in")
    if first == "train" and not splits["train"] and dropped:
        raise DataError(
            f"no training row keeps a response token within --seq-length {seq_length} (prompts are cut there); "
            "raise --seq-length"
        )
    return InstructionData(
        splits["train"] or [],
        splits["validation"],
        splits["test"],
        prompts,
        fmt,
        rows,
        truncated,
        windowed,
        dropped,
        skipped,
        trained,
        tokens,
    )


def missing_field(row: dict[str, Any], fmt: RowFormat) -> str | None:
    """The first field of ``fmt`` that ``row`` lacks (null or absent; the response, text or conversation also when
    empty), else None. An empty prompt or input is kept: it is a row without context."""
    trained = {TEXT: "text", CHAT: fmt.prompt_key}.get(fmt.kind, fmt.response_key)
    for column in fmt_columns(fmt):
        value = row.get(column)
        empty = not value.strip() if isinstance(value, str) else isinstance(value, (list, tuple)) and not value
        if value is None or (column == trained and empty):
            return column
    return None


def fmt_columns(fmt: RowFormat) -> tuple[str, ...]:
    """The columns a row of ``fmt`` is read from."""
    if fmt.kind == TEXT:
        return ("text",)
    if fmt.kind == CHAT:
        return (fmt.prompt_key,)
    return (fmt.prompt_key, fmt.response_key)


class CausalLMCollator:
    """Right-pads encoded rows: ``input_ids`` with ``pad_token_id``, ``labels`` with -100. Unpacked batches get
    an attention mask; packed ones (rows with ``position_ids``) get their position ids padded with 0, which
    makes each padding token a one-token sample of its own, and no attention mask, so the model separates the
    packed samples by their restarting positions. A class, so loader workers can pickle it."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(s["input_ids"]) for s in samples)
        packed = "position_ids" in samples[0]
        fill = {"input_ids": self.pad_token_id, "labels": -100, "position_ids": 0}
        keys = ("input_ids", "labels", "position_ids") if packed else ("input_ids", "labels")
        batch = {k: torch.full((len(samples), length), fill[k], dtype=torch.int64) for k in keys}
        if not packed:
            batch["attention_mask"] = torch.zeros((len(samples), length), dtype=torch.int64)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            for k in keys:
                batch[k][i, :n] = torch.tensor(s[k], dtype=torch.int64)
            if not packed:
                batch["attention_mask"][i, :n] = 1
        return batch
