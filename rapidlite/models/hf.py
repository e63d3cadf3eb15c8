"""Building Hugging Face models the way rapidlite trains them: attention through PyTorch's SDPA.

Every place rapidlite builds a Hugging Face model goes through ``load_hf_model``, which asks for
``attn_implementation="sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``: flash or memory-efficient
kernels on CUDA, no materialised attention matrix). A model class without an SDPA path keeps the library's
default. Recent transformers releases already default to SDPA where a class supports it; asking explicitly
makes the choice independent of the release and of how the model is built.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from rapidlite.config.sections import ModelConfig
from rapidlite.errors import ConfigError, first_line
from rapidlite.observe.logging import LOGGER_NAME

ModelT = TypeVar("ModelT")

SDPA = "sdpa"


def _refuses_sdpa(error: Exception) -> bool:
    """Whether transformers refused SDPA for the model class: a ValueError naming SDPA (4.x and 5.x), or an
    ImportError when the installed torch is too old for it (4.x)."""
    message = str(error)
    return "scaled_dot_product_attention" in message or SDPA in message.lower()


def load_hf_model(
    load: Callable[..., ModelT], source: Any, new_head: str | None = None, evaluating: bool = False, **kwargs: Any
) -> ModelT:
    """``load(source, **kwargs)`` with SDPA attention, where ``load`` is a Hugging Face ``from_pretrained``
    (``source``: a name or directory) or an auto class's ``from_config`` (``source``: a config).

    A class without SDPA support is loaded again without the request, with the library's default attention.
    transformers fails that check before it reads any weights, so the retry costs no second load.

    Weights whose saved shape disagrees with the model built from the config (``refuse_resized``) are one line,
    not transformers' table and its advice. ``new_head``: the task's head (``"multiple-choice head"``) may be
    replaced, with a one-line notice, when the saved one has another shape (a checkpoint of another task);
    ``evaluating`` (``--eval-only``): a head the weights do not hold is refused, it would score at random."""
    named = isinstance(source, (str, os.PathLike))
    # Quantised weights are stored packed, in shapes of their own: transformers checks those itself.
    checked = named and kwargs.get("quantization_config") is None
    checked = checked and "ignore_mismatched_sizes" not in kwargs and "output_loading_info" not in kwargs
    if checked:
        kwargs = {**kwargs, "ignore_mismatched_sizes": True, "output_loading_info": True}
    with held_load_report() as report:
        model = _load_with_sdpa(load, source, named, **kwargs)
        if checked:
            model, info = model
            if refuse_resized(model, info, str(source), new_head, evaluating):
                report.clear()  # the one-line notice says it
    if kwargs.get("quantization_config") is not None:
        from rapidlite.models.lora import keep_training_kernel

        keep_training_kernel(model[0] if isinstance(model, tuple) else model)  # before anything evaluates it
    return model


def _load_with_sdpa(load: Callable[..., ModelT], source: Any, named: bool, **kwargs: Any) -> ModelT:
    # transformers 5 writes the request into the config it is given, also when it then refuses it: the first
    # attempt gets a copy, so the fallback starts from the config as the caller built it.
    first = source if named else copy.deepcopy(source)
    try:
        return load(first, attn_implementation=SDPA, **kwargs)
    except (ValueError, ImportError) as error:
        if not _refuses_sdpa(error):
            raise
        what = source if named else f"a {getattr(source, 'model_type', type(source).__name__)} config"
        logging.getLogger(LOGGER_NAME).info(
            f"{what}: the model class has no SDPA attention; using transformers' default"
        )
        return load(source, **kwargs)


@contextmanager
def held_load_report() -> Iterator[list[logging.LogRecord]]:
    """transformers' load report (a table of missing and re-initialised tensors) is held while a model loads: shown
    when the load is accepted, dropped when a one-line error refuses it (or the caller clears the held list)."""
    reports = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    reports.addFilter(hold)
    try:
        yield held
    finally:
        reports.removeFilter(hold)
    for record in held:  # not reached when the block raised
        reports.handle(record)


def load_with_head(
    from_pretrained: Any, name: str, what: str, num_labels: int, id2label: dict[int, str], **kwargs: Any
) -> Any:
    """A classifier from ``name`` with a head for ``num_labels`` labels named by ``id2label`` (a fresh one unless
    the saved head has as many); a failed load one line naming ``what``."""
    try:
        return load_hf_model(
            from_pretrained,
            name,
            new_head=f"{num_labels}-label head",
            num_labels=num_labels,
            id2label=id2label,
            label2id={v: k for k, v in id2label.items()},
            **kwargs,
        )
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error(what, name, e) from None


def refuse_resized(model: Any, info: dict[str, Any], name: str, new_head: str | None, evaluating: bool = False) -> bool:
    """After ``from_pretrained(..., ignore_mismatched_sizes=True, output_loading_info=True)``: a tensor whose saved
    shape disagrees with the model built from the config would be silently re-initialised. One line naming it and
    both shapes, unless it is outside the model's body and the caller takes a ``new_head`` (a classifier's head
    for another number of labels, a multiple-choice head from a sequence classifier's checkpoint): then a one-line
    notice, and True (the notice replaces transformers' report)."""
    body = getattr(model, "base_model_prefix", "") or ""
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    for key, saved, built in mismatched:
        if new_head is None or (body and key.startswith(body + ".")):
            only = " (only the task's head may change size)" if new_head else ""
            raise ConfigError(
                f"--pretrained-model-name-or-path {name}: tensor {key} has shape {tuple(saved)} in the weights but "
                f"{tuple(built)} from config.json; make the config match the weights{only}"
            )
    missing = sorted(k for k in info.get("missing_keys") or () if not (body and k.startswith(body + ".")))
    if evaluating and new_head and (mismatched or missing):
        key, why = (mismatched[0][0], "has another shape") if mismatched else (missing[0], "is not")
        raise ConfigError(
            f"--eval-only: {name} holds no trained {new_head} ({key} {why} in its weights); evaluate a model "
            "fine-tuned for this task (a run's hf/ directory), or train one first"
        )
    if not mismatched:
        return False
    key, saved, built = max(mismatched, key=lambda m: len(m[1]))  # the head's weight, not its bias
    others = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
    logging.getLogger(LOGGER_NAME).info(
        f"{name}: its saved head is another task's ({key}{others}: shape {tuple(saved)}, this task's "
        f"{tuple(built)}); training a new {new_head}"
    )
    return not (info.get("missing_keys") or info.get("unexpected_keys"))


@contextmanager
def plain_save() -> Iterator[None]:
    """While a model rapidlite holds unwrapped is saved: ``save_pretrained`` first unwraps the model through
    accelerate, which imports DeepSpeed where it is installed, only to test the model against its engine class:
    1.5 s of imports on a CPU (more on a GPU node) in every run that exports, and on a machine without a GPU a
    warning that DeepSpeed chose its CPU accelerator. The models saved here are never wrapped (the strategies
    hand on the module itself), so Hugging Face's unwrap is the model; where DeepSpeed is loaded already (a
    DeepSpeed run) nothing is changed."""
    import sys

    # Loaded by any model whose save_pretrained is Hugging Face's; the built-in GPT's own save never needs it.
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None or "deepspeed" in sys.modules or not hasattr(modeling_utils, "unwrap_model"):
        yield
        return
    unwrap = modeling_utils.unwrap_model
    modeling_utils.unwrap_model = _itself
    try:
        yield
    finally:
        modeling_utils.unwrap_model = unwrap


def _itself(model: Any, recursive: bool = False) -> Any:
    return model


def disable_kv_cache(model: Any) -> None:
    """Training needs no key/value cache. A Hugging Face model whose config says ``use_cache`` builds one in
    every training forward: wasted work, and under ``torch.compile`` each block then guards on its own
    cache layer, so compiled blocks recompile once per layer and, past dynamo's recompile limit (8), run
    eagerly. ``saved_config`` writes the value back while the model is saved, so an exported model generates
    with its cache as before."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is True:
        config.use_cache = False
        _CACHE_TURNED_OFF.add(model)


# The models whose cache disable_kv_cache turned off: remembered beside them, not on them.
_CACHE_TURNED_OFF: weakref.WeakSet = weakref.WeakSet()


@contextmanager
def saved_config(model: Any) -> Iterator[None]:
    """The config as the user gave it (``use_cache`` restored) while ``model`` is saved."""
    restore = model in _CACHE_TURNED_OFF
    if restore:
        model.config.use_cache = True
    try:
        yield
    finally:
        if restore:
            model.config.use_cache = False


def load_error(what: str, name: str, error: Exception) -> ConfigError:
    """The one line for a model or tokenizer that ``--pretrained-model-name-or-path`` names but cannot be loaded
    (a load refused with its own line already keeps it)."""
    if isinstance(error, ConfigError):
        return error
    unbuilt = re.match(
        r"Unrecognized configuration class <class '[\w.]*?(\w+)'> for this kind of AutoModel: (\w+)", str(error)
    )
    if unbuilt:  # the config is read, but transformers has no class of the task's kind for its type
        config_class, auto = unbuilt.groups()
        return ConfigError(
            f"--pretrained-model-name-or-path {name}: transformers has no {auto} for {config_class} models, which "
            "this task builds; use a model of another type for it"
        )
    return ConfigError(
        f"--pretrained-model-name-or-path {name}: cannot load the {what} ({first_line(error, 160)}); pass a local "
        "model directory or a hub name reachable from this machine"
    )


def load_config(name: str) -> Any:
    """``AutoConfig`` of ``name``, or one line saying why not."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("model config", name, e) from None


def head_labels(config: Any) -> list[str] | None:
    """The label names of a model's classification head (``id2label`` in id order), or None when the config
    has only transformers' placeholders (``LABEL_0``...)."""
    id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    names = [id2label[i] for i in sorted(id2label)]
    if not names or names == [f"LABEL_{i}" for i in range(len(names))]:
        return None
    return names


def refuse_unknown_labels(head: list[str] | None, labels: list[str], model: str, label_key: str) -> None:
    """``--eval-only``: a data label that a model's named head lacks is one line; a head rebuilt for the data's
    labels would score with rows trained for other classes."""
    if head is None:
        return
    known = {name.lower() for name in head}
    unknown = [name for name in labels if name.lower() not in known]
    if unknown:
        shown = ", ".join(head[:20]) + (", ..." if len(head) > 20 else "")
        raise ConfigError(
            f"--eval-only: label {unknown[0]!r} ({label_key}) is not one of the model's labels ({shown}; its "
            f"config.id2label in --pretrained-model-name-or-path {model}); evaluate on data with the model's labels"
        )


def load_tokenizer(name: str, **kwargs: Any) -> Any:
    """``AutoTokenizer`` from ``name`` (``kwargs``: more ``from_pretrained`` arguments), or one line saying why
    not (a directory without tokenizer files too). A tokenizer without a padding token gets one from
    ``ensure_pad_token`` in the task that pads."""
    from transformers import AutoTokenizer

    from rapidlite.data.tokenizers import special_tokens_only

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as e:  # transformers raises OSError/ValueError/HTTP errors for missing models
        raise load_error("tokenizer", name, e) from None
    if special_tokens_only(tokenizer):  # it would train on unknown tokens alone
        raise ConfigError(
            f"--pretrained-model-name-or-path {name}: holds no tokenizer files (its tokenizer has {len(tokenizer)} "
            "ids, its special tokens alone); save the model's tokenizer there (tokenizer.save_pretrained(DIR)): "
            "fine-tuning reads it from the model directory"
        )
    return tokenizer


# Models whose learned positions start after the padding id (``padding_idx + 1``), so a table of N rows holds
# N - pad_token_id - 1 tokens (RoBERTa's 514 rows hold 512).
_PADDING_OFFSET_POSITIONS = (
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "longformer",
    "data2vec-text",
    "roberta-prelayernorm",
    "xmod",
    "ibert",
    "mpnet",
    "luke",
)


def position_limit(config: Any) -> int | None:
    """The tokens a model's learned position table holds (``max_position_embeddings``, less RoBERTa's padding
    offset), or None for a model without one (rotary positions, DeBERTa-v3's relative ones, T5's buckets)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    if getattr(config, "position_biased_input", True) is False or any(
        getattr(config, key, None) for key in ("rope_parameters", "rope_theta", "rope_scaling")
    ):
        return None
    if getattr(config, "model_type", None) in _PADDING_OFFSET_POSITIONS:
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1
    return limit if limit > 0 else None


def ensure_pad_token(tokenizer: Any, config: Any, name: str) -> str | None:
    """Give a tokenizer without a padding token one, so batches can be padded: the model's own
    (``config.pad_token_id``), else its end-of-sequence, separator or unknown token (padding is masked out of
    attention and loss, so which token fills it does not change the numbers). Returns a line saying which, or
    None when the tokenizer had one; a tokenizer with none of them is one line."""
    if tokenizer.pad_token_id is not None:
        return None
    pad_id = getattr(config, "pad_token_id", None)
    if isinstance(pad_id, int) and not isinstance(pad_id, bool) and 0 <= pad_id < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)
        return f"the tokenizer has no padding token; padding with the model's ({tokenizer.pad_token!r}, id {pad_id})"
    for role in ("eos_token", "sep_token", "unk_token"):
        token = getattr(tokenizer, role, None)
        if token is not None:
            tokenizer.pad_token = token
            return f"the tokenizer has no padding token; padding with its {role} {token!r} (masked out)"
    raise ConfigError(
        f"--pretrained-model-name-or-path {name}: the tokenizer has no padding token (nor end-of-sequence, "
        "separator or unknown token) and the model config names none (pad_token_id); add a pad token to the "
        "tokenizer (tokenizer.add_special_tokens) and save it beside the model"
    )


def tokenizer_and_config(name: str, logger: Any) -> tuple[Any, Any]:
    """A fine-tuning task's tokenizer and model config for ``name``, the tokenizer given a padding token where it
    has none (``ensure_pad_token``, said in one line)."""
    tokenizer = load_tokenizer(name)
    config = load_config(name)
    if (padding := ensure_pad_token(tokenizer, config, name)) is not None:
        logger.info(f"data: {padding}")
    return tokenizer, config


def sequence_length(
    seq_length: int | None, tokenizer: Any, default_cap: int = 512, config: Any = None, explicit: bool = True
) -> int:
    """``--seq-length``, or the model's limit up to ``default_cap`` (as Hugging Face's example scripts cap it).
    The limit is the tokenizer's ``model_max_length`` and, given the model's ``config``, its position table
    (a tokenizer saved beside a smaller model may not know it). A length beyond the limit is one line (the
    position embeddings end there), unless it is a task's default (``explicit=False``): that is lowered to it."""
    limits = []
    limit = getattr(tokenizer, "model_max_length", None)
    # A tokenizer that does not know its model's limit says 1e30.
    if isinstance(limit, (int, float)) and limit < 1_000_000:
        limits.append((int(limit), "its tokenizer's model_max_length"))
    table = position_limit(config) if config is not None else None
    if table is not None:
        limits.append((table, f"its position table, max_position_embeddings {config.max_position_embeddings}"))
    limit, source = min(limits) if limits else (None, "")
    if seq_length is None:
        return min(limit or default_cap, default_cap)
    refusal = "the model takes at most {limit} tokens (" + source + "); use --seq-length {limit}"
    return within_positions(seq_length, limit, explicit, refusal)


def within_positions(
    seq_length: int, limit: int | None, explicit: bool, refusal: str, flag: str = "--seq-length"
) -> int:
    """The sequence-length rule, for every task, the planner and evaluation: a length within the model's limit
    (its learned position table, ``position_limit``) stands; a default beyond it (``explicit`` False: a task's
    default, not the user's) is lowered to it; a length the user gave beyond it is refused in one line,
    ``--seq-length N: `` (or ``flag``'s) + ``refusal`` (which may name ``{limit}``), before any step would index
    past the table."""
    if limit is None or seq_length <= limit:
        return seq_length
    if not explicit:
        return limit
    raise ConfigError(f"{flag} {seq_length}: " + refusal.replace("{limit}", str(limit)))


def override_sizes(config: Any, model: ModelConfig, seq_length: int, vocab_size: int | None = None) -> None:
    """A config a task trains from scratch (``TaskSpec.from_config``): the size flags given (``--num-layers``,
    ``--hidden-size``, ...) onto the keys the model family's spec names, a learned position table too short
    for ``seq_length`` made long enough (rotary and ALiBi models have no table; the value is then unused), and
    a vocabulary smaller than the data tokenizer's ``vocab_size`` grown to it."""
    from rapidlite.models.spec import spec_for_config

    for flag, keys in spec_for_config(config).size_keys.items():
        value = getattr(model, flag)
        if value is not None:
            for key in keys:
                if hasattr(config, key):
                    setattr(config, key, value)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_length > limit:
        config.max_position_embeddings = seq_length
    if vocab_size is not None and getattr(config, "vocab_size", vocab_size) < vocab_size:
        config.vocab_size = vocab_size
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if model.num_attention_heads is not None and isinstance(groups, int) and groups and heads % groups:
        raise ConfigError(
            f"--num-attention-heads {heads}: the model config's {groups} key/value heads do not divide it; give "
            f"a multiple of {groups}"
        )


def check_positions(model: Any, seq_length: int, name: str) -> None:
    """One line, before any step, for ``--seq-length`` beyond ``model``'s learned position table
    (``position_limit`` of its config): the first long batch would otherwise fail deep inside the model with
    an index error."""
    limit = position_limit(getattr(model, "config", model))
    refusal = name + " has learned position embeddings for {limit} positions; use --seq-length {limit} or less"
    within_positions(seq_length, limit, True, refusal)


def unquantized(model: Any) -> Any:
    """A model to ``save_pretrained`` full-precision weights with: ``model`` itself, or for a model that
    transformers loaded quantised (bitsandbytes), a weightless twin (on the meta device) whose config has no
    quantisation, so the saved model loads as a plain one."""
    config = getattr(model, "config", None)
    if getattr(config, "quantization_config", None) is None and getattr(model, "hf_quantizer", None) is None:
        return model
    import torch

    config = copy.deepcopy(config)
    del config.quantization_config
    with torch.device("meta"):
        return type(model)._from_config(config)
