"""``--task pretraining``: a ``PreTrainer`` over Megatron mmap data, model chosen by family.

==========================================  =============================================================
``--pretrained-model-name-or-path``         model and data
==========================================  =============================================================
(none)                                      the built-in GPT (``rapidlite.models.gpt``), GPT dataset
a causal config (GPT-2, LLaMA, Mistral...)  ``AutoModelForCausalLM.from_config``, GPT dataset
a BERT config                               ``BertForPreTraining`` (``BertForMaskedLM`` with
                                            ``--no-binary-head``), BERT dataset (masked LM + NSP)
==========================================  =============================================================

The name (or directory) gives the architecture; its weights are loaded only with
``--load-pretrained-weights``. The tokenizer comes from ``--tokenizer-type`` and its files (Megatron's
flags), else from the model directory; it must be the one the data was preprocessed with: its EOD id
separates documents and its vocabulary sizes the model. Without ``--data-path`` the run uses the embedded
corpus (``rapidlite.tasks.pretraining_demo``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.gpt_dataset import SampleCutter, build_train_valid_test_datasets, document_ids, gpt_batch
from rapidlite.data.streaming import TokenStream, stack_samples, stream_source
from rapidlite.data.tokenizers import tokenizer_of
from rapidlite.errors import ConfigError, first_line
from rapidlite.models.head import chunkable_head, local_result, model_logits, output_logps, returns_logps
from rapidlite.models.hf import check_positions, load_config, load_hf_model, override_sizes
from rapidlite.models.padding_free import segments
from rapidlite.parallel.context_parallel import shard_batch
from rapidlite.tasks.pretraining_spec import model_family
from rapidlite.trainer.pretrainer import PreTrainer


def hf_causal_lm(settings: Sections, vocab_size: int) -> torch.nn.Module:
    """A Hugging Face causal LM built from the named config (layer sizes overridable), weights on request;
    attention through SDPA where the model class has it."""
    from transformers import AutoModelForCausalLM

    name = settings.model.pretrained_model_name_or_path
    if settings.model.load_pretrained_weights:
        model = _load_weights(AutoModelForCausalLM.from_pretrained, name, "causal language model")
        check_positions(model, settings.data.seq_length, name)
        return model
    config = load_config(name)
    override_sizes(config, settings.model, settings.data.seq_length, vocab_size)
    return load_hf_model(AutoModelForCausalLM.from_config, config)


def _load_weights(load: Any, name: str, what: str) -> torch.nn.Module:
    """``--load-pretrained-weights``: the weights in fp32 (a bf16 file too), or one line saying why not (a
    directory holding only a config, say)."""
    try:
        return load_hf_model(load, name, dtype=torch.float32)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing weights
        raise ConfigError(
            f"--pretrained-model-name-or-path {name} --load-pretrained-weights: cannot load the {what}'s weights "
            f"({first_line(e, 160)}); name a directory or hub model with weights, or leave out "
            "--load-pretrained-weights to train from the config"
        ) from None


def hf_bert_pretraining(settings: Sections, vocab_size: int) -> torch.nn.Module:
    """``BertForPreTraining`` (``BertForMaskedLM`` with ``--no-binary-head``) built from the named config
    (layer sizes overridable, vocabulary and positions grown to the data's), weights on request; attention
    through SDPA."""
    from transformers import (
        AutoModelForMaskedLM,
        AutoModelForPreTraining,
        BertForMaskedLM,
        BertForPreTraining,
    )

    name = settings.model.pretrained_model_name_or_path
    if settings.model.load_pretrained_weights:
        cls = BertForPreTraining if settings.data.binary_head else BertForMaskedLM
        model = _load_weights(cls.from_pretrained, name, "BERT model")
        check_positions(model, settings.data.seq_length, name)
        return model
    config = load_config(name)
    override_sizes(config, settings.model, settings.data.seq_length, vocab_size)
    # The auto classes map a BERT config to BertForPreTraining / BertForMaskedLM; unlike the classes' own
    # constructors, their from_config takes the attention implementation.
    auto = AutoModelForPreTraining if settings.data.binary_head else AutoModelForMaskedLM
    return load_hf_model(auto.from_config, config)


def _need_seq_length(settings: Sections) -> None:
    # --task pretraining fills it in (its TaskSpec's default); a user script using these trainers gives it.
    if settings.data.seq_length is None:
        raise ConfigError("pretraining needs --seq-length N (--task pretraining defaults it to 1024, 512 for BERT)")


def data_token_ids(data_tokenizer: Any) -> tuple[int, str]:
    """What the data's ids need of a pretraining model: the data tokenizer's vocabulary (every id was checked
    against it when the data was opened)."""
    return data_tokenizer.vocab_size, f"the data's tokenizer has {data_tokenizer.vocab_size} ids"


class GPTPretrainer(PreTrainer):
    """Causal language modelling on the GPT dataset, for the built-in GPT and Hugging Face causal LMs."""

    def __init__(self, engine: Any = None) -> None:
        super().__init__(engine)
        settings = self.settings
        self.hf = settings.model.pretrained_model_name_or_path is not None
        self.data_tokenizer = tokenizer_of(settings)
        self.tokenizer = self.data_tokenizer.hf_tokenizer()  # exported beside the model in DIR/hf
        self._cp_reported = False
        _need_seq_length(settings)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        settings = self.settings
        if settings.data.streaming:
            return self.streamed_data()
        return build_train_valid_test_datasets(
            data_prefix=settings.data.data_path,
            splits_string=settings.data.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=settings.data.seq_length,
            seed=settings.training.seed,
            data_impl=settings.data.data_impl,
            skip_warmup=not settings.data.mmap_warmup,
            vocab_size=self.data_tokenizer.vocab_size,
        )

    def streamed_data(self) -> tuple[TokenStream, TokenStream | None, None, None]:
        """``--streaming``: documents (their ``text``) tokenized in the loader workers with EOD appended, and cut
        into GPT samples in order (``SampleCutter``): the training stream, and the validation file's if there is
        one (``rapidlite.data.streaming.stream_source``)."""
        settings = self.settings
        if self.data_tokenizer.eod is None:
            raise ConfigError("--streaming: the tokenizer has no end-of-document id to separate documents with")
        source = stream_source(settings.data.data_path[0])

        def stream(path: str) -> TokenStream:
            return TokenStream(
                path,
                functools.partial(document_ids, tokenizer=self.data_tokenizer),
                SampleCutter(settings.data.seq_length),
                settings.batching.micro_batch_size,
                stack_samples,
                rank=self.engine.dp_rank,
                world_size=self.engine.dp_size,
                num_workers=settings.data.num_workers,
            )

        self.logger.info(
            f"data: streaming {source.train} ({settings.data.num_workers} loader workers); validation: "
            f"{source.validation or 'none'}"
        )
        return stream(source.train), stream(source.validation) if source.validation else None, None, None

    def token_ids_needed(self) -> tuple[int, str]:
        return data_token_ids(self.data_tokenizer)

    def model_optimizer_lr_scheduler_provider(self):
        settings = self.settings
        vocab_size = self.data_tokenizer.vocab_size
        if self.hf:
            return hf_causal_lm(settings, vocab_size), None, None
        from rapidlite.models.gpt import GPTConfig, GPTModel

        model = GPTModel(GPTConfig.of(settings, vocab_size))
        model.chunked_loss = settings.model.chunked_loss
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        settings = self.settings
        batch = gpt_batch(
            next(data_iterator)["text"],
            self.data_tokenizer.eod,
            eod_mask_loss=settings.data.eod_mask_loss,
            reset_position_ids=settings.data.reset_position_ids,
            reset_attention_mask=settings.data.reset_attention_mask,
        )
        if self.hf and batch["attention_mask"] is not None:
            raise ConfigError(
                "--reset-attention-mask works with the built-in GPT only; drop it for Hugging Face models"
            )
        topology, cp_args = self.engine.dist.topology, {}
        if topology.cp > 1:  # this rank's shard of each sequence; the documents go by number, not by mask
            if self.hf and settings.data.reset_position_ids:  # a Hugging Face decoder's packed documents
                batch["segment_ids"] = segments(batch["position_ids"])
            length = batch["input_ids"].shape[1]
            batch = shard_batch({**batch, "attention_mask": None}, topology.cp, self.engine.dist.cp_rank)
            cp_args = {"cp_segment_ids" if self.hf else "segment_ids": batch["segment_ids"]}
            if not self._cp_reported:
                self._cp_reported = True
                self.logger.info(
                    f"context parallelism: this rank trains {batch['input_ids'].shape[1]} of the {length} tokens "
                    f"of each sequence ({settings.parallel.cp_comm_type})"
                )
        if not self.hf:
            return model(
                batch["input_ids"],
                position_ids=batch["position_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                loss_mask=batch["loss_mask"],
                **cp_args,
            )
        keep = batch["loss_mask"] > 0
        labels = batch["labels"].masked_fill(~keep, -100)
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], **cp_args}
        logp_sum = output_logps(model, inputs, labels, shift=False, sum_only=True, chunked=settings.model.chunked_loss)
        return -logp_sum, int(keep.sum().item())


class BertPretrainer(PreTrainer):
    """Megatron's BERT pretraining: masked LM plus next-sentence prediction (``--no-binary-head``: masked LM
    only) on sentence-split data, with ``BertForPreTraining`` (``BertForMaskedLM``) built from the config."""

    def __init__(self, engine: Any = None) -> None:
        super().__init__(engine)
        settings = self.settings
        self.data_tokenizer = tokenizer_of(settings)
        self.tokenizer = self.data_tokenizer.hf_tokenizer()  # exported beside the model in DIR/hf
        if getattr(self.data_tokenizer, "mask", None) is None or getattr(self.data_tokenizer, "cls", None) is None:
            raise ConfigError(
                "BERT pretraining needs a WordPiece tokenizer with [CLS]/[SEP]/[MASK]: --tokenizer-type "
                "BertWordPieceLowerCase (or BertWordPieceCase) --vocab-file vocab.txt"
            )
        _need_seq_length(settings)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        from rapidlite.data.bert_dataset import build_bert_train_valid_test_datasets

        settings = self.settings
        return build_bert_train_valid_test_datasets(
            data_prefix=settings.data.data_path,
            splits_string=settings.data.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=settings.data.seq_length,
            seed=settings.training.seed,
            tokenizer=self.data_tokenizer,
            mask_prob=settings.data.mask_prob,
            short_seq_prob=settings.data.short_seq_prob,
            binary_head=settings.data.binary_head,
        )

    def token_ids_needed(self) -> tuple[int, str]:
        return data_token_ids(self.data_tokenizer)

    def model_optimizer_lr_scheduler_provider(self):
        return hf_bert_pretraining(self.settings, self.data_tokenizer.vocab_size), None, None

    def run_forward_step(self, data_iterator, model):
        batch = dict(next(data_iterator))
        if not self.settings.data.binary_head:
            batch.pop("next_sentence_label", None)
        return bert_loss(model, batch, chunked=self.settings.model.chunked_loss)


def bert_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunked: bool = True) -> torch.Tensor:
    """The loss ``BertForPreTraining`` (``BertForMaskedLM``) computes for ``batch`` (its ``labels`` and, for
    next-sentence prediction, ``next_sentence_label``), with the masked-LM part through the chunked output
    layer where it serves the model: the mean over the masked tokens, plus next-sentence prediction's mean."""
    head = chunkable_head(model) if chunked else None
    if head is None:
        return model(**batch).loss
    batch = dict(batch)
    labels, next_sentence = batch.pop("labels"), batch.pop("next_sentence_label", None)
    with returns_logps(head, labels, sum_only=True):
        out = model(**batch)
    logp_sum = local_result(model_logits(out))
    loss = -logp_sum / (labels != -100).sum()
    if next_sentence is not None:
        loss = loss + F.cross_entropy(out.seq_relationship_logits.view(-1, 2), next_sentence.view(-1))
    return loss


def pretrainer_for(settings: Sections) -> type[PreTrainer]:
    """The trainer of ``--task pretraining`` for this model family."""
    return BertPretrainer if model_family(settings.model.pretrained_model_name_or_path) == "bert" else GPTPretrainer
