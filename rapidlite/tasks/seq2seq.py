"""``--task seq2seq``: fine-tune any ``AutoModelForSeq2SeqLM`` (T5, BART, Marian, Pegasus, ...) on summaries or
translations, as Hugging Face's ``run_summarization``/``run_translation`` do.

The black box is an ordinary ``Finetuner`` subclass. Source/target pairs become token ids
(``rapidlite.data.seq2seq``); the forward step returns ``(loss_sum, num_tokens)`` over the target tokens, so the
loss is token-exact over micro-batches and ranks, and padding (labels -100) is never trained. Evaluation gives
the loss and generates a target for every validation source (``model.generate`` with ``--num-beams`` and at most
``--max-target-length`` tokens; each rank generates for its share and the token ids are gathered), scored with
SacreBLEU (``bleu``) and, for summaries, ROUGE-1/2/L/Lsum (see ``generation_metrics``). The export carries the
generation settings in its ``generation_config.json``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from rapidlite.config.settings import Sections
from rapidlite.data.collate import PadCollator
from rapidlite.data.seq2seq import build_seq2seq_data
from rapidlite.data.tabular import load_raw_datasets
from rapidlite.errors import ConfigError
from rapidlite.models.head import output_logps
from rapidlite.models.hf import load_error, load_hf_model, load_tokenizer, position_limit, within_positions
from rapidlite.observe.progress import hf_datasets_progress
from rapidlite.tasks.seq2seq_spec import max_target_length
from rapidlite.trainer import Finetuner

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
SEQ2SEQ_INSTALL = "pip install 'rapidlite[seq2seq]'"
_SHOWN = 3  # generated texts logged at each evaluation


def load_seq2seq_lm(name: str, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForSeq2SeqLM`` from ``name``; attention through SDPA where the model class has it. ``kwargs``:
    more ``from_pretrained`` arguments (``Trainer.pretrained_load_kwargs``)."""
    from transformers import AutoModelForSeq2SeqLM

    try:
        return load_hf_model(AutoModelForSeq2SeqLM.from_pretrained, name, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing or unfit models
        raise load_error("sequence-to-sequence model", name, e) from None


# ------------------------------------------------------------------------------------------------ metrics
def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (0-100) with SacreBLEU's defaults (13a tokenisation, case-sensitive), from torchmetrics. It
    equals ``sacrebleu.corpus_bleu`` except when some n-gram order has no match in the whole corpus: torchmetrics
    then gives 0, sacrebleu's default exponential smoothing a small positive score."""
    from torchmetrics.functional.text import sacre_bleu_score

    if not predictions:
        return 0.0
    return 100.0 * float(sacre_bleu_score(list(predictions), [[r] for r in references], tokenize="13a"))


@functools.cache
def sentence_splitter() -> tuple[Callable[[str], list[str]], str | None]:
    """``(split, notice)``: nltk's English sentence splitter (punkt), as ``run_summarization`` splits for
    ROUGE-Lsum; where its model is not installed (nltk downloads it, which an offline machine cannot), Punkt's
    untrained rules, with a notice saying so."""
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        notice = (
            "ROUGE-Lsum: nltk's English sentence model (punkt_tab) is not installed, so sentences are split by "
            "Punkt's untrained rules (they may split after abbreviations); python -m nltk.downloader punkt_tab "
            "installs it"
        )
        return PunktSentenceTokenizer().tokenize, notice
    return nltk.sent_tokenize, None


def require_rouge() -> None:
    """ROUGE needs the ``rouge_score`` package (and nltk): one line naming the extra when it is missing."""
    try:
        import nltk  # noqa: F401
        import rouge_score  # noqa: F401
    except ImportError:
        raise ConfigError(f"ROUGE for summaries needs the rouge_score and nltk packages: {SEQ2SEQ_INSTALL}") from None


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F-measures (0-100), averaged over the pairs, as ``run_summarization`` computes them:
    Google's ``rouge_score`` (what Hugging Face's ``evaluate`` wraps) with the Porter stemmer, ROUGE-Lsum over the
    texts' sentences one per line. (The average is the plain mean; ``evaluate`` reports the median of bootstrap
    resamples of it, a random estimate of the same mean.)"""
    from rouge_score import rouge_scorer

    if not predictions:
        return dict.fromkeys(ROUGE_KEYS, 0.0)
    split, _ = sentence_splitter()
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score("\n".join(split(reference)), "\n".join(split(prediction)))
        for key in ROUGE_KEYS:
            totals[key] += scores[key].fmeasure
    return {key: 100.0 * total / len(predictions) for key, total in totals.items()}


def generation_metrics(predictions: Sequence[str], references: Sequence[str], with_rouge: bool) -> dict[str, float]:
    """``bleu`` and, ``with_rouge``, ``rouge1``/``rouge2``/``rougeL``/``rougeLsum`` of stripped texts."""
    predictions = [p.strip() for p in predictions]
    references = [r.strip() for r in references]
    metrics = {"bleu": bleu(predictions, references)}
    if with_rouge:
        metrics.update(rouge(predictions, references))
    return metrics


def generated_lengths(ids: torch.Tensor, eos: int | list[int] | None, pad: int) -> torch.Tensor:
    """Tokens ``generate`` produced per row of ``ids`` (which start with the decoder's start token): through the
    first end-of-sequence token, or every token but padding in a row that never ended. (Beam search fills a
    finished row with end tokens, so counting what is not padding would count those too.)"""
    body = ids[:, 1:]
    ends = torch.isin(body, torch.tensor([] if eos is None else eos, dtype=body.dtype).reshape(-1))
    first_end = ends.int().argmax(dim=1) + 1
    return torch.where(ends.any(dim=1), first_end, (body != pad).sum(dim=1))


def _pad_columns(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """``tensor`` [rows, <= width] right-padded to ``width`` columns (ranks' gathered rows must be one width)."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return F.pad(tensor, (0, width - tensor.shape[1]), value=value)


# ------------------------------------------------------------------------------------------------ the task
class Seq2SeqFinetuner(Finetuner):
    """Summarisation or translation with an encoder-decoder model; the loss trains the target tokens."""

    with_rouge = False  # summaries are scored by ROUGE too (set from the data)
    target_length = 128
    _told_splitter = False

    def train_valid_test_datasets_provider(self):
        settings = self.settings
        name = settings.model.pretrained_model_name_or_path
        seq_length, target_length = self._lengths(name)
        self.tokenizer = load_tokenizer(name)
        if self.tokenizer.pad_token_id is None:
            raise ConfigError(f"--pretrained-model-name-or-path {name}: the tokenizer has no padding token")
        with hf_datasets_progress(self.show_progress):
            raw = load_raw_datasets(
                *settings.data.source, settings.training.seed, eval_only=settings.training.eval_only
            )
            self.data = build_seq2seq_data(
                raw,
                self.tokenizer,
                seq_length,
                target_length,
                text_keys=settings.data.text_keys,
                label_key=settings.data.label_key,
                source_lang=settings.task_options.source_lang,
                target_lang=settings.task_options.target_lang,
                source_prefix=settings.task_options.source_prefix,
            )
        d = self.data
        # Translations are scored by BLEU (run_translation); summaries by ROUGE too (run_summarization).
        self.with_rouge = not d.columns.translation
        if self.with_rouge:
            require_rouge()
        valid = len(d.validation) if d.validation is not None else 0
        prefix = settings.task_options.source_prefix
        self.logger.info(
            f"data: {d.columns.describe()}"
            f"{f', source prefix {prefix!r}' if prefix else ''} | {len(d.train)} train / "
            f"{valid} validation pairs | {d.truncated_sources} sources cut to --seq-length {seq_length}, "
            f"{d.truncated_targets} targets cut to --max-target-length {target_length}"
        )
        self.target_length = target_length
        return d.train, d.validation, d.test, PadCollator.for_tokenizer(self.tokenizer)

    def _lengths(self, name: str) -> tuple[int, int]:
        """``--seq-length`` (the task's default 1024) and ``--max-target-length`` (default 128), within the model's
        position table: a default is lowered to it, a length asked for beyond it is refused. A model that is no
        sequence-to-sequence model is refused here, before any data is read."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

        settings = self.settings
        try:
            config = AutoConfig.from_pretrained(name)
        except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
            raise load_error("sequence-to-sequence model", name, e) from None
        if config.model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(
                f"--pretrained-model-name-or-path {name}: a {config.model_type} model is not a sequence-to-sequence "
                "model (AutoModelForSeq2SeqLM: T5, BART, Marian, Pegasus, ...); --task causal_lm fine-tunes "
                "decoder-only models"
            )
        limit = position_limit(config)  # None for T5's relative position buckets: no table to run past
        refusal = "the model has {limit} positions (max_position_embeddings); use at most {limit}"
        source = within_positions(settings.data.seq_length, limit, settings.given("seq_length"), refusal)
        target_given = settings.task_options.max_target_length is not None
        target = max_target_length(settings)
        return source, within_positions(target, limit, target_given, refusal, flag="--max-target-length")

    def model_optimizer_lr_scheduler_provider(self):
        settings = self.settings
        model = load_seq2seq_lm(settings.model.pretrained_model_name_or_path, **self.pretrained_load_kwargs())
        if model.config.model_type in ("t5", "mt5", "umt5") and not settings.task_options.source_prefix:
            self.logger.warning(
                "T5 checkpoints were trained with a task prefix: pass --source-prefix 'summarize: ' (or "
                "'translate English to German: ', ...) unless this model was fine-tuned without one"
            )
        # The settings evaluation generates with are the model's own, exported with it (generation_config.json):
        # generate() on the exported model produces what the run scored.
        generation = model.generation_config
        generation.max_new_tokens = self.target_length
        generation.max_length = None
        if settings.task_options.num_beams is not None:
            generation.num_beams = settings.task_options.num_beams
        return model, None, None

    def begin_training(self) -> None:
        if self.settings.task.demo and self.iteration == 0:
            self.evaluate("validation")  # the untrained model's scores: what the demo's learning is measured against
        super().begin_training()  # after it, so the first interval's rates count training only

    def _hf_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face model inside the backend's wrapper and a LoRA wrapper."""
        from rapidlite.models import lora

        return lora.unwrap(self.engine.strategy.module(model))

    def _logps(self, batch: dict[str, torch.Tensor], model: torch.nn.Module, sum_only: bool) -> torch.Tensor:
        """The log-probabilities of the targets: per position ``[B, T]`` (0 at -100), or ``sum_only`` their sum;
        through the chunked output layer where it serves the model (``output_logps``)."""
        # The decoder reads the targets shifted right (the model's own rule: its start token first, -100 as
        # padding), and the loss is taken here, so the model computes none.
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        shift = self._hf_model(model).prepare_decoder_input_ids_from_labels
        inputs["decoder_input_ids"] = shift(labels=batch["labels"])
        inputs["use_cache"] = False
        chunked = self.settings.model.chunked_loss
        return output_logps(model, inputs, batch["labels"], shift=False, sum_only=sum_only, chunked=chunked)

    def run_forward_step(self, batch, model):
        return -self._logps(batch, model, sum_only=True), self.count_items(batch)

    def count_items(self, batch: dict[str, Any]) -> int:
        """The target tokens the loss sums over (padding is -100)."""
        return int((batch["labels"] != -100).sum().item())

    def run_compute_metrics(self, model, eval_dataloader) -> dict[str, Any]:
        """The token-exact loss and the generation metrics of every validation pair, over all ranks."""
        model = model[0]
        pad = self.tokenizer.pad_token_id
        width = self.target_length + 1  # the decoder's start token and at most --max-target-length more
        losses, counts, generated, references = [], [], [], []
        for batch in eval_dataloader:
            labels = batch["labels"]
            losses.append(self.gather(-self._logps(batch, model, sum_only=False).sum(dim=1).double()))
            counts.append(self.gather((labels != -100).sum(dim=1)))
            ids = self.generate(model, batch["input_ids"], batch["attention_mask"])
            generated.append(self.gather(_pad_columns(ids, width, pad)))
            references.append(self.gather(_pad_columns(labels, self.target_length, -100)))
        loss = float(torch.cat(losses).sum() / torch.cat(counts).sum().clamp(min=1))
        predictions_ids = torch.cat(generated).cpu()
        references_ids = torch.cat(references).cpu()
        references_ids = references_ids.masked_fill(references_ids == -100, pad)
        predictions = self.tokenizer.batch_decode(predictions_ids, skip_special_tokens=True)
        references_text = self.tokenizer.batch_decode(references_ids, skip_special_tokens=True)
        metrics: dict[str, Any] = {"loss": loss}
        metrics.update(generation_metrics(predictions, references_text, self.with_rouge))
        eos = self._hf_model(model).generation_config.eos_token_id
        lengths = generated_lengths(predictions_ids, eos, pad)
        metrics["gen_len"] = float(lengths.double().mean()) if len(predictions) else 0.0
        self._show(predictions, references_text)
        return metrics

    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token ids ``model`` generates for a batch of sources, with its generation config (``--num-beams``,
        ``--max-target-length``). Every rank runs it for its share of every evaluation batch, and with several
        ranks every rank runs the same number of forward passes (``synced_gpus``: a rank whose sequences are
        done keeps stepping until all are), since a forward under ZeRO-3/FSDP gathers parameters collectively."""
        hf_model = self._hf_model(model)
        config = copy.deepcopy(hf_model.generation_config)
        config.use_cache = True  # training turned the model's cache off (rapidlite.models.hf.disable_kv_cache)
        with self.engine.strategy.whole_parameters(model), self.engine.precision.autocast():
            return hf_model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                synced_gpus=self.engine.world_size > 1,
            )

    def _show(self, predictions: list[str], references: list[str]) -> None:
        if not self.engine.is_main_process:
            return
        lines = [f"  {p[:100]!r} <- reference {r[:100]!r}" for p, r in zip(predictions, references, strict=False)]
        self.logger.info(f"generated for {len(predictions)} validation sources, e.g.:\n" + "\n".join(lines[:_SHOWN]))
        notice = sentence_splitter()[1] if self.with_rouge else None
        if notice and not self._told_splitter:
            self._told_splitter = True
            self.logger.info(notice)


def trainer_for(settings: Sections) -> type[Seq2SeqFinetuner]:
    """The task registry's entry point: the trainer class for these flags."""
    return Seq2SeqFinetuner
