"""Scoring a causal LM: continuation log-likelihoods as EleutherAI's lm-eval computes them, shared by ranks; and
scoring preference pairs with a reward model (``RewardScorer``, ``reward``).

Tokenisation follows lm-eval's ``HFLM`` (0.4): a context's trailing spaces move to the continuation;
context and context + continuation are encoded separately (the tokenizer's default special tokens, none
when the text already starts with the BOS string) and the continuation is what the whole adds to the
context; an empty context is the prefix token (BOS, else EOS; a tokenizer with neither conditions on the
continuation's first token, which is then not scored). The model sees
``(context + continuation)[-(L + 1):][:-1]`` (left-truncated to the maximum length ``L``) in right-padded
batches without an attention mask: causal attention keeps padding out of every real token's logits.

Requests are sorted longest first and cut into batches over the whole set; batch ``b`` goes to rank
``b % world``. A batch is the same on 1 rank as on N, so each request's value is computed identically
and the gathered results equal one process's exactly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rapidlite.errors import ConfigError, DataError, first_line
from rapidlite.evaluation.data import MULTIPLE_CHOICE, REWARD, MultipleChoiceItem
from rapidlite.models.chunked_loss import IGNORE
from rapidlite.models.head import output_logps
from rapidlite.runtime.distributed import DistributedContext

# lm-eval's default when neither the config nor the tokenizer gives a length.
DEFAULT_MAX_LENGTH = 2048
_TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no limit" model_max_length

Request = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def model_max_length(config: Any, tokenizer: Any) -> int:
    """The context length lm-eval gives a model: the config's n_positions / max_position_embeddings / n_ctx,
    else the tokenizer's model_max_length, else 2048."""
    config = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit is not None and limit != _TOKENIZER_INFINITY else DEFAULT_MAX_LENGTH


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean from the sample standard deviation (lm-eval's ``mean_stderr``); None
    below two values."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


class _ModelScorer:
    """A Hugging Face model in eval mode with its tokenizer, the longest sequence it scores (the model's, unless
    given), its batch size and device."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_length: int | None = None,
        batch_size: int = 8,
        device: torch.device | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or model_max_length(model.config, tokenizer)
        self.batch_size = batch_size
        self.device = device or next(model.parameters()).device


def _check_model_path(model: str) -> None:
    """A path that is no directory (rather than a Hub name) is one line before anything loads."""
    if not os.path.isdir(model) and (os.path.isabs(model) or model.startswith(".") or model.count("/") > 1):
        raise ConfigError(f"--model {model}: no such directory; give a saved model's directory or a Hub name")


class CausalLMScorer(_ModelScorer):
    """Log-likelihoods of continuations under a Hugging Face causal LM and its tokenizer; ``chunked``: through
    the chunked output layer where it serves the model (``rapidlite.models.head``)."""

    chunked = True

    @property
    def prefix_token_id(self) -> int | None:
        """The token an empty context (and every text document) is conditioned on: BOS, else EOS; None for a
        tokenizer with neither (the first token of the text is the context then)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        """The tokenizer's default special tokens, except when ``text`` already starts with the BOS string."""
        if self.prefix_token_id is None:
            return self.tokenizer.encode(text)
        bos = self.tokenizer.decode(self.prefix_token_id)
        extra = {"add_special_tokens": False} if text.startswith(bos) else {}
        return self.tokenizer.encode(text, **extra)

    def encode_pair(self, context: str, continuation: str) -> Request:
        """``(context tokens, continuation tokens)`` as lm-eval splits them (see the module docstring)."""
        if context == "":
            cont = self.tokenizer.encode(continuation, add_special_tokens=False)
            if cont and (self.prefix_token_id is None or cont[0] == self.prefix_token_id):
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx) :]

    def _check(self, requests: Sequence[Request]) -> None:
        for ctx, cont in requests:
            if not ctx or not cont:
                raise DataError("--data: an ending encodes to no tokens; give every ending some text")
            if len(cont) > self.max_length:
                raise DataError(
                    f"an ending of {len(cont)} tokens is longer than the maximum length {self.max_length}; "
                    "raise --seq-length or shorten the ending"
                )

    @torch.no_grad()
    def _batch(self, requests: Sequence[Request]) -> list[float]:
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in requests]
        width = max(len(x) for x in inputs)
        batch = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            batch[row, : len(tokens)] = torch.tensor(tokens)
        targets = torch.full_like(batch, IGNORE)
        for row, ((_, cont), tokens) in enumerate(zip(requests, inputs, strict=True)):
            targets[row, len(tokens) - len(cont) : len(tokens)] = torch.tensor(cont)
        # float32 log-probabilities (bf16 ones would round each before the sum), chunked where the head allows.
        logps = output_logps(
            self.model, {"input_ids": batch.to(self.device)}, targets.to(self.device), shift=False, chunked=self.chunked
        )
        return logps.sum(dim=1).tolist()

    def loglikelihoods(self, requests: Sequence[Request], ctx: DistributedContext | None = None) -> list[float]:
        """The summed log-probability of each request's continuation given its context, in request order, on
        every rank; the batches are shared out over ``ctx``'s data-parallel ranks (see the module docstring)."""
        self._check(requests)
        order = sorted(range(len(requests)), key=lambda i: (-sum(map(len, requests[i])), requests[i]))
        run = lambda batch: [(v,) for v in self._batch([requests[i] for i in batch])]  # noqa: E731
        return [row[0] for row in shared_out(order, self.batch_size, run, 1, ctx)]


def shared_out(
    order: Sequence[int],
    batch_size: int,
    run: Callable[[list[int]], Sequence[Sequence[float]]],
    width: int,
    ctx: DistributedContext | None = None,
) -> list[tuple[float, ...]]:
    """The ``width`` scores ``run(batch)`` gives each item, by item index, on every rank: the items in ``order``
    are cut into batches of ``batch_size``, shared out over ``ctx``'s data-parallel ranks and gathered. Every rank
    runs as many forwards (a sharded model's forwards are collectives): a rank with a batch fewer runs the first
    batch again and drops its scores."""
    rank, world = (ctx.dp_rank, ctx.dp_size) if ctx is not None else (0, 1)
    batches = [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    mine: list[tuple[float, ...]] = []
    for batch in batches[rank::world]:
        mine += [(i, *values) for i, values in zip(batch, run(batch), strict=True)]
    for _ in range(len(batches[rank::world]), -(-len(batches) // world)):
        run(batches[0])
    local = torch.tensor(mine, dtype=torch.float64).reshape(-1, 1 + width)
    gathered = ctx.all_gather(local) if ctx is not None else local
    values: list[tuple[float, ...]] = [(math.nan,) * width] * len(order)
    for index, *row in gathered.tolist():
        values[int(index)] = tuple(row)
    return values


def choice_metrics(items: Sequence[MultipleChoiceItem], lls: Sequence[float]) -> dict[str, float | int | None]:
    """acc (the ending with the highest summed log-likelihood is the label) and acc_norm (the same after dividing by
    the ending's length in characters), their standard errors, and n; ``lls``: every item's endings' in order."""
    acc, acc_norm, start = [], [], 0
    for item in items:
        scores = np.array(lls[start : start + len(item.endings)], dtype=np.float64)
        start += len(item.endings)
        lengths = np.array([float(len(e)) for e in item.endings])
        acc.append(1.0 if int(np.argmax(scores)) == item.label else 0.0)
        acc_norm.append(1.0 if int(np.argmax(scores / lengths)) == item.label else 0.0)
    return {
        "acc": sum(acc) / len(acc),
        "acc_stderr": mean_stderr(acc),
        "acc_norm": sum(acc_norm) / len(acc_norm),
        "acc_norm_stderr": mean_stderr(acc_norm),
        "n": len(items),
    }


def multiple_choice(
    scorer: CausalLMScorer,
    items: Sequence[MultipleChoiceItem],
    ctx: DistributedContext | None = None,
    target_delimiter: str = " ",
) -> dict[str, float | int | None]:
    """acc (the ending with the highest summed log-likelihood is the label) and acc_norm (the same after
    dividing by the ending's length in characters), their standard errors, and n: lm-eval's multiple_choice
    with the continuation ``target_delimiter + ending``."""
    requests = [scorer.encode_pair(item.context, target_delimiter + e) for item in items for e in item.endings]
    return choice_metrics(items, scorer.loglikelihoods(requests, ctx))


def text_windows(scorer: CausalLMScorer, text: str) -> list[Request]:
    """One document as requests that predict each of its tokens once: conditioned on the prefix token (BOS,
    else EOS), no EOS appended, in consecutive windows of ``max_length`` predicted tokens, each window seeing
    its own tokens and the one before it (lm-eval's rolling windows with one token of context). A tokenizer
    with neither BOS nor EOS: the first token is the context, every later one is predicted."""
    tokens = scorer.tokenizer.encode(text, add_special_tokens=False)
    if scorer.prefix_token_id is None:
        sequence, tokens = tokens, tokens[1:]
    else:
        sequence = [scorer.prefix_token_id, *tokens]
    step = scorer.max_length
    return [(sequence[start : start + 1], tokens[start : start + step]) for start in range(0, len(tokens), step)]


def perplexity(
    scorer: CausalLMScorer, texts: Sequence[str], ctx: DistributedContext | None = None
) -> dict[str, float | int]:
    """Token-level perplexity over the documents, ``exp(total NLL / predicted tokens)``, with that mean loss,
    the token count and n (documents)."""
    requests = [request for text in texts for request in text_windows(scorer, text)]
    if not requests:
        raise DataError("every text is empty: there is no token to predict")
    lls = scorer.loglikelihoods(requests, ctx)
    tokens = sum(len(cont) for _, cont in requests)
    loss = -sum(lls) / tokens
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": tokens, "n": len(texts)}


def load_scorer(
    model: str,
    max_length: int | None = None,
    batch_size: int = 8,
    bf16: bool = False,
    device: torch.device | None = None,
) -> CausalLMScorer:
    """A scorer for an ``AutoModelForCausalLM`` directory or name and its tokenizer (SDPA attention, float32
    weights unless ``bf16``). A LoRA adapter directory (or rapidlite's ``DIR/hf`` holding only ``adapter/``) is
    scored on its base, which transformers loads with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rapidlite.models.hf import check_positions, load_hf_model
    from rapidlite.models.lora import adapter_directory
    from rapidlite.observe.progress import hf_transformers_progress

    _check_model_path(model)
    adapter = adapter_directory(model)
    if adapter is None:  # refused from its config, before its weights load under a new, random LM head
        _refuse_other_heads(model)
    model = str(adapter) if adapter is not None else model
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        with hf_transformers_progress(True):  # its bars on a terminal only
            net = load_hf_model(
                AutoModelForCausalLM.from_pretrained, model, dtype=torch.bfloat16 if bf16 else torch.float32
            )
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {model}: cannot load a causal LM and its tokenizer ({first_line(e)})") from None
    if max_length is not None:
        check_positions(net, max_length, model)  # a longer window would index past the position table
    device = device or torch.device("cpu")
    return CausalLMScorer(net.to(device), tokenizer, max_length, batch_size, device)


class RewardScorer(_ModelScorer):
    """Scores of preference pairs under a reward model (``AutoModelForSequenceClassification`` with one output, as
    ``--task reward_model`` exports it) and its tokenizer: each row tokenized as in training
    (``rapidlite.data.preference.encode_reward_pairs``), padded with the id the model's config reads the last
    token by."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_length: int | None = None,
        batch_size: int = 8,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(model, tokenizer, max_length, batch_size, device)
        pad = model.config.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            model.config.pad_token_id = pad  # padding is masked; the model must know which id ends a row
        self.pad_id = pad if pad is not None else 0

    def pair_scores(
        self, rows: Sequence[dict], ctx: DistributedContext | None = None
    ) -> tuple[torch.Tensor, dict, list[int]]:
        """``([pairs, 2] scores (chosen, rejected) in row order, dropped rows by reason, each pair's row number)`` on
        every rank: pairs sorted longest first, cut into batches over the whole set, batch ``b`` scored by rank
        ``b % world``."""
        from rapidlite.data.preference import Counts, PairCollator, encode_reward_pairs, pair_rewards

        counts, numbers = Counts(), []
        samples = encode_reward_pairs(rows, self.tokenizer, self.max_length, counts, numbers)
        if not samples:
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.dropped.items()))
            raise DataError(f"--data: no row can be scored ({reasons}); give pairs that differ and fit --seq-length")
        collate = PairCollator(self.pad_id)
        rank, world = (ctx.dp_rank, ctx.dp_size) if ctx is not None else (0, 1)
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["chosen_ids"] + samples[i]["rejected_ids"]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        mine = []
        with torch.no_grad():
            for batch in batches[rank::world]:
                inputs = {k: v.to(self.device) for k, v in collate([samples[i] for i in batch]).items()}
                chosen, rejected = pair_rewards(self.model, inputs)
                index = torch.tensor(batch, dtype=torch.float64)
                mine.append(torch.stack([index, chosen.double().cpu(), rejected.double().cpu()], 1))
        local = torch.cat(mine) if mine else torch.zeros(0, 3, dtype=torch.float64)
        gathered = ctx.all_gather(local) if ctx is not None else local
        scores = torch.zeros(len(samples), 2, dtype=torch.float64)
        scores[gathered[:, 0].long()] = gathered[:, 1:]
        return scores, counts.dropped, numbers


def reward(
    scorer: RewardScorer, rows: Sequence[dict], ctx: DistributedContext | None = None, per_pair: list | None = None
) -> dict[str, Any]:
    """TRL's reward metrics of the pairs: ``accuracy`` (the share scored chosen above rejected) with its standard
    error, ``margin`` (mean chosen - rejected score), ``mean_reward``, ``min_reward``, ``max_reward``; ``n`` scored
    pairs, and ``dropped`` (by reason) when some rows could not be scored. ``per_pair``, when given, receives
    ``{"row", "chosen", "rejected"}`` of every scored row (``row``: its 0-based number in the data)."""
    scores, dropped, numbers = scorer.pair_scores(rows, ctx)
    if per_pair is not None:
        pairs = zip(numbers, scores.tolist(), strict=True)
        per_pair.extend({"row": row, "chosen": c, "rejected": r} for row, (c, r) in pairs)
    chosen, rejected = scores[:, 0], scores[:, 1]
    hits = (chosen > rejected).double().tolist()
    out: dict[str, Any] = {
        "accuracy": sum(hits) / len(hits),
        "accuracy_stderr": mean_stderr(hits),
        "margin": float((chosen - rejected).mean()),
        "mean_reward": float(scores.mean()),
        "min_reward": float(scores.min()),
        "max_reward": float(scores.max()),
        "n": len(hits),
    }
    if dropped:
        out["dropped"] = dict(sorted(dropped.items()))
    return out


def load_reward_scorer(
    model: str,
    max_length: int | None = None,
    batch_size: int = 8,
    bf16: bool = False,
    device: torch.device | None = None,
) -> RewardScorer:
    """A scorer for a reward model's directory or name (``AutoModelForSequenceClassification`` with one output, SDPA
    attention, float32 weights unless ``bf16``) and its tokenizer. A LoRA adapter directory (or ``DIR/hf`` of a
    ``--lora-rank`` run, holding ``adapter/``) is scored on its base with a one-output head, which the adapter holds."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rapidlite.models import lora
    from rapidlite.models.hf import check_positions, load_hf_model
    from rapidlite.observe.progress import hf_transformers_progress

    _check_model_path(model)
    adapter = lora.adapter_directory(model)
    base = lora.adapter_base(adapter) if adapter is not None else model
    dtype = torch.bfloat16 if bf16 else torch.float32
    if adapter is None:  # refused from its config, before its weights load around a new, random head
        labels = _num_labels(model)
        if labels is not None and labels != 1:
            raise _not_a_reward_model(model, labels)
    try:
        has_tokenizer = adapter is None or (adapter / "tokenizer_config.json").is_file()
        tokenizer = AutoTokenizer.from_pretrained(str(adapter) if adapter is not None and has_tokenizer else base)
        with hf_transformers_progress(True):
            if adapter is not None:
                net = load_hf_model(AutoModelForSequenceClassification.from_pretrained, base, num_labels=1, dtype=dtype)
                net = lora.load_adapter(net, adapter).eval()
            else:
                net = load_hf_model(AutoModelForSequenceClassification.from_pretrained, model, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: transformers' head size mismatch
        raise ConfigError(f"--model {model}: cannot load a reward model and its tokenizer ({first_line(e)})") from None
    if net.config.num_labels != 1:
        raise _not_a_reward_model(model, net.config.num_labels)
    if max_length is not None:
        check_positions(net, max_length, model)
    device = device or torch.device("cpu")
    return RewardScorer(net.to(device), tokenizer, max_length, batch_size, device)


def _num_labels(model: str) -> int | None:
    """The outputs a sequence-classification head built from ``model``'s config has (None: no readable config;
    loading the model then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model).num_labels
    except (OSError, ValueError):
        return None


# Class names of the heads that predict the next token (GPT2LMHeadModel is one, as are the *ForCausalLM).
_CAUSAL_LM_HEADS = ("ForCausalLM", "LMHeadModel")


def _refuse_other_heads(model: str) -> None:
    """A checkpoint saved with another head (a classifier's, a masked LM's) is one line naming it: transformers
    would load its body under a random LM head and score that."""
    from transformers import AutoConfig

    try:
        heads = AutoConfig.from_pretrained(model).architectures or []
    except (OSError, ValueError):
        return  # loading the model says why
    if heads and not any(h.endswith(_CAUSAL_LM_HEADS) for h in heads):
        raise ConfigError(
            f"--model {model}: holds a {heads[0]}, not a causal LM; rapidlite-eval scores an AutoModelForCausalLM "
            "(--task reward: a one-output sequence classifier)"
        )


def _not_a_reward_model(model: str, labels: int) -> ConfigError:
    return ConfigError(
        f"--model {model}: its sequence-classification head has {labels} outputs; --task reward scores with a "
        "reward model (one output, as --task reward_model exports it)"
    )


def evaluate(
    scorer: Any, task: str, items: Sequence[Any], ctx: DistributedContext | None = None, per_pair: list | None = None
) -> dict[str, Any]:
    """The metrics of ``task`` (``multiple_choice``, ``perplexity`` with a ``CausalLMScorer``; ``reward`` with a
    ``RewardScorer``, and its pairs' scores in ``per_pair``) on ``items`` as ``load_eval_data`` returns them, equal
    on every rank."""
    if task == REWARD:
        metrics = reward(scorer, items, ctx, per_pair)
    elif task == MULTIPLE_CHOICE:
        metrics = multiple_choice(scorer, items, ctx)
    else:
        metrics = perplexity(scorer, items, ctx)
    return {"task": task, **metrics}
