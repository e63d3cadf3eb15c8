"""Encoded rows and their packing, shared by the map-style path (``rapidlite.data.instruction``) and a streaming run
(``rapidlite.data.streaming``): an encoded row (``Encoded``), a long one as windows (``windows``), rows packed into
sequences of at most ``seq_length`` tokens with position ids restarting at every row (``Packer`` as rows come,
``pack`` for a list), and the block-diagonal mask of packed rows for a model that takes one
(``packed_attention_mask``, the built-in GPT).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rapidlite.data.collate import flatten_rows


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def windows(row: Encoded, seq_length: int) -> list[Encoded]:
    """A row longer than ``seq_length`` as consecutive windows of ``seq_length`` tokens that overlap by one token,
    so every token after the row's first is a target exactly once (a window's first token only conditions)."""
    if len(row.input_ids) <= seq_length:
        return [row]
    step = max(seq_length - 1, 1)
    return [
        Encoded(row.input_ids[start : start + seq_length], row.labels[start : start + seq_length], truncated=False)
        for start in range(0, len(row.input_ids) - 1, step)
    ]


class Packer:
    """Rows packed as they come (``pack``'s rule): a row that would overflow ``seq_length`` closes the pack being
    filled and starts the next. ``add`` returns the packs it closed, ``flush`` the last one; ``state_dict`` is the
    pack being filled (a streaming run's checkpoint keeps it, ``rapidlite.data.streaming``)."""

    def __init__(self, seq_length: int) -> None:
        self.seq_length = seq_length
        self.bucket: list[Encoded] = []
        self.size = 0

    def add(self, row: Encoded) -> list[dict[str, list[int]]]:
        closed = []
        if self.bucket and self.size + len(row.input_ids) > self.seq_length:
            closed = self.flush()
        self.bucket.append(row)
        self.size += len(row.input_ids)
        return closed

    def flush(self) -> list[dict[str, list[int]]]:
        if not self.bucket:
            return []
        # A row's first token is no target within the row; packed, the previous row's last token would learn it.
        rows = [{"input_ids": r.input_ids, "labels": r.labels} for r in self.bucket]
        flat = flatten_rows(rows, shift_labels=True)
        self.bucket, self.size = [], 0
        return [{key: value[0].tolist() for key, value in flat.items()}]

    def state_dict(self) -> dict[str, Any]:
        return {"bucket": [(r.input_ids, r.labels) for r in self.bucket]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bucket = [Encoded(list(ids), list(labels), truncated=False) for ids, labels in state["bucket"]]
        self.size = sum(len(r.input_ids) for r in self.bucket)


def pack(rows: Iterable[Encoded], seq_length: int) -> list[dict[str, list[int]]]:
    """Rows concatenated in order into sequences of at most ``seq_length`` tokens (a row never split), with
    position ids restarting at each row (``rapidlite.data.collate.flatten_rows``, which ``--padding-free`` batches
    are made by too); the per-token loss over the packs equals the rows' own."""
    packer = Packer(seq_length)
    packs = [p for row in rows for p in packer.add(row)]
    return packs + packer.flush()


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask ``[b, 1, s, s]`` (True = attend) of rows packed with restarting position
    ids: a token attends to the earlier tokens of its own row only."""
    starts = (position_ids == 0).long().cumsum(-1)  # the row each token belongs to
    same_row = starts[:, :, None] == starts[:, None, :]
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return (same_row & causal)[:, None]
