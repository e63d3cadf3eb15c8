"""``--task pretraining``'s declaration and checks (torch-free; the trainers are ``pretraining.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rapidlite.config.moe import check_built_in_experts
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError, first_line

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections


def model_family(name: str | None) -> str:
    """ "gpt" (built-in), "causal" (a Hugging Face causal LM config) or "bert" (masked LM + NSP): the model
    ``--task pretraining`` trains for ``--pretrained-model-name-or-path``."""
    if name is None:
        return "gpt"
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(name)
    except Exception as e:
        raise ConfigError(f"--pretrained-model-name-or-path {name}: cannot load its config ({first_line(e)})") from None
    if config.model_type == "bert":
        return "bert"
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    raise ConfigError(
        f"--pretrained-model-name-or-path {name}: a {config.model_type} config is neither a causal language model "
        "nor BERT; --task pretraining trains GPT-style models and BERT"
    )


def _seq_length(settings: Sections) -> int:
    """Megatron's defaults: 1024 tokens for GPT-style models, 512 for BERT."""
    return 512 if model_family(settings.model.pretrained_model_name_or_path) == "bert" else 1024


# The built-in GPT's architecture flags; a Hugging Face config describes its own architecture.
_BUILT_IN_GPT_FLAGS = (
    "normalization",
    "swiglu",
    "position_embedding_type",
    "untie_embeddings_and_output_weights",
    "use_rotary_position_embeddings",
    "no_position_embedding",
    "rotary_base",
    "disable_bias_linear",
)


def check(settings: Sections) -> None:
    data, model = settings.data, settings.model.pretrained_model_name_or_path
    if data.streaming and model_family(model) == "bert":
        raise ConfigError(
            "--streaming pretrains GPT-style models; BERT pretraining reads sentence-split .bin/.idx data"
        )
    if data.data_path is not None and data.tokenizer_type is None and model is None:
        raise ConfigError(
            "--task pretraining needs the tokenizer the data was preprocessed with: give --tokenizer-type "
            "(with --vocab-file/--merge-file/--tokenizer-model/--vocab-size) or --pretrained-model-name-or-path"
        )
    if model is None:  # the built-in GPT
        check_built_in_experts(settings.topology.ep, settings.moe)
    check_context_parallel(settings, model)
    given = settings.explicit_flags
    if model is not None and given is not None:
        for dest in _BUILT_IN_GPT_FLAGS:
            if dest in given:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(
                    f"{flag} shapes the built-in GPT; the config of --pretrained-model-name-or-path "
                    f"{model} defines its own architecture (its sizes follow "
                    f"--num-layers, --hidden-size, ...): drop {flag} or --pretrained-model-name-or-path"
                )


def check_context_parallel(settings: Sections, model: str | None) -> None:
    """What context parallelism needs of the model: a decoder, and no attention dropout (the built-in GPT's
    default is Megatron's 0.1). The heads Ulysses divides are checked on the model
    (``rapidlite.parallel.context_parallel.apply_context_parallel``)."""
    cp = settings.topology.cp
    if cp <= 1:
        return
    flag = f"--context-parallel-size {cp}"
    if model_family(model) == "bert":
        raise ConfigError(f"{flag}: BERT is an encoder; context parallelism splits decoders' causal attention")
    pp = settings.topology.pp
    if model is not None and pp > 1:
        raise ConfigError(
            f"{flag} with --pipeline-model-parallel-size {pp}: built for the built-in GPT; split a Hugging Face "
            "decoder's sequences with data or tensor parallelism around it, or drop one of the two"
        )
    if model is None:
        dropout = settings.model.attention_dropout
        if dropout is None or dropout > 0:
            value = "0.1 (the built-in GPT's default)" if dropout is None else f"{dropout:g}"
            raise ConfigError(f"{flag}: attention dropout {value} is not split over ranks; add --attention-dropout 0")


TASK = TaskSpec(
    name="pretraining",
    summary="pretrain a GPT (built-in or a causal config) or BERT on Megatron mmap data",
    trainer="rapidlite.tasks.pretraining:pretrainer_for",
    iteration_based=True,
    pipeline=True,
    demo="rapidlite.tasks.pretraining_demo:demo",
    demo_without_data=True,
    defaults={"seq_length": _seq_length},
    check=check,
    auto_class="AutoModelForCausalLM",
    auto_class_by_model_type={"bert": "BertForPreTraining"},
    from_config=True,
    chunked_loss="sum",
    libraries=(),  # Megatron's memory-mapped data, no metrics library
    streaming=True,
    context_parallel=True,
)
