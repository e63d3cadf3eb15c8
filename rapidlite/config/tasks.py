"""The black-box tasks ``--task`` can name: what each runs, what it needs, what it supports.

One ``TaskSpec`` per task, looked up by name: everything the rest of rapidlite knows about a task is here.
The command line (``rapidlite.cli.main``), ``resolve`` (``rapidlite.resolve``) and the planner (``--dry-run``) consult
this table and never compare task names, so adding a task is one module under ``rapidlite/tasks/`` plus one
entry here (or ``register_task`` from outside the package). The table is torch-free and imports no task
module: trainers and demos are named by ``"module:attribute"`` and imported only when a run needs them, so
``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rapidlite.errors import ConfigError, first_line


def _import(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Demo:
    """A task's embedded offline run. ``defaults``: flag values (by destination) the run starts from; flags
    given on the command line win. ``assets``: where its data, tokenizer and model are, which belong together
    and replace any given. ``prepare()``: builds them once (idempotent, safe when ranks race); the CLI calls it
    after resolve, so a refused command builds nothing."""

    defaults: Mapping[str, Any]
    assets: Mapping[str, Any]
    prepare: Callable[[], None]


@dataclass(frozen=True)
class TaskSpec:
    """A black-box task.

    ``trainer``: ``"module:function"`` returning the trainer class for the parsed flags. ``required``: flags
    the task cannot run without (unless ``--demo`` or an embedded default fills them). ``iteration_based``:
    the run's length is ``--train-iters``. ``pipeline``: pipeline parallelism is supported (fixed-length
    samples). ``demo``: ``"module:function"`` returning the ``Demo`` of the embedded offline run;
    ``demo_without_data``: the embedded run also starts when ``--data-path`` is absent. ``load_model_dir``: a
    Hugging Face model directory given to ``--load`` is the model to start from. ``check``: task-specific
    validation of the parsed flags (torch-free). ``defaults``: the task's values of flags left unset (by
    destination; each a value or a function of the otherwise resolved flags), applied by ``resolve``.
    ``eval_only``: the trainer honours ``--eval-only`` (a ``Finetuner`` does). ``auto_class``: the
    ``transformers`` class the task builds from a config (``auto_class_by_model_type`` where a model type takes
    another, as BERT pretraining does), which the planner builds on the meta device. ``inputs_per_sample``:
    sequences one sample feeds the model (a multiple-choice question: one per choice, planned at four).
    ``from_config``: the task builds its model from a config and trains it from scratch (weights only with
    ``--load-pretrained-weights``): the size flags reshape the config, the position table grows to
    ``--seq-length``, and without ``--pretrained-model-name-or-path`` it is the built-in GPT. ``reference``: the
    task scores against a reference model; given the settings, which one (``preference_reference``), so the
    trainer and the planner (which counts its memory) read the one rule. ``ignored``: flags the task does not read,
    named by destination or by their settings section (a ``Sections`` attribute: all of its flags): one of them set
    off its default is refused in one line rather than ignored. ``chunked_loss``: the task's loss goes through the
    chunked output layer where it serves the model (``rapidlite.models.head``; in a pipeline, on its last
    stage), so the planner counts no whole logits there: ``"sum"`` a summed loss
    (its gradients made in the forward pass), ``"tokens"`` per-token log-probabilities (each chunk recomputed in
    the backward pass). ``libraries``: the modules the task's run imports beyond torch and transformers (its data
    pipeline's, its metrics'), which the planner loads before it reads a CPU run's resident size.
    """

    name: str
    summary: str
    trainer: str
    required: tuple[str, ...] = ()
    iteration_based: bool = False
    pipeline: bool = False
    demo: str | None = None
    demo_without_data: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    load_model_dir: bool = False
    check: Callable[[argparse.Namespace], None] | None = None
    eval_only: bool = False
    auto_class: str | None = None
    auto_class_by_model_type: Mapping[str, str] = field(default_factory=dict)
    inputs_per_sample: int = 1
    from_config: bool = False
    reference: Callable[[Any], str] | None = None
    ignored: tuple[str, ...] = ()
    chunked_loss: Literal["sum", "tokens"] | None = None
    libraries: tuple[str, ...] = ("datasets", "torchmetrics")
    eval_harness: bool = False  # --eval-harness: the task's model is a causal LM the harness can score
    streaming: bool = False  # --streaming: the task reads text as a stream (rapidlite.data.streaming)

    def model_class_name(self, model_type: str | None) -> str | None:
        """The ``transformers`` class this task builds for a config of ``model_type``."""
        return self.auto_class_by_model_type.get(model_type or "", self.auto_class)

    def trainer_class(self, settings: Any) -> type:
        """The trainer class for the resolved settings (``Sections``; the table imports nothing above it)."""
        return _import(self.trainer)(settings)

    def demo_run(self) -> Demo:
        """The embedded offline run (torch-free: nothing is built until ``prepare``)."""
        if self.demo is None:
            raise ConfigError(f"--task {self.name} has no embedded demo; give its data and model flags")
        return _import(self.demo)()


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


def _pretraining_seq_length(args: argparse.Namespace) -> int:
    """Megatron's defaults: 1024 tokens for GPT-style models, 512 for BERT."""
    return 512 if model_family(args.pretrained_model_name_or_path) == "bert" else 1024


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


def _check_pretraining(args: argparse.Namespace) -> None:
    if args.streaming and model_family(args.pretrained_model_name_or_path) == "bert":
        raise ConfigError(
            "--streaming pretrains GPT-style models; BERT pretraining reads sentence-split .bin/.idx data"
        )
    if args.data_path is not None and args.tokenizer_type is None and args.pretrained_model_name_or_path is None:
        raise ConfigError(
            "--task pretraining needs the tokenizer the data was preprocessed with: give --tokenizer-type "
            "(with --vocab-file/--merge-file/--tokenizer-model/--vocab-size) or --pretrained-model-name-or-path"
        )
    given = args.explicit_flags
    if args.pretrained_model_name_or_path is not None and given is not None:
        for dest in _BUILT_IN_GPT_FLAGS:
            if dest in given:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(
                    f"{flag} shapes the built-in GPT; the config of --pretrained-model-name-or-path "
                    f"{args.pretrained_model_name_or_path} defines its own architecture (its sizes follow "
                    f"--num-layers, --hidden-size, ...): drop {flag} or --pretrained-model-name-or-path"
                )


QUESTION_ANSWERING_SEQ_LENGTH = 384  # run_qa's --max_seq_length


def _check_question_answering(args: argparse.Namespace) -> None:
    if args.padding_free:
        raise ConfigError(
            "--padding-free: question answering picks each window's answer span by a softmax over the whole window, "
            "which a row of packed windows would mix; drop --padding-free (--group-by-length also cuts padding)"
        )
    seq_length = args.seq_length or QUESTION_ANSWERING_SEQ_LENGTH
    for flag, value in (("--n-best-size", args.n_best_size), ("--max-answer-length", args.max_answer_length)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    if not 0 < args.doc_stride < seq_length:
        raise ConfigError(
            f"--doc-stride {args.doc_stride}: must be positive and below --seq-length {seq_length} (windows of a "
            "long context overlap by that many tokens)"
        )


def _check_masked_lm(args: argparse.Namespace) -> None:
    if not 0 < args.mask_prob < 1:
        raise ConfigError(f"--mlm-probability {args.mask_prob:g}: must be in (0, 1); 0.15 is usual")
    if args.padding_free:
        raise ConfigError(
            "--padding-free: --task masked_lm draws each sample's masks over its own row of tokens (and grouped "
            "blocks have no padding to remove); drop --padding-free"
        )


def _check_multiple_choice(args: argparse.Namespace) -> None:
    if args.padding_free:
        raise ConfigError(
            "--padding-free: --task multiple_choice scores each question's choices as rows of one [choices, length] "
            "block, which cannot be flattened into one row; drop --padding-free (--group-by-length works)"
        )


def _check_seq2seq(args: argparse.Namespace) -> None:
    for flag, value in (("--max-target-length", args.max_target_length), ("--num-beams", args.num_beams)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")


PREFERENCE_SEQ_LENGTH = 1024  # TRL's max_length for DPO, KTO and reward models
# The --loss-type values with no reference model; their log-probabilities are length-averaged (SimPO, ORPO).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


def preference_reference(settings: Any) -> str:
    """The reference model of a preference task (``Sections``): "none" (SimPO and ORPO have none), "precomputed"
    (``--precompute-ref-logprobs``: scores made before training, nothing kept), "adapters" (with ``--lora-rank``:
    the policy with its adapters disabled) or "copy" (a frozen copy laid out as the policy). A run continuing a
    LoRA adapter directory also uses "adapters" (the trainer sees the directory)."""
    pref = settings.preference
    if pref.reference_free:
        return "none"
    if pref.precompute_ref_logprobs:
        return "precomputed"
    return "adapters" if settings.lora.lora_rank else "copy"


def _check_preference(args: argparse.Namespace) -> None:
    if not 0 <= args.label_smoothing < 0.5:
        raise ConfigError(
            f"--label-smoothing {args.label_smoothing:g}: must be in [0, 0.5) (the share of flipped labels)"
        )
    if args.precompute_ref_logprobs and args.loss_type in REFERENCE_FREE_LOSSES:
        raise ConfigError(
            f"--precompute-ref-logprobs: --loss-type {args.loss_type} uses no reference model; drop the flag"
        )
    if args.rpo_alpha is not None and args.loss_type == "orpo":
        raise ConfigError("--rpo-alpha: ORPO's loss has its NLL term already (at weight 1); drop --rpo-alpha")
    if args.label_smoothing and args.loss_type not in ("sigmoid", "robust", "simpo"):
        raise ConfigError(
            f"--label-smoothing: --loss-type {args.loss_type} does not use it; use sigmoid, robust or simpo"
        )


def _check_kto(args: argparse.Namespace) -> None:
    if args.padding_free:
        raise ConfigError(
            "--padding-free: --task kto runs each completion and its KL sequence as padded rows; drop --padding-free"
        )
    if args.group_by_length:
        raise ConfigError(
            "--group-by-length: --task kto reads its training data in order (each global batch's KL sequences are "
            "its own completions re-paired); drop --group-by-length"
        )


def _check_reward_model(args: argparse.Namespace) -> None:
    if args.padding_free:
        raise ConfigError(
            "--padding-free: --task reward_model reads each sequence's score at its last token, which a packed row "
            "does not mark; drop --padding-free (--group-by-length also cuts padding)"
        )


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="sequence_classification",
            summary="fine-tune AutoModelForSequenceClassification on text (accuracy, F1; scores: Pearson, Spearman)",
            trainer="rapidlite.tasks.sequence_classification:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.demo:demo",
            defaults={"seq_length": 128},
            load_model_dir=True,
            eval_only=True,
            auto_class="AutoModelForSequenceClassification",
        ),
        TaskSpec(
            name="pretraining",
            summary="pretrain a GPT (built-in or a causal config) or BERT on Megatron mmap data",
            trainer="rapidlite.tasks.pretraining:pretrainer_for",
            iteration_based=True,
            pipeline=True,
            demo="rapidlite.tasks.pretraining_demo:demo",
            demo_without_data=True,
            defaults={"seq_length": _pretraining_seq_length},
            check=_check_pretraining,
            auto_class="AutoModelForCausalLM",
            auto_class_by_model_type={"bert": "BertForPreTraining"},
            from_config=True,
            chunked_loss="sum",
            libraries=(),  # Megatron's memory-mapped data, no metrics library
            streaming=True,
        ),
        TaskSpec(
            name="causal_lm",
            summary="fine-tune AutoModelForCausalLM on instructions, prompt/response pairs, chats or text",
            trainer="rapidlite.tasks.causal_lm:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.causal_lm_demo:demo",
            defaults={"seq_length": 512},
            load_model_dir=True,
            eval_only=True,
            auto_class="AutoModelForCausalLM",
            chunked_loss="sum",
            eval_harness=True,
            streaming=True,
        ),
        TaskSpec(
            name="question_answering",
            summary="fine-tune AutoModelForQuestionAnswering on SQuAD-style extractive QA (exact match, F1)",
            trainer="rapidlite.tasks.question_answering:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.question_answering_demo:demo",
            defaults={"seq_length": QUESTION_ANSWERING_SEQ_LENGTH},
            load_model_dir=True,
            check=_check_question_answering,
            eval_only=True,
            auto_class="AutoModelForQuestionAnswering",
        ),
        TaskSpec(
            name="masked_lm",
            summary="adapt AutoModelForMaskedLM (BERT, RoBERTa, ...) to raw text of a domain (perplexity)",
            trainer="rapidlite.tasks.masked_lm:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.masked_lm_demo:demo",
            defaults={"seq_length": 512},  # a cap: lowered to the model's limit
            load_model_dir=True,
            check=_check_masked_lm,
            eval_only=True,
            auto_class="AutoModelForMaskedLM",
            chunked_loss="sum",
        ),
        TaskSpec(
            name="multiple_choice",
            summary="fine-tune AutoModelForMultipleChoice on SWAG/HellaSwag-style questions (accuracy)",
            trainer="rapidlite.tasks.multiple_choice:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.multiple_choice_demo:demo",
            defaults={"seq_length": 512},  # a cap: lowered to the model's limit; rows pad to the longest
            load_model_dir=True,
            check=_check_multiple_choice,
            eval_only=True,
            auto_class="AutoModelForMultipleChoice",
            inputs_per_sample=4,  # SWAG's four choices per question, each a sequence
        ),
        TaskSpec(
            name="token_classification",
            summary="fine-tune AutoModelForTokenClassification on tagged words, NER or POS (entity F1, accuracy)",
            trainer="rapidlite.tasks.token_classification:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.token_classification_demo:demo",
            defaults={"seq_length": 128},
            load_model_dir=True,
            eval_only=True,
            auto_class="AutoModelForTokenClassification",
        ),
        TaskSpec(
            name="seq2seq",
            summary="fine-tune AutoModelForSeq2SeqLM (T5, BART, ...) on summaries or translations (ROUGE, BLEU)",
            trainer="rapidlite.tasks.seq2seq:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.seq2seq_demo:demo",
            defaults={"seq_length": 1024},  # run_summarization's --max_source_length
            load_model_dir=True,
            check=_check_seq2seq,
            eval_only=True,
            auto_class="AutoModelForSeq2SeqLM",
            chunked_loss="sum",
            libraries=("datasets", "torchmetrics", "rouge_score.rouge_scorer"),  # ROUGE (with nltk): about 40 MiB
        ),
        TaskSpec(
            name="dpo",
            summary="preference-train AutoModelForCausalLM on chosen/rejected pairs (DPO, IPO, SimPO, ORPO, ...)",
            trainer="rapidlite.tasks.dpo:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            demo="rapidlite.tasks.dpo_demo:demo",
            defaults={"seq_length": PREFERENCE_SEQ_LENGTH},
            load_model_dir=True,
            check=_check_preference,
            eval_only=True,
            auto_class="AutoModelForCausalLM",
            inputs_per_sample=2,  # the chosen and the rejected sequence of a pair
            reference=preference_reference,
            chunked_loss="tokens",
            eval_harness=True,
        ),
        TaskSpec(
            name="kto",
            summary="preference-train AutoModelForCausalLM on completions labelled desirable or not (KTO)",
            trainer="rapidlite.tasks.kto:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            defaults={"seq_length": PREFERENCE_SEQ_LENGTH},
            load_model_dir=True,
            check=_check_kto,
            ignored=("loss_type", "label_smoothing", "simpo_gamma", "orpo_alpha", "rpo_alpha"),  # DPO's
            eval_only=True,
            auto_class="AutoModelForCausalLM",
            reference=preference_reference,
            chunked_loss="tokens",
            eval_harness=True,
        ),
        TaskSpec(
            name="reward_model",
            summary="train AutoModelForSequenceClassification to score chosen above rejected responses (reward model)",
            trainer="rapidlite.tasks.reward_model:trainer_for",
            required=("--pretrained-model-name-or-path", "--data-path"),
            defaults={"seq_length": PREFERENCE_SEQ_LENGTH},
            load_model_dir=True,
            check=_check_reward_model,
            # Its loss has no reference, beta or prompt cut (a row longer than --max-length is dropped).
            ignored=("preference",),
            eval_only=True,
            auto_class="AutoModelForSequenceClassification",
            inputs_per_sample=2,  # the chosen and the rejected sequence of a pair
        ),
    )
}


def task_names() -> list[str]:
    return list(TASKS)


def register_task(spec: TaskSpec) -> None:
    """Add a task ``--task spec.name`` can name, from outside the package: its trainer and demo are named by
    ``"module:attribute"`` as the built-in tasks' are. A name already taken is refused."""
    if spec.name in TASKS:
        raise ConfigError(f"task {spec.name!r} is registered already; give the new task another name")
    TASKS[spec.name] = spec


def get_task(name: str) -> TaskSpec:
    """The task ``--task name`` names; an unknown name is one line listing the known ones."""
    spec = TASKS.get(name)
    if spec is None:
        raise ConfigError(f"--task {name}: unknown task; choose one of {', '.join(TASKS)}")
    return spec
