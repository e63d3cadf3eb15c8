"""Preference data: rows of a prompt with a chosen and a rejected response (``--task dpo``, ``reward_model``) or
with one completion labelled desirable or not (``--task kto``), tokenized as TRL tokenizes them.

Layouts (TRL's, ``pair_layout``):

- ``prompt``/``chosen``/``rejected`` as text, or as conversations (lists of ``{"role", "content"}`` messages,
  rendered with the tokenizer's chat template or ``--chat-template``);
- ``chosen``/``rejected`` alone with an implicit prompt: the conversation (or text) both share, as in Anthropic
  HH (``implicit_prompt``);
- UltraFeedback-binarized rows: a text ``prompt`` beside conversations that hold it (the prompt column is
  ignored, the conversations' shared turns are the prompt); its ``train_prefs``/``test_prefs`` splits are the
  train and validation splits (``rapidlite.data.tabular``);
- ``prompt``/``completion``/``label`` for KTO, whose paired data may also be given (each pair then becomes a
  desirable and an undesirable row).

A text row's response gets the EOS token when it lacks it; a conversation's template closes it. The response
starts where the tokenized prompt and prompt + response first differ (``common_prefix``), so tokens merging over
the boundary are not lost. Truncation: ``--max-prompt-length`` keeps the prompt's end; ``--max-length`` keeps the
start of prompt + response. Rows whose prompt fills ``--max-length`` (no response token left), and pairs whose
chosen equals the rejected response (no preference to learn), are dropped and counted.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rapidlite.data.collate import flatten_rows
from rapidlite.data.instruction import _message, doubled_bos
from rapidlite.errors import DataError, first_line

PAIRED_LAYOUTS = (
    "prompt/chosen/rejected (text or conversations), chosen/rejected with the prompt inside both (Anthropic HH), "
    "or UltraFeedback-binarized rows"
)
UNPAIRED_LAYOUT = "prompt/completion/label (label true or false)"
UNPAIR_BATCH = 1000  # datasets' default batch of a batched map, which TRL's unpairing is


# ------------------------------------------------------------------ rows


def as_conversation(value: Any) -> list[dict[str, str]] | None:
    """``value`` as a list of messages when it is one (or JSON text of one, as a CSV holds it), else None."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        return [_message(m) for m in value]
    return None


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a pair whose prompt is the start both share: whole messages of two
    conversations, or characters of two texts (a space before the first difference goes with the responses).
    TRL's ``extract_prompt`` rule."""
    n = min(len(chosen), len(rejected))
    i = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and 0 < i and chosen[i - 1] == " ":
        i -= 1
    return chosen[:i], chosen[i:], rejected[i:]


@dataclass(frozen=True)
class Pair:
    """One preference row: prompt, chosen and rejected, all text or all conversations."""

    prompt: Any
    chosen: Any
    rejected: Any

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def read_pair(row: Mapping[str, Any]) -> Pair:
    """The prompt, chosen and rejected response of a row in any of the paired layouts."""
    chosen_conv, rejected_conv = as_conversation(row["chosen"]), as_conversation(row["rejected"])
    if (chosen_conv is None) != (rejected_conv is None):
        raise DataError("a row's chosen and rejected differ in kind (one a conversation, one text); give both alike")
    prompt = row.get("prompt")
    if chosen_conv is not None:
        prompt_conv = as_conversation(prompt) if prompt is not None else None
        if prompt_conv is None:  # no prompt, or UltraFeedback's text prompt beside conversations that hold it
            return Pair(*implicit_prompt(chosen_conv, rejected_conv))
        return Pair(prompt_conv, chosen_conv, rejected_conv)
    chosen, rejected = _text(row["chosen"]), _text(row["rejected"])
    if prompt is None:
        return Pair(*implicit_prompt(chosen, rejected))
    if as_conversation(prompt) is not None:
        raise DataError("a row's prompt is a conversation but its chosen and rejected are text; give them alike")
    return Pair(_text(prompt), chosen, rejected)


def pair_layout(columns: Sequence[str]) -> str:
    """Checks that data with ``columns`` is in a paired layout; the one line naming the accepted ones if not."""
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise DataError(
            f"preference data needs chosen and rejected responses: the data has no {' or '.join(missing)} column "
            f"(its columns: {', '.join(sorted(columns))}); give {PAIRED_LAYOUTS}"
        )
    return "prompt/chosen/rejected" if "prompt" in columns else "chosen/rejected (implicit prompt)"


# ------------------------------------------------------------------ tokenization


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Encoder:
    """Token ids of prompts and responses, text or conversations, as TRL makes them: a tokenizer call on text
    (with its special tokens; a doubled BOS from a template that writes its own is dropped), or the chat
    template (``add_generation_prompt`` for a prompt alone)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token

    def ids(self, value: Any, generation_prompt: bool = False) -> list[int]:
        tok = self.tokenizer
        if isinstance(value, list):
            if not getattr(tok, "chat_template", None):
                raise DataError(
                    "conversational preference data needs a chat template: the tokenizer has none; pass "
                    "--chat-template chatml or a Jinja template file"
                )
            try:
                text = tok.apply_chat_template(value, tokenize=False, add_generation_prompt=generation_prompt)
            except Exception as e:  # jinja2's TemplateError from the template's raise_exception, or its own slip
                raise DataError(
                    f"the chat template refuses a conversation: {first_line(e, 160)}; fix the data or pass "
                    "--chat-template chatml or a Jinja template file"
                ) from None
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tok(value)["input_ids"])
        return ids[1:] if doubled_bos(tok, ids) else ids

    def with_eos(self, response: Any) -> Any:
        """A text response closed by EOS (unless it is already); a conversation's template closes its own."""
        if isinstance(response, str) and self.eos and not response.endswith(self.eos):
            return response + self.eos
        return response

    def split(self, prompt: Any, responses: Sequence[Any]) -> tuple[list[int], list[list[int]]]:
        """``(prompt_ids, [response_ids, ...])``: each response's ids are what prompt + response adds after the
        tokens all of them share with the prompt alone."""
        prompt_ids = self.ids(prompt, generation_prompt=True)
        full = [self.ids(prompt + self.with_eos(r)) for r in responses]
        start = min(common_prefix(prompt_ids, f) for f in full)
        return prompt_ids[:start], [f[start:] for f in full]


@dataclass
class Counts:
    """What encoding did to the rows, for the data line."""

    rows: int = 0
    kept: int = 0
    prompt_truncated: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def describe(self, max_length: int, max_prompt_length: int | None) -> str:
        parts = [f"{self.rows} rows"]
        if self.prompt_truncated:
            parts.append(f"{self.prompt_truncated} prompts cut to --max-prompt-length {max_prompt_length}")
        if self.truncated:  # reward_model drops long rows instead: none is ever cut there
            parts.append(f"{self.truncated} truncated to --max-length {max_length}")
        parts += [f"{n} dropped ({reason})" for reason, n in sorted(self.dropped.items())]
        return ", ".join(parts)


def _fit(
    prompt_ids: list[int], responses: list[list[int]], max_length: int, max_prompt_length: int | None, counts: Counts
) -> tuple[list[int], list[list[int]]] | None:
    """The prompt cut to its last ``max_prompt_length`` tokens, then prompt + each response to the first
    ``max_length``; None when the prompt leaves no response token."""
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
        counts.prompt_truncated += 1
    if len(prompt_ids) >= max_length:
        counts.drop(f"the prompt fills --max-length {max_length}")
        return None
    room = max_length - len(prompt_ids)
    counts.truncated += any(len(r) > room for r in responses)
    return prompt_ids, [r[:room] for r in responses]


def _distinct_pairs(rows: Any, counts: Counts) -> Iterator[tuple[Mapping[str, Any], Pair]]:
    """Each row with its pair, counted; pairs whose chosen equals the rejected response (no preference to learn)
    are dropped and counted."""
    for row in rows:
        counts.rows += 1
        pair = read_pair(row)
        if pair.chosen == pair.rejected:
            counts.drop("chosen equals rejected")
            continue
        yield row, pair


def encode_pairs(
    rows: Any, tokenizer: Any, max_length: int, max_prompt_length: int | None, counts: Counts
) -> list[dict[str, list[int]]]:
    """``{"prompt_ids", "chosen_ids", "rejected_ids"}`` of each usable row (``--task dpo``)."""
    encoder = Encoder(tokenizer)
    out = []
    for _, pair in _distinct_pairs(rows, counts):
        prompt_ids, (chosen, rejected) = encoder.split(pair.prompt, [pair.chosen, pair.rejected])
        fitted = _fit(prompt_ids, [chosen, rejected], max_length, max_prompt_length, counts)
        if fitted is None:
            continue
        prompt_ids, (chosen, rejected) = fitted
        out.append({"prompt_ids": prompt_ids, "chosen_ids": chosen, "rejected_ids": rejected})
    counts.kept += len(out)
    return out


def _margin(value: Any) -> float:
    try:
        margin = float(value)
    except (TypeError, ValueError):
        margin = float("nan")
    if margin != margin:
        raise DataError(f"a row's margin is {value!r}; give every row a number in the margin column, or drop it")
    return margin


def encode_reward_pairs(
    rows: Any, tokenizer: Any, max_length: int, counts: Counts, numbers: list[int] | None = None
) -> list[dict[str, Any]]:
    """``{"chosen_ids", "rejected_ids"[, "margin"]}``: prompt + response whole, as TRL's ``RewardTrainer`` tokenizes
    them (the score is read at the last token, so a longer row is dropped, not cut). ``numbers``, when given,
    receives each sample's row number (0-based, in ``rows``)."""
    encoder = Encoder(tokenizer)
    out = []
    start = counts.rows
    for row, pair in _distinct_pairs(rows, counts):
        chosen = encoder.ids(pair.prompt + encoder.with_eos(pair.chosen))
        rejected = encoder.ids(pair.prompt + encoder.with_eos(pair.rejected))
        if max(len(chosen), len(rejected)) > max_length:
            counts.drop(f"longer than --max-length {max_length}")
            continue
        if numbers is not None:
            numbers.append(counts.rows - start - 1)  # _distinct_pairs has counted this row
        sample: dict[str, Any] = {"chosen_ids": chosen, "rejected_ids": rejected}
        if "margin" in row:  # a column: every row has it, so every batch does
            sample["margin"] = _margin(row["margin"])
        out.append(sample)
    counts.kept += len(out)
    return out


def _label(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise DataError(f"a KTO row's label is {value!r}; give true (desirable) or false (undesirable)")


def unpaired_rows(raw_rows: Any, columns: Sequence[str]) -> list[tuple[Any, Any, bool]]:
    """``(prompt, completion, desirable)`` of every row: the unpaired layout, or paired rows unpaired."""
    if {"completion", "label"} <= set(columns):
        out = []
        for row in raw_rows:
            completion = as_conversation(row["completion"])
            prompt = as_conversation(row.get("prompt")) if completion is not None else _text(row.get("prompt"))
            if completion is not None and prompt is None:
                raise DataError("a KTO row's completion is a conversation but its prompt is not; give them alike")
            out.append(
                (prompt, completion if completion is not None else _text(row["completion"]), _label(row["label"]))
            )
        return out
    if {"chosen", "rejected"} <= set(columns):
        pairs = [read_pair(row) for row in raw_rows]
        out = []
        # TRL's unpair_preference_dataset is a batched map (1000 rows a batch): each batch's chosen rows, then its
        # rejected ones.
        for start in range(0, len(pairs), UNPAIR_BATCH):
            batch = pairs[start : start + UNPAIR_BATCH]
            out += [(p.prompt, p.chosen, True) for p in batch] + [(p.prompt, p.rejected, False) for p in batch]
        return out
    raise DataError(
        f"KTO data needs {UNPAIRED_LAYOUT}, or preference pairs ({PAIRED_LAYOUTS}); its columns are "
        f"{', '.join(sorted(columns))}"
    )


def encode_unpaired(
    rows: Sequence[tuple[Any, Any, bool]],
    tokenizer: Any,
    max_length: int,
    max_prompt_length: int | None,
    counts: Counts,
) -> list[dict[str, Any]]:
    """``{"prompt_ids", "completion_ids", "label"}`` of each usable row (``--task kto``), as TRL's
    ``KTOTrainer._prepare_dataset`` makes them. The completion is kept whole: a KL sequence pairs it with another
    row's prompt, and the collator cuts each sequence to ``max_length`` (TRL's order of cutting)."""
    encoder = Encoder(tokenizer)
    out = []
    for prompt, completion, desirable in rows:
        counts.rows += 1
        prompt_ids, (completion_ids,) = encoder.split(prompt, [completion])
        fitted = _fit(prompt_ids, [completion_ids], max_length, max_prompt_length, counts)
        if fitted is None:
            continue
        out.append({"prompt_ids": fitted[0], "completion_ids": completion_ids, "label": desirable})
    counts.kept += len(out)
    return out


def add_kl_completions(samples: list[dict[str, Any]], group: int) -> None:
    """Gives each sample its KL completion (``kl_completion_ids``): within each run of ``group`` consecutive samples
    the completions rotated by one, ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, as TRL's
    ``add_kl_completion_ids`` does per batch of ``per_device_train_batch_size``. ``group`` is the global batch here:
    the KL estimate is a mean over the global batch, so its mismatched completions are the batch's own."""
    for start in range(0, len(samples), group):
        chunk = samples[start : start + group]
        completions = [s["completion_ids"] for s in chunk]
        for sample, kl in zip(chunk, completions[-1:] + completions[:-1], strict=True):
            sample["kl_completion_ids"] = kl


def encode_splits(
    raw: Any, task: str, max_length: int, encode: Callable[[str, Any, Counts], list[dict[str, Any]]]
) -> tuple[dict[str, list[dict[str, Any]] | None], dict[str, Counts]]:
    """Every split of ``raw`` (train, validation, test; None where absent) as ``encode(name, rows, counts)`` makes
    its samples, with what encoding did to each; a training split left with no sample is one line."""
    splits: dict[str, list[dict[str, Any]] | None] = {}
    counts: dict[str, Counts] = {}
    for name in ("train", "validation", "test"):
        if name not in raw:
            splits[name] = None
            continue
        counts[name] = Counts()
        splits[name] = encode(name, raw[name], counts[name])
    if not splits["train"]:
        raise no_rows_left(task, counts["train"], max_length)
    return splits, counts


def no_rows_left(task: str, counts: Counts, max_length: int) -> DataError:
    """The error when encoding dropped every training row."""
    if not counts.rows:
        return DataError(f"--task {task}: the training data has no rows")
    reasons = ", ".join(f"{n} dropped: {reason}" for reason, n in sorted(counts.dropped.items()))
    if any("prompt fills" in r for r in counts.dropped):
        fix = f"raise --max-length (now {max_length}) or set --max-prompt-length"
    elif any("max-length" in r for r in counts.dropped):  # whole rows (reward_model), which no prompt cut shortens
        fix = f"raise --max-length (now {max_length})"
    else:
        fix = "give pairs whose chosen and rejected responses differ"
    return DataError(f"--task {task}: no training row is usable ({reasons}); {fix}")


# ------------------------------------------------------------------ batches


def _sequences(sample: Mapping[str, Any], keys: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of prompt + each response: labels are the response's ids, -100 on the prompt."""
    prompt = list(sample.get("prompt_ids", ()))
    return [(prompt + list(sample[k]), [-100] * len(prompt) + list(sample[k])) for k in keys]


class PairCollator:
    """Batches of paired samples. Padded: ``input_ids``, ``attention_mask`` and ``labels`` of shape
    ``[batch, 2, length]`` (chosen, rejected; right-padded, labels -100 outside the response), so that a batch
    sliced by rows keeps its pairs. ``padding_free``: all 2 x batch sequences packed into one row (chosen ones,
    then rejected ones) with restarting position ids, ``sequences_per_sample`` 2. ``ref_logps`` ``[batch, 2]``
    when the samples carry precomputed reference log-probabilities; ``margin`` ``[batch]`` when they have one."""

    def __init__(
        self, pad_token_id: int, keys: Sequence[str] = ("chosen_ids", "rejected_ids"), packed: bool = False
    ) -> None:
        self.pad_token_id = pad_token_id
        self.keys = tuple(keys)
        self.packed = packed

    def padding_free(self) -> PairCollator:
        """The packing twin of this collator (``--padding-free``): the trainer asks for it."""
        twin = copy.copy(self)
        twin.packed = True
        return twin

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [_sequences(s, self.keys) for s in samples]
        if self.packed:
            rows = [{"input_ids": pair[j][0], "labels": pair[j][1]} for j in range(len(self.keys)) for pair in seqs]
            # Each sequence's first label is -100: the sequence before it must not learn to predict it.
            batch = flatten_rows(rows, shift_labels=True)
            batch["sequences_per_sample"] = torch.tensor(len(self.keys))
        else:
            length = max(len(ids) for pair in seqs for ids, _ in pair)
            shape = (len(samples), len(self.keys), length)
            batch = {
                "input_ids": torch.full(shape, self.pad_token_id, dtype=torch.int64),
                "attention_mask": torch.zeros(shape, dtype=torch.int64),
                "labels": torch.full(shape, -100, dtype=torch.int64),
            }
            for i, pair in enumerate(seqs):
                for j, (ids, labels) in enumerate(pair):
                    batch["input_ids"][i, j, : len(ids)] = torch.tensor(ids)
                    batch["attention_mask"][i, j, : len(ids)] = 1
                    batch["labels"][i, j, : len(ids)] = torch.tensor(labels)
        if "ref_logps" in samples[0]:
            batch["ref_logps"] = torch.tensor([s["ref_logps"] for s in samples], dtype=torch.float32)
        if "margin" in samples[0]:
            batch["margin"] = torch.tensor([s["margin"] for s in samples], dtype=torch.float32)
        return batch


def pair_rewards(model: Any, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scores a one-output sequence classifier (a reward model) gives each pair's chosen and rejected
    sequence of a padded ``PairCollator`` batch, ``[pairs]`` each: one forward of its ``[pairs, 2, length]`` rows as
    ``[2 x pairs, length]``, chosen rows first (TRL's order)."""
    pairs, k, length = batch["input_ids"].shape
    inputs = {key: batch[key].transpose(0, 1).reshape(k * pairs, length) for key in ("input_ids", "attention_mask")}
    scores = model(**inputs, use_cache=False).logits.squeeze(-1).float()
    chosen, rejected = scores.chunk(2)
    return chosen, rejected


class UnpairedCollator:
    """Batches of KTO samples, TRL's ``DataCollatorForUnpairedPreference``: ``input_ids``, ``attention_mask``,
    ``labels`` ``[batch, length]`` of prompt + completion, each cut to ``max_length`` then right-padded (labels -100
    outside the completion); ``label`` ``[batch]`` (desirable); the same three as ``kl_*`` for the KL sequences (each
    prompt with its ``kl_completion_ids``); ``ref_logps`` ``[batch, 2]`` (completion, KL) when precomputed.
    ``padding_free``: the completions packed into one row and the KL sequences into another (``input_ids``,
    ``labels``, ``position_ids`` restarting at each; ``kl_*`` the same), ``sequences_per_sample`` 1."""

    def __init__(self, pad_token_id: int, max_length: int, packed: bool = False) -> None:
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.packed = packed

    def padding_free(self) -> UnpairedCollator:
        """The packing twin of this collator (``--padding-free``): the trainer asks for it."""
        twin = copy.copy(self)
        twin.packed = True
        return twin

    def _pad(self, seqs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        seqs = [(ids[: self.max_length], labels[: self.max_length]) for ids, labels in seqs]
        if self.packed:  # each sequence's first label -100: the one before it must not learn to predict it
            return flatten_rows([{"input_ids": ids, "labels": labels} for ids, labels in seqs], shift_labels=True)
        length = max(len(ids) for ids, _ in seqs)
        out = {
            "input_ids": torch.full((len(seqs), length), self.pad_token_id, dtype=torch.int64),
            "attention_mask": torch.zeros((len(seqs), length), dtype=torch.int64),
            "labels": torch.full((len(seqs), length), -100, dtype=torch.int64),
        }
        for i, (ids, labels) in enumerate(seqs):
            out["input_ids"][i, : len(ids)] = torch.tensor(ids)
            out["attention_mask"][i, : len(ids)] = 1
            out["labels"][i, : len(ids)] = torch.tensor(labels)
        return out

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self._pad([_sequences(s, ("completion_ids",))[0] for s in samples])
        if "kl_completion_ids" in samples[0]:
            kl = self._pad([_sequences(s, ("kl_completion_ids",))[0] for s in samples])
            batch.update({f"kl_{k}": v for k, v in kl.items()})
        batch["label"] = torch.tensor([bool(s["label"]) for s in samples])
        if self.packed:
            batch["sequences_per_sample"] = torch.tensor(1)
        if "ref_logps" in samples[0]:
            batch["ref_logps"] = torch.tensor([s["ref_logps"] for s in samples], dtype=torch.float32)
        return batch
