"""Command-line flags: Megatron's and Rapidformer's names, grouped, each default in one place (its flag).

``parse`` reads argv once into an ``argparse.Namespace`` (which flags were given is recorded in the same
pass, as ``explicit_flags``); ``rapidlite.resolve.resolve`` then checks it and derives everything else into
the frozen ``RunConfig`` every other module reads. ``parse_args`` is the two in a row.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rapidlite import config_file
from rapidlite.errors import ConfigError
from rapidlite.megatron_flags import add_megatron_args
from rapidlite.resolve import LR_DECAY_STYLES, RunConfig, resolve
from rapidlite.tasks.registry import task_names

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
)

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite --help')")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}") from None


def _add_task_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("task and model")
    g.add_argument("--task", default=None, help=f"black-box task: {', '.join(task_names())}")
    g.add_argument(
        "--user-script",
        default=None,
        metavar="PATH",
        help="run a user's Finetuner/PreTrainer script (white box)",
    )
    g.add_argument(
        "--demo",
        action="store_true",
        help="run the task on an embedded offline default (tiny model and generated data)",
    )
    g.add_argument(
        "--pretrained-model-name-or-path",
        default=None,
        metavar="NAME_OR_DIR",
        help="Hugging Face model name or local directory",
    )
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="maximum sequence length (tokens); default: the task's (sequence_classification and "
        "token_classification 128, question_answering 384, causal_lm 512, masked_lm and multiple_choice the "
        "model's limit up to 512, pretraining 1024 for GPT and 512 for BERT, seq2seq 1024 source tokens)",
    )
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="built-in GPT: pad the vocabulary to a multiple of this",
    )
    g.add_argument("--init-method-std", type=float, default=0.02, help="built-in GPT: std of the normal init")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm", help="built-in GPT")
    g.add_argument("--swiglu", action="store_true", help="built-in GPT: SwiGLU MLP (LLaMA-style)")
    g.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="built-in GPT",
    )
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="built-in GPT: a separate output layer instead of the input embedding's transpose",
    )
    g.add_argument(
        "--load-pretrained-weights",
        action="store_true",
        help="--task pretraining: start from the weights of --pretrained-model-name-or-path (default: its config only)",
    )
    g.add_argument("--hidden-dropout", type=float, default=None, help="override the model's hidden dropout probability")
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="override the model's attention dropout probability",
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per rank per forward pass")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step over all ranks (default: micro x data-parallel size); "
        "gradient accumulation = global / (micro x data-parallel size)",
    )
    g.add_argument("--epochs", type=int, default=3, help="epochs (Finetuner; default %(default)s)")
    g.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="optimizer steps (PreTrainer); also bounds an epoch-based run",
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="MINUTES",
        help="size the run to end within MINUTES of the command's start: after a few timed steps it takes the "
        "iterations that fit (at most --train-iters or the epochs), the schedule decays over them; the embedded "
        "pretraining default uses 3.5 unless --train-iters is given",
    )
    g.add_argument("--seed", type=int, default=1234)


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="peak learning rate (default %(default)g; the embedded demos (--demo) start from their own)",
    )
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", help=f"one of {', '.join(LR_DECAY_STYLES)}")
    g.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iterations to decay over (default: the run's total iterations)",
    )
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warmup as a fraction of --lr-decay-iters (exclusive with --lr-warmup-iters)",
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max global gradient norm; 0 disables")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 autocast where the device runs it fast (Ampere+ GPUs, CPUs with AVX-512 BF16/AMX); fp16 with "
        "loss scaling on older GPUs; fp32 on other CPUs",
    )
    g.add_argument("--fp16", action="store_true", help="fp16 autocast with dynamic loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast")
    g.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fp32 matrix multiplies on TF32 tensor cores (CUDA; default: on for Ampere and newer GPUs)",
    )
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale for fp16 (default: dynamic)")
    g.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**16,
        help="fp16's first dynamic loss scale (2^16, as DeepSpeed and Apex start)",
    )
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000, help="clean steps before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the dynamic scale halves")


def _add_memory_speed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory and speed")
    g.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute activations in the backward pass (activation checkpointing)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="full: recompute whole blocks; selective: keep matmul outputs, recompute the rest",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="checkpoint only the first N transformer blocks (default: all)",
    )
    g.add_argument(
        "--zero-1-memory-optimization",
        action="store_true",
        help="shard optimizer state across data-parallel ranks",
    )
    g.add_argument("--zero-2-memory-optimization", action="store_true", help="shard optimizer state and gradients")
    g.add_argument(
        "--zero-3-memory-optimization",
        action="store_true",
        help="shard optimizer state, gradients and parameters",
    )
    g.add_argument("--fsdp-memory-optimization", action="store_true", help="fully sharded data parallel")
    g.add_argument("--cpu-offload", action="store_true", help="keep optimizer state in host memory")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tensor parallelism: also split norms, dropout and the residual stream along the sequence",
    )
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--pipeline-schedule",
        choices=("gpipe", "1f1b", "interleaved-1f1b"),
        default=None,
        help="pipeline schedule (default 1f1b; interleaved-1f1b with virtual stages)",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual stage: each rank runs several stages (interleaved 1F1B)",
    )
    g.add_argument(
        "--pipeline-split",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="layers per pipeline stage (default: as even as possible)",
    )
    g.add_argument(
        "--onnx-runtime-training",
        action="store_true",
        help="graph optimisation with ONNX Runtime's ORTModule (torch.compile where it cannot run)",
    )
    g.add_argument("--torch-compile", action="store_true", help="compile each transformer block with torch.compile")
    g.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode",
    )


def _add_deepspeed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DeepSpeed backend (pip install 'rapidlite[deepspeed]')")
    g.add_argument(
        "--deepspeed",
        action="store_true",
        help="train through deepspeed.initialize; the ZeRO, precision, batch and clipping flags become its config",
    )
    g.add_argument(
        "--deepspeed-config",
        default=None,
        metavar="JSON",
        help="a DeepSpeed config file (implies --deepspeed); flags given on the command line win over its values",
    )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA and quantisation (peft; 4-bit/8-bit: pip install 'rapidlite[quant]')")
    g.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="train LoRA adapters of rank R instead of every weight (0: full fine-tuning)",
    )
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA scaling numerator (default: 2 x rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input")
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="module names to adapt (e.g. q_proj v_proj, or all-linear; default: the model family's)",
    )
    g.add_argument(
        "--lora-modules-to-save",
        nargs="+",
        default=None,
        metavar="NAME",
        help="modules trained in full beside the adapters (e.g. a classification head)",
    )
    g.add_argument(
        "--merge-lora",
        action="store_true",
        help="also export the adapters merged into the base weights as one model in SAVE/hf",
    )
    g.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="frozen base weights in 4-bit NF4 (QLoRA); the compute dtype follows the precision flags",
    )
    g.add_argument("--bnb-4bit-quant-type", choices=("nf4", "fp4"), default="nf4", help="4-bit data type")
    g.add_argument(
        "--bnb-4bit-use-double-quant",
        action="store_true",
        help="quantise the 4-bit scales too (about 0.4 bit per weight less)",
    )
    g.add_argument("--load-in-8bit", action="store_true", help="frozen base weights in 8-bit (LLM.int8)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        "--dataset-path",
        nargs="+",
        default=None,
        help="hub dataset name, local directory, or local file (one or more for pretraining); "
        "args.dataset_path is the same as one string (Rapidformer's name)",
    )
    g.add_argument(
        "--data-name",
        "--dataset-name",
        default=None,
        help="hub dataset configuration, e.g. mrpc (also args.dataset_name)",
    )
    g.add_argument("--data-dir", default=None, help="hub dataset data_dir")
    g.add_argument(
        "--split",
        default="969,30,1",
        help="train,valid,test weights used to split a single data source (default %(default)s; under --eval-only "
        "without --split the data is not split: it is evaluated whole unless it has a validation split of its own)",
    )
    g.add_argument("--data-impl", choices=("mmap", "infer", "lazy", "cached"), default="mmap")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")
    g.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="pretraining: the tokenizer the data was preprocessed with",
    )
    g.add_argument("--vocab-file", default=None, help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer name/dir or SentencePiece model")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the vocabulary size")
    g.add_argument("--eod-mask-loss", action="store_true", help="GPT: no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="GPT: positions restart after each EOD")
    g.add_argument(
        "--reset-attention-mask", action="store_true", help="GPT: attention does not cross EOD (built-in GPT)"
    )
    g.add_argument("--mmap-warmup", action="store_true", help="read the .bin files once before training")
    g.add_argument(
        "--mask-prob",
        "--mlm-probability",
        type=float,
        default=0.15,
        help="BERT pretraining and masked_lm: fraction of tokens to predict (80%% [MASK], 10%% random, 10%% kept)",
    )
    g.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="BERT: probability of a shorter sample than --seq-length"
    )
    g.add_argument(
        "--binary-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BERT: next-sentence prediction (needs --split-sentences data); --no-binary-head for masked LM only",
    )
    g.add_argument("--text-keys", nargs="+", default=None, help="text column(s) of tabular data")
    g.add_argument("--label-key", default=None, help="label column of tabular data")
    g.add_argument("--prompt-key", default=None, help="causal_lm: the prompt column of prompt/response data")
    g.add_argument("--response-key", default=None, help="causal_lm: the response column of prompt/response data")
    g.add_argument(
        "--prompt-template",
        default="auto",
        help="causal_lm: how prompt fields become text: auto, alpaca, chatml, none or a file with {prompt} fields",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="causal_lm: chat data's template when the tokenizer has none: chatml or FILE",
    )
    g.add_argument("--train-on-prompt", action="store_true", help="causal_lm: the prompt tokens train too")
    g.add_argument(
        "--packing", action="store_true", help="causal_lm: pack samples into full sequences (attention kept per sample)"
    )
    g.add_argument(
        "--doc-stride",
        type=int,
        default=128,
        help="question_answering: tokens shared by consecutive windows of a context longer than --seq-length",
    )
    g.add_argument(
        "--max-answer-length", type=int, default=30, help="question_answering: the longest answer predicted, in tokens"
    )
    g.add_argument(
        "--n-best-size",
        type=int,
        default=20,
        help="question_answering: start and end logits searched per window for the best answer",
    )
    g.add_argument(
        "--version-2-with-negative",
        action="store_true",
        help="question_answering: SQuAD v2 data, where some questions have no answer",
    )
    g.add_argument(
        "--null-score-diff-threshold",
        type=float,
        default=0.0,
        help="question_answering (v2): answer nothing when the null score beats the best span's by more than this",
    )
    g.add_argument(
        "--whole-word-masking",
        action="store_true",
        help="masked_lm: mask every sub-token of a chosen word together (needs a fast tokenizer)",
    )
    g.add_argument(
        "--line-by-line",
        action="store_true",
        help="masked_lm: one sample per document (cut at --seq-length) instead of blocks of concatenated text",
    )
    g.add_argument(
        "--choices-key",
        nargs="+",
        default=None,
        help="multiple_choice: the column holding the list of choices, or one column per choice (ending0 ending1 ...)",
    )
    g.add_argument(
        "--group-by-length",
        action="store_true",
        help="fine-tuning: shuffle in megabatches of 50 global batches sorted by length, so micro-batches pad little",
    )
    g.add_argument(
        "--padding-free",
        action="store_true",
        help="fine-tuning: each training micro-batch as one row of its samples' tokens (no padding), position ids "
        "restarting at each sample and attention kept inside it",
    )
    g.add_argument(
        "--eval-generate",
        type=int,
        default=0,
        metavar="N",
        help="causal_lm: print N greedy completions of validation prompts at each evaluation (with exact match)",
    )
    g.add_argument(
        "--label-all-tokens",
        action="store_true",
        help="token_classification: every sub-token of a word trains on its tag (B- as I- after the first), "
        "not only the first",
    )
    g.add_argument("--source-lang", default=None, help="seq2seq: the source language of translation pairs (e.g. en)")
    g.add_argument("--target-lang", default=None, help="seq2seq: the target language of translation pairs (e.g. de)")
    g.add_argument(
        "--source-prefix",
        default=None,
        help="seq2seq: text put before every source, as T5 expects (e.g. 'summarize: ')",
    )
    g.add_argument(
        "--max-target-length",
        type=int,
        default=None,
        help="seq2seq: target tokens kept for training and generated at most in evaluation (default 128)",
    )
    g.add_argument(
        "--num-beams",
        type=int,
        default=None,
        help="seq2seq: beam search width of evaluation's generation (default: the model's generation config)",
    )


def _add_checkpoint_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints, logging and evaluation")
    g.add_argument("--save", default=None, metavar="DIR", help="checkpoint directory (also metrics.jsonl)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="N",
        help="after each save, delete the checkpoints older than the newest N (the one just saved always stays)",
    )
    g.add_argument("--load", default=None, metavar="DIR", help="resume from DIR/latest")
    g.add_argument("--finetune", action="store_true", help="with --load: load weights only and restart at iteration 0")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a --save directory that holds another run (its checkpoints, export and metrics "
        "are removed); without it such a directory is refused unless --load resumes it",
    )
    g.add_argument(
        "--max-skipped-steps",
        type=int,
        default=10,
        metavar="N",
        help="stop after N optimizer steps in a row skipped for NaN/inf loss or gradients (0: never stop)",
    )
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (drawn only on an interactive terminal; also RAPIDLITE_NO_PROGRESS=1)",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="iterations between evaluations (PreTrainer; Finetuner evaluates each epoch)",
    )
    g.add_argument("--eval-iters", type=int, default=10, help="batches per evaluation (PreTrainer)")
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="fine-tuning tasks and Finetuner scripts: evaluate the model on the validation data without training "
        "(data with no validation split is evaluated whole); no checkpoint or export is written",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (device mesh, batch, strategy, precision) and each rank's predicted memory, then exit "
        "without training",
    )
    g.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="GIB",
        help="with --dry-run: the memory of one device (GiB); the plan says whether the layout fits and the "
        "largest micro-batch that does",
    )
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--wandb-project",
        default=None,
        metavar="NAME",
        help="also report every metrics record and the run's settings to this Weights & Biases project (rank 0; "
        "pip install 'rapidlite[wandb]')",
    )
    g.add_argument("--wandb-entity", default=None, metavar="TEAM", help="W&B user or team (default: W&B's)")
    g.add_argument("--wandb-run-name", default=None, metavar="NAME", help="W&B run name (default: W&B's)")
    g.add_argument(
        "--wandb-mode",
        choices=("online", "offline", "disabled"),
        default=None,
        help="W&B mode (default: $WANDB_MODE, else online); offline writes the run locally for 'wandb sync'",
    )
    g.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        metavar="FLOP/S",
        help="one device's peak, for the MFU in the logs (default: a known GPU's datasheet peak at the training "
        "precision; measure a CPU's with rapidlite-bench peak)",
    )


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: visible GPUs, else 1)"
    )
    g.add_argument("--nnodes", type=int, default=None, help="nodes (default: $NNODES or 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: $NODE_RANK or 0)")
    g.add_argument("--master-addr", default=None, help="rendezvous host (default: $MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: $MASTER_PORT)")
    g.add_argument(
        "--distributed-backend", choices=("nccl", "gloo"), default=None, help="default: nccl on GPUs, else gloo"
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="collective timeout")
    g.add_argument(
        "--max-restarts", type=int, default=0, help="restarts of the whole worker group after a failure (torchrun)"
    )
    g.add_argument("--per-rank-logs", action="store_true", help="every rank also logs to --save DIR/logs/rank<R>.log")


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog="rapidlite",
        description="Train transformer models with Megatron-style flags.",
        epilog="other commands: 'rapidlite env [--json]' reports versions, hardware and usable kernels for a bug "
        "report; 'rapidlite plot DIR' draws DIR/curves.png from a --save directory's metrics.jsonl",
        allow_abbrev=False,
    )
    p.add_argument(
        config_file.FLAG,
        default=None,
        metavar="FILE",
        help="flags from a YAML or JSON file (keys are flag names: 'micro-batch-size: 8'); the command line wins",
    )
    for add in (
        _add_task_args,
        _add_training_args,
        _add_optimizer_args,
        _add_precision_args,
        _add_memory_speed_args,
        _add_deepspeed_args,
        _add_lora_args,
        _add_data_args,
        _add_checkpoint_logging_args,
        _add_distributed_args,
        add_megatron_args,
    ):
        add(p)
    if extra_args_provider is not None:
        try:
            returned = extra_args_provider(p)  # the parser, or None (Megatron's providers return it, others do not)
        except argparse.ArgumentError as e:
            raise ConfigError(_conflict_message(p, e)) from None
        p = returned if isinstance(returned, argparse.ArgumentParser) else p
    return p


def _conflict_message(parser: argparse.ArgumentParser, error: argparse.ArgumentError) -> str:
    """The line for a script's flag that rapidlite already has: read rapidlite's, or rename the script's."""
    if "conflicting option string" not in str(error):
        return f"extra_args_provider: {error}"
    taken = str(error).rsplit(":", 1)[-1].strip().split(", ")
    dest = next((a.dest for a in parser._actions for o in taken if o in a.option_strings), None)
    read = f"read it as get_args().{dest}" if dest else "read rapidlite's"
    return (
        f"extra_args_provider adds {', '.join(taken)}, which rapidlite already has: {read} instead of adding it, "
        "or give the script's flag another name"
    )


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_UNSET = _Unset()
# Actions that replace the value (every flag of rapidlite's own): only these can tell given from defaulted.
_SETS_VALUE = (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction)


def parse_known(
    argv: Sequence[str] | None = None, extra_args_provider: ExtraArgsProvider | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse argv once; return the flags and the arguments no flag of the parser took (a user script's own).

    Every flag starts as "not given" and takes its parser default afterwards, so the same pass records in
    ``explicit_flags`` which flags the command line set (a DeepSpeed file supplies only the others). A ``--config``
    file's flags come first in the same pass (``rapidlite.config_file``): given, and overridden by the command line.
    """
    namespace, unknown, unknown_keys = _parse_known(argv, extra_args_provider)
    if unknown_keys and namespace.user_script is None:  # a --user-script's own flags are its engine's to check
        raise ConfigError(unknown_keys[0])
    return namespace, unknown


def _parse_known(
    argv: Sequence[str] | None, extra_args_provider: ExtraArgsProvider | None
) -> tuple[argparse.Namespace, list[str], list[str]]:
    parser = build_parser(extra_args_provider)
    argv, unknown_keys = config_file.expand(sys.argv[1:] if argv is None else argv, parser)
    actions = [a for a in parser._actions if a.dest != argparse.SUPPRESS and a.default != argparse.SUPPRESS]
    probe = argparse.Namespace(**{a.dest: _UNSET for a in actions})
    for action in actions:
        if not isinstance(action, _SETS_VALUE):
            # append/count/extend (a script's own flags) build on the value in place: they start from the default
            setattr(probe, action.dest, parser.get_default(action.dest))
    namespace, unknown = parser.parse_known_args(argv, probe)
    explicit = frozenset(dest for dest, value in vars(namespace).items() if value is not _UNSET)
    for action in actions:
        if getattr(namespace, action.dest) is _UNSET:
            default = parser.get_default(action.dest)
            if isinstance(default, str) and callable(action.type):
                default = action.type(default)  # as argparse converts a string default
            setattr(namespace, action.dest, default)
    namespace.explicit_flags = explicit
    return namespace, unknown, unknown_keys


def parse(
    argv: Sequence[str] | None = None, extra_args_provider: ExtraArgsProvider | None = None
) -> argparse.Namespace:
    """Parse argv once; an argument no flag takes is a ``ConfigError``."""
    namespace, unknown, unknown_keys = _parse_known(argv, extra_args_provider)
    if unknown_keys:
        raise ConfigError(unknown_keys[0])
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (see 'rapidlite --help')")
    return namespace


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: ExtraArgsProvider | None = None,
    require_task: bool = True,
) -> RunConfig:
    """Parse argv once and resolve it (``rapidlite.resolve.resolve``); raise ``ConfigError`` (one line) on any
    contradiction."""
    return resolve(parse(argv, extra_args_provider), require_task=require_task)
