"""Megatron's and Rapidformer's constructions that read the running engine's flags, for user scripts: ``GPTModel()``
and ``build_train_valid_test_datasets_for_huggingface(...)`` without a config or tokenizer, as Megatron's
``get_args()``-driven code builds them. The library's own classes take their config and tokenizer explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rapidlite.compat.global_vars import get_args, get_tokenizer
from rapidlite.data.bert_dataset import build_bert_train_valid_test_datasets
from rapidlite.data.gpt_dataset import check_mmap_data
from rapidlite.models import gpt


class GPTModel(gpt.GPTModel):
    """``GPTModel()``: the built-in GPT with its architecture from the running engine's flags (``get_args()``, the
    vocabulary from ``get_tokenizer()``) and, as Megatron's GPT does, per-token fp32 losses ``[b, s]`` from the
    forward with ``labels``. Given a ``GPTConfig`` it is ``rapidlite.models.gpt.GPTModel``."""

    def __init__(self, config: gpt.GPTConfig | None = None, *, per_token_loss: bool | None = None, **megatron: Any):
        if config is None:
            config = gpt.GPTConfig.of(get_args().sections, get_tokenizer().vocab_size)
            per_token_loss = True if per_token_loss is None else per_token_loss
        super().__init__(config, per_token_loss=bool(per_token_loss), **megatron)


def build_train_valid_test_datasets_for_huggingface(
    data_prefix: Sequence[str] | str,
    data_impl: str = "mmap",
    splits_string: str = "969,30,1",
    train_valid_test_num_samples: Sequence[int] = (0, 0, 0),
    max_seq_length: int = 512,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    seed: int = 1234,
    skip_warmup: bool = True,
    binary_head: bool = True,
    tokenizer: Any = None,
) -> tuple[Any, Any, Any]:
    """Rapidformer's BERT pretraining datasets, with its argument names: items are the Hugging Face
    ``BertForPreTraining`` inputs (``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels``,
    ``next_sentence_label``) built from sentence-split mmap data (``rapidlite.data.bert_dataset``).

    ``tokenizer`` defaults to ``get_tokenizer()`` (the flags' ``--tokenizer-type`` and vocabulary), as Megatron's
    builder does; ``skip_warmup=False`` reads each ``.bin`` once first (``--mmap-warmup``)."""
    check_mmap_data(data_prefix, data_impl, skip_warmup)
    return build_bert_train_valid_test_datasets(
        data_prefix,
        splits_string,
        train_valid_test_num_samples,
        seq_length=max_seq_length,
        seed=seed,
        tokenizer=get_tokenizer() if tokenizer is None else tokenizer,
        mask_prob=masked_lm_prob,
        short_seq_prob=short_seq_prob,
        binary_head=binary_head,
    )
