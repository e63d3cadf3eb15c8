"""Preference pairs with images (``--task dpo`` on data with images), encoded as TRL's ``DPOTrainer`` encodes them.

A row is TRL's (``prompt``, ``chosen``, ``rejected``: message lists or text, with ``images`` or ``image``) or
LLaMA-Factory's (``messages``/``conversations`` as the prompt turns, ``chosen`` and ``rejected`` each one assistant
message, ``images``); the prompt's images are placed as ``rapidlite.data.vision.vision_sample`` places a chat's.
The prompt is rendered with the processor's chat template and its generation prompt and processed with its
images; each response is what the template adds for it, tokenized alone. A sample is encoded when the data
loader asks for it; ``VisionPairCollator`` pads the pairs into ``[pairs, 2, length]`` and joins the prompts'
images once (the forward repeats them for the rejected rows: ``repeated_images``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rapidlite.data.instruction import _message
from rapidlite.data.vision import (
    IGNORE,
    TOKEN_KEYS,
    VisionEncoder,
    VisionSample,
    bounded,
    open_image,
    pad_cat,
    vision_sample,
)
from rapidlite.errors import DataError

# The keys of a pair batch that are not image tensors.
PAIR_KEYS = frozenset((*TOKEN_KEYS, "ref_logps", "margin", "position_ids", "sequences_per_sample"))


@dataclass
class VisionPair:
    """A pair's prompt (a chat with its images) and its chosen and rejected responses (assistant messages)."""

    prompt: VisionSample
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]


def _responses(value: Any, index: int, name: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": [{"type": "text", "text": value}]}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataError(f"row {index}: {name} is neither text nor assistant messages")
    out = []
    for message in value:
        content = message.get("content", message.get("value")) if isinstance(message, Mapping) else None
        if isinstance(content, list):
            content = "".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping))
        role = _message({**message, "content": ""})["role"]
        out.append({"role": role, "content": [{"type": "text", "text": "" if content is None else str(content)}]})
    return out


def vision_pair(row: Mapping[str, Any], index: int) -> VisionPair:
    """The row's prompt (with its images), chosen and rejected; one line for a row in no paired layout."""
    if "chosen" not in row or "rejected" not in row:
        raise DataError(f"row {index}: preference data needs chosen and rejected; its columns are {', '.join(row)}")
    prompt = row.get("prompt")
    if prompt is None:
        prompt = row.get("messages", row.get("conversations"))
    if prompt is None:
        raise DataError(
            f"row {index}: a pair with images needs its prompt: a prompt column (text or messages), or LLaMA-Factory's "
            "messages/conversations"
        )
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    sample = vision_sample({"messages": turns, "images": row.get("images"), "image": row.get("image")}, index)
    return VisionPair(
        sample, _responses(row["chosen"], index, "chosen"), _responses(row["rejected"], index, "rejected")
    )


@dataclass(frozen=True)
class VisionPairEncoder:
    """One pair as the model takes it: ``prompt_ids`` (and its token types) with the prompt's image tensors, and
    ``chosen_ids`` and ``rejected_ids``; a pair longer than ``seq_length`` is cut at the end of its responses."""

    base: VisionEncoder

    def __call__(self, pair: VisionPair, index: int) -> dict[str, torch.Tensor]:
        encoder, processor = self.base, self.base.processor
        images = [
            bounded(open_image(s, encoder.base, index), encoder.min_pixels, encoder.max_pixels)
            for s in pair.prompt.images
        ]
        prompt_text = processor.apply_chat_template(pair.prompt.messages, tokenize=False, add_generation_prompt=True)
        out = processor(
            text=[prompt_text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False
        )
        sample: dict[str, torch.Tensor] = {}
        for key, value in out.items():
            sample["prompt_" + key if key in TOKEN_KEYS else key] = value[0] if key in TOKEN_KEYS else value
        tokenizer = processor.tokenizer
        for name, response in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            whole = processor.apply_chat_template([*pair.prompt.messages, *response], tokenize=False)
            if not whole.startswith(prompt_text):
                raise DataError(f"row {index}: the chat template renders the prompt differently before a response")
            ids = tokenizer(whole[len(prompt_text) :], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
            room = encoder.seq_length - len(sample["prompt_input_ids"])
            if room <= 0:
                raise DataError(
                    f"row {index}: its prompt and images take {len(sample['prompt_input_ids'])} tokens; --seq-length "
                    f"{encoder.seq_length} leaves none for the responses: raise it or lower --image-max-pixels"
                )
            sample[f"{name}_ids"] = ids[:room]
        return sample


@dataclass
class VisionPairCollator:
    """``[pairs, 2, length]`` batches as ``PairCollator`` makes them (prompt then response, right-padded, labels on
    the response), with the prompt's token types carried along (0 on the responses) and its images joined once."""

    pad_id: int

    def __call__(self, samples: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        samples = [s for s in samples if s is not None]  # a pair whose image could not be read (--skip-bad-images)
        if not samples:
            raise DataError("--skip-bad-images: every pair of a batch had an unreadable image")
        rows = [[torch.cat([s["prompt_input_ids"], s[k]]) for k in ("chosen_ids", "rejected_ids")] for s in samples]
        length = max(len(r) for pair in rows for r in pair)
        shape = (len(samples), 2, length)
        batch = {
            "input_ids": torch.full(shape, self.pad_id, dtype=torch.int64),
            "attention_mask": torch.zeros(shape, dtype=torch.int64),
            "labels": torch.full(shape, IGNORE, dtype=torch.int64),
        }
        types = [k for k in ("token_type_ids", "mm_token_type_ids") if f"prompt_{k}" in samples[0]]
        for key in types:
            batch[key] = torch.zeros(shape, dtype=samples[0][f"prompt_{key}"].dtype)
        for i, (sample, pair) in enumerate(zip(samples, rows, strict=True)):
            prompt = len(sample["prompt_input_ids"])
            for j, ids in enumerate(pair):
                batch["input_ids"][i, j, : len(ids)] = ids
                batch["attention_mask"][i, j, : len(ids)] = 1
                batch["labels"][i, j, prompt : len(ids)] = ids[prompt:]
                for key in types:
                    batch[key][i, j, :prompt] = sample[f"prompt_{key}"]
        for key in samples[0]:
            if not key.startswith("prompt_") and key not in ("chosen_ids", "rejected_ids"):
                batch[key] = pad_cat([s[key] for s in samples if key in s])
        return batch


def repeated_images(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's image tensors for its flattened rows (every chosen row, then every rejected row): each twice."""
    return {k: torch.cat([v, v]) for k, v in batch.items() if k not in PAIR_KEYS}
