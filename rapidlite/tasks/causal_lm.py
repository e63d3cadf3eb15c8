"""``--task causal_lm``: fine-tune any ``AutoModelForCausalLM`` on instructions, prompt/response pairs, chats or text.

The black box is an ordinary ``Finetuner`` subclass. Rows become token ids whose labels train the response
only (``rapidlite.data.instruction``); the forward step returns ``(loss_sum, num_items)`` so the loss is
token-exact over micro-batches and ranks; evaluation adds perplexity and, with ``--eval-generate N``, greedy
completions of N validation prompts with their exact-match score.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rapidlite.config.settings import Sections
from rapidlite.config.tasks import get_task
from rapidlite.data.instruction import (
    CausalLMCollator,
    build_instruction_data,
    detect_format,
    doubled_bos,
    load_template,
    row_pieces,
    set_chat_template,
)
from rapidlite.data.packing import Packer
from rapidlite.data.streaming import TokenStream, Unpacked, first_row, stream_source, validation_rows
from rapidlite.data.tabular import load_raw_datasets
from rapidlite.data.vision import has_images
from rapidlite.errors import ConfigError
from rapidlite.models import lora
from rapidlite.models.head import output_logps
from rapidlite.models.hf import load_error, load_hf_model, load_tokenizer, position_limit, within_positions
from rapidlite.models.padding_free import POSITIONS, TOKEN, PackedPlan, packs_exactly
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.parallel.context_parallel import shard_causal_batch
from rapidlite.tasks.vision_language import VisionLanguage, data_has_images
from rapidlite.trainer import Finetuner
from rapidlite.trainer.base import perplexity

MAX_NEW_TOKENS = 64
_CHATML_END = "<|im_end|>"


def load_causal_lm(name: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from ``name``; attention through SDPA where the model class has it. ``kwargs``:
    more ``from_pretrained`` arguments (``Trainer.pretrained_load_kwargs``)."""
    from transformers import AutoModelForCausalLM

    try:
        return load_hf_model(AutoModelForCausalLM.from_pretrained, name, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("causal language model", name, e) from None


def honours_packed_positions(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps attention inside each packed sample when given restarting position ids and no
    attention mask: packed samples' hidden states and logits equal theirs alone. Decided by running it (a 7-token
    forward, ``rapidlite.models.padding_free``), since which model classes read packed position ids differs
    between transformers versions."""
    return packs_exactly(model, PackedPlan(TOKEN, POSITIONS, shift_labels=True))


def model_config(name: str) -> Any:
    """The model's ``AutoConfig``, or None when it cannot be read (the model load then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception:  # transformers raises OSError/ValueError/HTTP errors; the model's own load reports them
        return None


def config_vocab_size(config: Any) -> int | None:
    """The vocabulary size a model config declares, or None."""
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) else None


def causal_seq_length(seq_length: int | None, config: Any, explicit: bool = True, task: str = "causal_lm") -> int:
    """``--seq-length`` (``task``'s default when none is given or not ``explicit``) within the model's learned
    position table, which a longer row would index past: the default is lowered to it, a longer explicit value
    is one line."""
    limit = position_limit(config) if config is not None else None
    seq_length = seq_length or get_task(task).defaults["seq_length"]
    refusal = "the model's learned positions end at {limit} tokens; use --seq-length {limit}"
    return within_positions(seq_length, limit, explicit, refusal)


def choose_pad(tokenizer: Any, vocab_size: int | None, logger: Any) -> int:
    """The id rows are padded with (padding is masked out of attention and loss, so any id in the model's
    vocabulary serves): the tokenizer's pad token when the model has it, else its EOS (the custom for causal
    LMs), BOS or UNK, which becomes the tokenizer's pad token; with none of them, id 0 (the tokenizer keeps no
    pad token)."""

    def fits(token_id: int | None) -> bool:
        return token_id is not None and (vocab_size is None or token_id < vocab_size)

    pad = tokenizer.pad_token_id
    if fits(pad):
        return pad
    for name in ("eos_token", "bos_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        if token is not None and fits(getattr(tokenizer, f"{name}_id", None)):
            if pad is not None:
                logger.info(
                    f"the tokenizer's pad token {tokenizer.pad_token!r} (id {pad}) is outside the model's "
                    f"{vocab_size}-token vocabulary; padding with {token!r} instead"
                )
            tokenizer.pad_token = token
            return tokenizer.pad_token_id
    return 0


def _strip_end(text: str) -> str:
    return text.split(_CHATML_END)[0].strip()


class CausalLMFinetuner(VisionLanguage, Finetuner):
    """Supervised fine-tuning of a causal language model; the loss trains the labelled (response) tokens."""

    task_name = "causal_lm"  # whose TaskSpec gives the default sequence length

    def tokenizer_and_data_source(self) -> tuple[Any, int, int]:
        """The tokenizer (of the adapter when it has one, else of the base model; ``--chat-template`` applied),
        and ``(raw splits, sequence length, pad id)``: what every causal-LM task starts from."""
        settings = self.settings
        # A LoRA adapter (rapidlite's DIR/hf/adapter, or DIR/hf of a run without --merge-lora) runs on its base.
        self.adapter = lora.adapter_directory(settings.model.pretrained_model_name_or_path)
        self.base_name = (
            lora.adapter_base(self.adapter) if self.adapter else settings.model.pretrained_model_name_or_path
        )
        has_tokenizer = self.adapter is not None and (self.adapter / "tokenizer_config.json").is_file()
        self.tokenizer = load_tokenizer(str(self.adapter) if has_tokenizer else self.base_name)
        config = self.model_config_ = model_config(self.base_name)
        pad_id = self.pad_token_id = choose_pad(self.tokenizer, config_vocab_size(config), self.logger)
        set_chat_template(self.tokenizer, settings.task.chat_template)
        seq_length = causal_seq_length(
            settings.data.seq_length, config, explicit=settings.given("seq_length"), task=self.task_name
        )
        if settings.data.streaming:  # the training rows are read as the run consumes them (streamed_data)
            return None, seq_length, pad_id
        with hf_datasets_progress(self.show_progress):
            raw = load_raw_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
        if not get_task(self.task_name).images and data_has_images(raw):
            raise ConfigError(
                f"--task {self.task_name}: the data has images, which this task does not read; images train with "
                "--task causal_lm and --task dpo"
            )
        return raw, seq_length, pad_id

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        raw, seq_length, pad_id = self.tokenizer_and_data_source()
        if settings.data.streaming:
            return self.streamed_data(seq_length, pad_id)
        self.images = self.vision_run(raw)
        if self.images:
            return self.vision_data(raw, seq_length, pad_id)
        self.data = build_instruction_data(
            raw,
            self.tokenizer,
            seq_length,
            prompt_key=settings.task_options.prompt_key,
            response_key=settings.task_options.response_key,
            template=settings.task.prompt_template,
            train_on_prompt=settings.task_options.train_on_prompt,
            packing=settings.task.packing,
            progress=self.show_progress,
        )
        d = self.data
        valid = len(d.validation) if d.validation is not None else 0
        self.logger.info(
            f"data: {d.rows} rows, format {d.fmt.kind}, template {settings.task.prompt_template}"
            f"{', chat template ' + settings.task.chat_template if settings.task.chat_template else ''}, "
            f"{d.truncated} truncated to --seq-length {seq_length}"
            f"{f', {d.windowed} texts split into windows of it' if d.windowed else ''}"
            f"{f', {d.dropped} dropped with no response token left' if d.dropped else ''}"
            f"{''.join(f', {n} skipped with no {field}' for field, n in sorted(d.skipped.items()))}, "
            f"{d.trained_tokens / max(d.tokens, 1):.1%} of tokens trained | "
            f"{len(d.train)} train / {valid} validation {'packed sequences' if settings.task.packing else 'samples'}"
        )
        if settings.task.eval_generate and not d.prompts:
            self.logger.info("--eval-generate: the validation data has no prompts to complete; nothing is generated")
        self.max_token_id = max(
            (max(row["input_ids"], default=-1) for split in (d.train, d.validation, d.test) for row in split or ()),
            default=-1,
        )
        return d.train, d.validation, d.test, CausalLMCollator(pad_id)

    def streamed_data(self, seq_length: int, pad_id: int) -> tuple[TokenStream, Any, None, CausalLMCollator]:
        """``--streaming``: the training rows as a ``TokenStream`` (encoded in the loader workers by
        ``encode_row``, packed in order with ``--packing``), and the held-out validation file encoded up front."""
        settings, task, options = self.settings, self.settings.task, self.settings.task_options
        source = stream_source(settings.data.data_path[0])
        row = first_row(source.train)
        if has_images(row):
            raise ConfigError("--streaming: not built for data with images yet; drop --streaming")
        fmt = detect_format(list(row), options.prompt_key, options.response_key)
        encode = functools.partial(
            row_pieces,
            fmt=fmt,
            template=load_template(task.prompt_template),
            tokenizer=self.tokenizer,
            seq_length=seq_length,
            train_on_prompt=options.train_on_prompt,
        )
        stream = TokenStream(
            source.train,
            encode,
            Packer(seq_length) if task.packing else Unpacked(),
            settings.batching.micro_batch_size,
            CausalLMCollator(pad_id),
            rank=self.engine.dp_rank,
            world_size=self.engine.dp_size,
            num_workers=settings.data.num_workers,
        )
        valid = validation_rows(source)
        self.data = None
        if valid is not None:
            self.data = build_instruction_data(
                valid,
                self.tokenizer,
                seq_length,
                prompt_key=options.prompt_key,
                response_key=options.response_key,
                template=task.prompt_template,
                train_on_prompt=options.train_on_prompt,
                packing=task.packing,
            )
        self.logger.info(
            f"data: streaming {source.train} (format {fmt.kind}, {'packed' if task.packing else 'unpacked'}, "
            f"{settings.data.num_workers} loader workers); validation: "
            + (f"{source.validation}, {len(self.data.validation)} samples" if valid is not None else "none")
        )
        return stream, self.data.validation if valid is not None else None, None, CausalLMCollator(pad_id)

    def model_optimizer_lr_scheduler_provider(self):
        # A subclass may provide its own data: the adapter and base then follow from the flag alone.
        adapter = getattr(self, "adapter", lora.adapter_directory(self.settings.model.pretrained_model_name_or_path))
        base_name = lora.adapter_base(adapter) if adapter else self.settings.model.pretrained_model_name_or_path
        model = (
            self.vision_model(base_name) if self.images else load_causal_lm(base_name, **self.pretrained_load_kwargs())
        )
        if adapter is not None:
            model = lora.load_adapter(model, adapter)
            self.logger.info(f"LoRA adapter {adapter} on its base {base_name}")
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.fit_embeddings(model)
        if self.settings.task.packing and not self.images and not honours_packed_positions(model):
            raise ConfigError(
                f"--packing: {type(model).__name__} does not keep attention inside packed samples (it ignores "
                "restarting position ids); drop --packing"
            )
        return model, None, None

    def fit_embeddings(self, model: torch.nn.Module) -> None:
        """A tokenizer with more tokens than the model's embeddings (tokens added to it) whose added tokens occur in
        the data: full fine-tuning grows the embeddings to the tokenizer (the new rows are trained and exported);
        adapters cannot, so that is one line."""
        try:
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # not a Hugging Face model, or one without the accessor
            return
        rows = getattr(embeddings, "num_embeddings", None)
        max_token_id = getattr(self, "max_token_id", -1)  # -1: a subclass's own data, not looked into
        if rows is None or max_token_id < rows:
            return
        size = len(self.tokenizer)
        if self.settings.lora.lora_rank or lora.is_peft_model(model):
            raise ConfigError(
                f"--lora-rank: the data has token id {max_token_id} but the model's embeddings end at {rows - 1} "
                f"(the tokenizer has {size} tokens); adapters cannot grow them: save the model resized with "
                "resize_token_embeddings(len(tokenizer)) first, or train without --lora-rank"
            )
        model.resize_token_embeddings(max(size, max_token_id + 1))
        self.logger.info(
            f"the tokenizer has {size} tokens and the model's embeddings {rows}: grew them to "
            f"{model.get_input_embeddings().num_embeddings} (the new rows train with the rest and are exported)"
        )

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's scores: what the demo's learning is measured against
        super().begin_training()  # after it, so the first interval's rates count training only

    def run_forward_step(self, batch, model):
        topology = self.engine.dist.topology
        if topology.cp > 1:  # this rank's shard of each sequence, the labels shifted on the whole of it
            inputs, targets = shard_causal_batch(batch, topology.cp, self.engine.dist.cp_rank, self.pad_token_id)
            logp_sum = output_logps(
                model, {**inputs, "use_cache": False}, targets, shift=False, sum_only=True,
                chunked=self.settings.model.chunked_loss,
            )  # fmt: skip
            return -logp_sum, int((targets != -100).sum().item())
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inputs["use_cache"] = False
        # Token t predicts token t+1; the sum over labelled targets is exact for any batching.
        logp_sum = output_logps(
            model, inputs, labels, shift=True, sum_only=True, chunked=self.settings.model.chunked_loss
        )
        return -logp_sum, self.count_items(batch)

    def count_items(self, batch: dict[str, Any]) -> int:
        """The targets the loss sums over: every labelled token but a row's first (token t predicts t+1)."""
        return int((batch["labels"][:, 1:] != -100).sum().item())

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        metrics = super().run_compute_metrics(model, eval_dataloader)
        metrics["ppl"] = perplexity(metrics["loss"])
        if self.settings.task.eval_generate and self.images:
            metrics["exact_match"] = self.vision_generate_and_score(model[0], self.settings.task.eval_generate)
        elif self.settings.task.eval_generate and self.data.prompts:
            metrics["exact_match"] = self.generate_and_score(
                model[0], self.data.prompts[: self.settings.task.eval_generate]
            )
        return metrics

    def generate(self, model: torch.nn.Module, prompt: str, max_new_tokens: int) -> str:
        """Greedy completion of ``prompt`` until EOS, without a key/value cache (every rank runs it: under
        FSDP or tensor parallelism a forward is collective)."""
        tokenizer = self.tokenizer
        ids = tokenizer(prompt)["input_ids"]
        ids = torch.tensor([ids[1:] if doubled_bos(tokenizer, ids) else ids], device=self.engine.device)
        start = ids.shape[1]
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            token = logits.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token.to(ids.dtype)], dim=1)
            if int(token) == tokenizer.eos_token_id:
                break
        return tokenizer.decode(ids[0, start:], skip_special_tokens=True)

    def generate_and_score(self, model: torch.nn.Module, prompts: list[tuple[str, str]]) -> float:
        """The share of ``prompts`` whose greedy completion equals the reference response (stripped); the
        completions are logged on the main process."""
        hits = 0
        lines = []
        for prompt, reference in prompts:
            budget = min(MAX_NEW_TOKENS, len(self.tokenizer(reference)["input_ids"]) + 16)
            completion = _strip_end(self.generate(model, prompt, budget))
            hit = completion == _strip_end(reference)
            hits += hit
            lines.append(f"  [{'ok' if hit else 'xx'}] {prompt.strip()[-60:]!r} -> {completion[:80]!r}")
        if self.engine.is_main_process:
            self.logger.info(f"greedy completions of {len(prompts)} validation prompts:\n" + "\n".join(lines))
        return hits / len(prompts)


def trainer_for(settings: Sections) -> type[CausalLMFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return CausalLMFinetuner
