"""The run's settings as typed sections: every flag of rapidlite's declared once, as a field.

Each section is a frozen dataclass of the flags (and derived values) one part of the system reads: the optimizer
builder receives ``OptimizerConfig``, LoRA ``LoraConfig``, and so on. A field is a flag (``flag(...)``: type,
default, help and ``--help`` group in one place) or a value ``resolve`` derives (``derived(...)``). argparse,
``--help``, ``--config FILE.yaml`` and the flags reference are generated from these declarations
(``rapidlite.config.parser.build_parser``). This module holds what is trained and how it learns (task, model, data,
training, optimizer, LoRA); ``rapidlite.config.runtime`` where and how it runs (precision, parallelism,
checkpoints, logging); ``rapidlite.config.settings.Sections`` one of each, which ``resolve`` builds, frozen,
beside the flat ``argparse.Namespace`` view that ``get_args()`` and Rapidformer/Megatron-style scripts read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from rapidlite.config.fields import derived, flag
from rapidlite.config.tasks import task_names

# The --help groups, in their order (title -> description).
TASK_AND_MODEL = "task and model"
TRAINING = "batch and training"
OPTIMIZER = "optimizer and learning rate"
PRECISION = "precision"
MEMORY_AND_SPEED = "memory and speed"
DEEPSPEED = "DeepSpeed backend (pip install 'rapidlite[deepspeed]')"
LORA = "LoRA and quantisation (peft; 4-bit/8-bit: pip install 'rapidlite[quant]')"
PREFERENCE = "preference training (dpo, kto)"
MOE = "mixture of experts"
DEFAULT_DEMO = "default"  # --demo without a name: the task's own
IMAGES = "images (vision-language models: causal_lm and dpo on data with images)"
DATA = "data"
CHECKPOINTS_AND_LOGGING = "checkpoints, logging and evaluation"
DISTRIBUTED = "distributed"
MEGATRON = "Megatron-LM compatibility"

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
# bitsandbytes' AdamW with 8-bit moments (block-wise quantised), and its paged twin (CUDA unified memory).
EIGHT_BIT_OPTIMIZERS = ("adamw8bit", "paged_adamw8bit")
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
)


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1.0,0.5, got {text!r}") from None


def text_list(text: str) -> list[str]:
    parts = [part for part in text.split(",") if part]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated values such as a,b, got {text!r}")
    return parts


def path_list(text: str) -> list[str]:
    parts = [part for part in text.split(",") if part]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated files such as a.jsonl,b.jsonl, got {text!r}")
    return parts


@dataclass(frozen=True)
class TaskConfig:
    """Which task or user script runs, and the options several tasks share. A task's own options are declared
    with the task (``TaskSpec.options``)."""

    GROUP: ClassVar[str] = DATA

    # The tasks are listed when the parser is built: a task's declaration may import this module's sections.
    task: str | None = flag(None, lambda: f"black-box task: {', '.join(task_names())}", group=TASK_AND_MODEL)
    user_script: str | None = flag(
        None, "run a user's Finetuner/PreTrainer script (white box)", metavar="PATH", group=TASK_AND_MODEL
    )
    demo: str | None = flag(
        None,
        "run the task on an embedded offline default (tiny model and generated data); a NAME picks another of the "
        "task's demos (--task causal_lm --demo vision)",
        const=DEFAULT_DEMO,
        metavar="NAME",
        group=TASK_AND_MODEL,
    )
    demo_defaults: frozenset[str] = derived(frozenset(), "the flags whose values the embedded demo chose")
    prompt_template: str = flag(
        "auto", "causal_lm: how prompt fields become text: auto, alpaca, chatml, none or a file with {prompt} fields"
    )
    chat_template: str | None = flag(
        None, "causal_lm: chat data's template when the tokenizer has none: chatml or FILE"
    )
    packing: bool = flag(False, "causal_lm: pack samples into full sequences (attention kept per sample)")
    eval_generate: int = flag(
        0,
        "causal_lm: print N greedy completions of validation prompts at each evaluation (with exact match)",
        metavar="N",
    )
    eval_harness: list[str] | None = flag(
        None,
        "causal_lm, dpo, kto: at each evaluation also score the model in memory (adapters applied) on these jsonl "
        "files as rapidlite-eval does: multiple choice (acc, acc_norm) or perplexity, logged as "
        "harness/<file>/<metric>",
        type=path_list,
        metavar="FILE[,FILE...]",
    )


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it comes from, the built-in GPT's shape, dropout, activation recompute and compilation."""

    GROUP: ClassVar[str] = TASK_AND_MODEL

    pretrained_model_name_or_path: str | None = flag(
        None, "Hugging Face model name or local directory", metavar="NAME_OR_DIR"
    )
    num_layers: int | None = flag(None)
    hidden_size: int | None = flag(None)
    num_attention_heads: int | None = flag(None)
    ffn_hidden_size: int | None = flag(None)
    max_position_embeddings: int | None = flag(None)
    make_vocab_size_divisible_by: int = flag(128, "built-in GPT: pad the vocabulary to a multiple of this")
    init_method_std: float = flag(0.02, "built-in GPT: std of the normal init")
    normalization: str = flag("LayerNorm", "built-in GPT", choices=("LayerNorm", "RMSNorm"))
    swiglu: bool = flag(False, "built-in GPT: SwiGLU MLP (LLaMA-style)")
    position_embedding_type: str = flag("learned_absolute", "built-in GPT", choices=("learned_absolute", "rope"))
    untie_embeddings_and_output_weights: bool = flag(
        False, "built-in GPT: a separate output layer instead of the input embedding's transpose"
    )
    load_pretrained_weights: bool = flag(
        False,
        "--task pretraining: start from the weights of --pretrained-model-name-or-path (default: its config only)",
    )
    hidden_dropout: float | None = flag(None, "override the model's hidden dropout probability")
    attention_dropout: float | None = flag(None, "override the model's attention dropout probability")
    checkpoint_activations: bool = flag(
        False, "recompute activations in the backward pass (activation checkpointing)", group=MEMORY_AND_SPEED
    )
    recompute_granularity: str | None = flag(
        None,
        "full: recompute whole blocks; selective: keep matmul outputs, recompute the rest",
        choices=("full", "selective"),
        group=MEMORY_AND_SPEED,
    )
    recompute_num_layers: int | None = flag(
        None, "checkpoint only the first N transformer blocks (default: all)", group=MEMORY_AND_SPEED
    )
    offload_activations: bool = flag(
        False,
        "keep the tensors the forward pass saves for the backward in host memory (pinned, copied on a side "
        "stream) on CUDA; composes with --checkpoint-activations",
        group=MEMORY_AND_SPEED,
    )
    onnx_runtime_training: bool = flag(
        False,
        "graph optimisation with ONNX Runtime's ORTModule (torch.compile where it cannot run)",
        group=MEMORY_AND_SPEED,
    )
    torch_compile: bool = flag(False, "compile each transformer block with torch.compile", group=MEMORY_AND_SPEED)
    chunked_loss: bool = flag(
        True,
        "compute the output layer and its loss a chunk of tokens at a time, so the whole logits never exist "
        "(vocabularies of 8192 tokens or more); --no-chunked-loss for the plain lm_head + cross-entropy",
        negatable=True,
        group=MEMORY_AND_SPEED,
    )
    compile_mode: str = flag(
        "default",
        "torch.compile mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        group=MEMORY_AND_SPEED,
    )
    use_rotary_position_embeddings: bool = flag(False, "built-in GPT: --position-embedding-type rope", group=MEGATRON)
    no_position_embedding: bool = flag(
        False, "built-in GPT: no learned position table (with rotary positions)", group=MEGATRON
    )
    rotary_base: float | None = flag(None, "built-in GPT: rotary base (default 10000)", group=MEGATRON)
    rotary_percent: float = flag(1.0, "built-in GPT: only 1.0 (the whole head)", group=MEGATRON)
    disable_bias_linear: bool = flag(
        False, "built-in GPT: no biases in linear layers (nor in LayerNorm)", group=MEGATRON
    )
    use_ort: bool = derived(False, "--onnx-runtime-training runs ORTModule (else it became torch_compile)")


@dataclass(frozen=True)
class DataConfig:
    """The data: where it is, how it is tokenized, split, batched into sequences and loaded."""

    GROUP: ClassVar[str] = DATA

    seq_length: int | None = flag(
        None,
        "maximum sequence length (tokens); default: the task's (sequence_classification and token_classification "
        "128, question_answering 384, causal_lm 512, masked_lm and multiple_choice the model's limit up to 512, "
        "pretraining 1024 for GPT and 512 for BERT, seq2seq 1024 source tokens, dpo/kto/reward_model 1024 for prompt "
        "and response together); --max-length is TRL's name for it",
        aliases=("--max-length",),
        group=TASK_AND_MODEL,
    )
    data_path: list[str] | None = flag(
        None,
        "hub dataset name, local directory, or local file (one or more for pretraining); args.dataset_path is the "
        "same as one string (Rapidformer's name)",
        aliases=("--dataset-path",),
    )
    data_name: str | None = flag(
        None, "hub dataset configuration, e.g. mrpc (also args.dataset_name)", aliases=("--dataset-name",)
    )
    data_dir: str | None = flag(None, "hub dataset data_dir")
    split: str = flag(
        "969,30,1",
        "train,valid,test weights used to split a single data source (default %(default)s; under --eval-only without "
        "--split the data is not split: it is evaluated whole unless it has a validation split of its own)",
    )
    data_impl: str = flag("mmap", choices=("mmap", "infer", "lazy", "cached"))
    num_workers: int = flag(0, "data loader worker processes")
    streaming: bool = flag(
        False,
        "causal_lm and pretraining: read, tokenize and pack text as training consumes it (in --num-workers "
        "workers), never all in memory; needs --train-iters (docs/guides/streaming.md)",
    )
    tokenizer_type: str | None = flag(
        None,
        "pretraining: the tokenizer the data was preprocessed with",
        choices=TOKENIZER_TYPES,
    )
    vocab_file: str | None = flag(None, "vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    merge_file: str | None = flag(None, "merges.txt (GPT2BPETokenizer)")
    tokenizer_model: str | None = flag(None, "HuggingFaceTokenizer name/dir or SentencePiece model")
    vocab_size: int | None = flag(None, "NullTokenizer: the vocabulary size")
    eod_mask_loss: bool = flag(False, "GPT: no loss on end-of-document tokens")
    reset_position_ids: bool = flag(False, "GPT: positions restart after each EOD")
    reset_attention_mask: bool = flag(False, "GPT: attention does not cross EOD (built-in GPT)")
    mmap_warmup: bool = flag(False, "read the .bin files once before training")
    mask_prob: float = flag(
        0.15,
        "BERT pretraining and masked_lm: fraction of tokens to predict (80%% [MASK], 10%% random, 10%% kept)",
        aliases=("--mlm-probability",),
    )
    short_seq_prob: float = flag(0.1, "BERT: probability of a shorter sample than --seq-length")
    binary_head: bool = flag(
        True,
        "BERT: next-sentence prediction (needs --split-sentences data); --no-binary-head for masked LM only",
        negatable=True,
    )
    text_keys: list[str] | None = flag(None, "text column(s) of tabular data")
    label_key: str | None = flag(None, "label column of tabular data")
    group_by_length: bool = flag(
        False, "fine-tuning: shuffle in megabatches of 50 global batches sorted by length, so micro-batches pad little"
    )
    padding_free: bool = flag(
        False,
        "fine-tuning: each training micro-batch as one row of its samples' tokens (no padding), position ids "
        "restarting at each sample and attention kept inside it",
    )

    @property
    def source(self) -> tuple[str, str | None, str | None, str]:
        """A fine-tuning task's one data source as its loaders take it: the path, the hub configuration, the hub
        data_dir and the split weights."""
        return self.data_path[0], self.data_name, self.data_dir, self.split


@dataclass(frozen=True)
class TrainingConfig:
    """The run's length, batch, seed, evaluation and stopping rules."""

    GROUP: ClassVar[str] = TRAINING

    micro_batch_size: int = flag(8, "samples per rank per forward pass")
    global_batch_size: int | None = flag(
        None,
        "samples per optimizer step over all ranks (default: micro x data-parallel size); gradient accumulation = "
        "global / (micro x data-parallel size)",
    )
    epochs: int = flag(3, "epochs (Finetuner; default %(default)s)")
    train_iters: int | None = flag(None, "optimizer steps (PreTrainer); also bounds an epoch-based run")
    time_budget: float | None = flag(
        None,
        "size the run to end within MINUTES of the command's start: after a few timed steps it takes the iterations "
        "that fit (at most --train-iters or the epochs), the schedule decays over them; the embedded pretraining "
        "default uses 3.5 unless --train-iters is given",
        metavar="MINUTES",
    )
    seed: int = flag(1234)
    max_skipped_steps: int = flag(
        10,
        "stop after N optimizer steps in a row skipped for NaN/inf loss or gradients (0: never stop)",
        metavar="N",
        group=CHECKPOINTS_AND_LOGGING,
    )
    eval_interval: int | None = flag(
        None,
        "iterations between evaluations (PreTrainer; Finetuner evaluates each epoch)",
        group=CHECKPOINTS_AND_LOGGING,
    )
    eval_iters: int = flag(10, "batches per evaluation (PreTrainer)", group=CHECKPOINTS_AND_LOGGING)
    eval_only: bool = flag(
        False,
        "fine-tuning tasks and Finetuner scripts: evaluate the model on the validation data without training (data "
        "with no validation split is evaluated whole); no checkpoint or export is written",
        group=CHECKPOINTS_AND_LOGGING,
    )
    dry_run: bool = flag(
        False,
        "print the plan (device mesh, batch, strategy, precision) and each rank's predicted memory, then exit "
        "without training",
        group=CHECKPOINTS_AND_LOGGING,
    )
    memory_budget: float | None = flag(
        None,
        "with --dry-run: the memory of one device (GiB); the plan says whether the layout fits and the largest "
        "micro-batch that does",
        metavar="GIB",
        group=CHECKPOINTS_AND_LOGGING,
    )
    device_profile: str | None = flag(
        None,
        "with --dry-run: predict the step time, tokens/s per device, MFU and time to train on these devices: "
        "h100-sxm, h200, a100-80g, l40s, cpu (this machine, measured once and cached) or a JSON/YAML FILE "
        "(docs/guides/step-time.md); --nnodes and --nproc-per-node give the cluster",
        metavar="NAME|FILE",
        group=CHECKPOINTS_AND_LOGGING,
    )
    search: bool = flag(
        False,
        "with --dry-run, --device-profile and --memory-budget: the 5 fastest layouts that fit, among those the "
        "other flags leave open (parallel sizes, ZeRO stage, micro-batch, checkpointing, offload), each with its "
        "command line",
        group=CHECKPOINTS_AND_LOGGING,
    )
    train_samples: int | None = flag(None, "train for this many samples (instead of iters)", group=MEGATRON)
    train_tokens: int | None = flag(None, "train for N tokens: ceil(N / (global batch x --seq-length)) iterations")
    exit_interval: int | None = flag(
        None, "stop after an iteration divisible by this, saving a checkpoint (--save) to resume from", group=MEGATRON
    )
    exit_duration_in_mins: float | None = flag(
        None,
        "stop after the first step that ends this many minutes after the command's start, saving a checkpoint",
        group=MEGATRON,
    )
    gradient_accumulation_steps: int = derived(1, "global batch / (micro batch x data-parallel size)")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and the learning-rate schedule."""

    GROUP: ClassVar[str] = OPTIMIZER

    optimizer: str = flag(
        "adamw",
        "adamw8bit and paged_adamw8bit: AdamW with 8-bit moments from bitsandbytes (about a quarter of AdamW's state; "
        "paged: CUDA only), on one process, DDP or pipeline parallelism",
        choices=("adamw", "sgd", *EIGHT_BIT_OPTIMIZERS),
    )
    lr: float = flag(
        0.0001, "peak learning rate (default %(default)g; the embedded demos (--demo) start from their own)"
    )
    min_lr: float = flag(0.0)
    lr_decay_style: str = flag("linear", f"one of {', '.join(LR_DECAY_STYLES)}")
    lr_decay_iters: int | None = flag(None, "iterations to decay over (default: the run's total iterations)")
    lr_warmup_iters: int | None = flag(None)
    lr_warmup_fraction: float | None = flag(
        None, "warmup as a fraction of --lr-decay-iters (exclusive with --lr-warmup-iters)"
    )
    weight_decay: float = flag(0.01)
    loraplus_lr_ratio: float | None = flag(
        None,
        "LoRA+ (with --lora-rank): the B matrices (and 1-D trainable tensors, as peft groups them) learn at RATIO x "
        "the learning rate (e.g. 16)",
        metavar="RATIO",
    )
    clip_grad: float = flag(1.0, "max global gradient norm; 0 disables")
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_eps: float = flag(1e-08)
    sgd_momentum: float = flag(0.9)
    lr_decay_samples: int | None = flag(None, "decay over this many samples", group=MEGATRON)
    lr_warmup_samples: int | None = flag(None, "warm up over this many samples", group=MEGATRON)

    @property
    def eight_bit(self) -> bool:
        """bitsandbytes' 8-bit AdamW (``--optimizer adamw8bit`` or ``paged_adamw8bit``)."""
        return self.optimizer in EIGHT_BIT_OPTIMIZERS


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters and quantised base weights (``lora_rank`` 0: full fine-tuning)."""

    GROUP: ClassVar[str] = LORA

    lora_rank: int = flag(0, "train LoRA adapters of rank R instead of every weight (0: full fine-tuning)", metavar="R")
    lora_alpha: float | None = flag(None, "LoRA scaling numerator (default: 2 x rank)")
    lora_dropout: float = flag(0.0, "dropout on the LoRA input")
    lora_target_modules: list[str] | None = flag(
        None, "module names to adapt (e.g. q_proj v_proj, or all-linear; default: the model family's)", metavar="NAME"
    )
    lora_modules_to_save: list[str] | None = flag(
        None, "modules trained in full beside the adapters (e.g. a classification head)", metavar="NAME"
    )
    merge_lora: bool = flag(False, "also export the adapters merged into the base weights as one model in SAVE/hf")
    use_dora: bool = flag(
        False, "DoRA: each adapted weight is a trained magnitude times the direction of W + BA (peft's use_dora)"
    )
    use_rslora: bool = flag(False, "rank-stabilised LoRA: scale the adapters by alpha / sqrt(rank), not alpha / rank")
    lora_init: str = flag(
        "default",
        "how the adapters start: default (A Kaiming-uniform, B zero), gaussian (A normal), pissa (A and B from the "
        "weight's principal singular vectors; the base keeps the residual), olora (from a QR decomposition)",
        choices=("default", "gaussian", "pissa", "olora"),
    )
    load_in_4bit: bool = flag(
        False, "frozen base weights in 4-bit NF4 (QLoRA); the compute dtype follows the precision flags"
    )
    bnb_4bit_quant_type: str = flag("nf4", "4-bit data type", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = flag(False, "quantise the 4-bit scales too (about 0.4 bit per weight less)")
    load_in_8bit: bool = flag(False, "frozen base weights in 8-bit (LLM.int8)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def quantized(self) -> bool:
        return self.load_in_4bit or self.load_in_8bit

    @property
    def quant_flag(self) -> str:
        return "--load-in-4bit" if self.load_in_4bit else "--load-in-8bit"


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference training's shared flags: the prompt cut and the reference model (``--task dpo`` and ``kto``,
    the prompt cut also ``grpo`` and ``rloo``; TRL's names and defaults). Each task's loss options, ``--beta``
    among them, are its own (``DpoOptions``, ``KtoOptions``, ``GrpoOptions``, ``RlooOptions``)."""

    GROUP: ClassVar[str] = PREFERENCE

    max_prompt_length: int | None = flag(
        None,
        "dpo, kto, grpo, rloo: prompt tokens kept (its start is cut); for dpo and kto --max-length (--seq-length) "
        "cuts the rest",
    )
    precompute_ref_logprobs: bool = flag(
        False,
        "dpo, kto: score the data with the reference once before training (cached beside the data), then train with "
        "no reference model in memory",
    )
