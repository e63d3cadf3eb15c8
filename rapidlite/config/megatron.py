"""Megatron-LM's flags that a pretraining script carries and rapidlite has no flag of its own for.

A script written for Megatron-LM (``pretrain_gpt.py`` with its example arguments) runs with its flags as they
are. Each one below is either translated into rapidlite's terms (``--train-samples`` an iteration count of
the constant global batch, ...), refused in one line where rapidlite cannot do what it asks, or accepted
with one line at the start naming it and why it changes nothing here (a fused kernel rapidlite does not have,
an overlap PyTorch does on its own). None is ignored silently. ``--use-distributed-optimizer`` (ZeRO-1) is a
layout: ``rapidlite.resolve.topology`` maps it with the other spellings of one.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rapidlite.errors import ConfigError

# Flags that change nothing in rapidlite: the flag, its argparse keywords, and why it has no effect.
NO_EFFECT: dict[str, tuple[dict[str, Any], str]] = {
    "--use-flash-attn": ({"action": "store_true"}, "attention runs through SDPA, flash kernels on CUDA"),
    "--attention-backend": ({}, "attention runs through SDPA, which picks its kernel"),
    "--use-mcore-models": ({"action": "store_true"}, "rapidlite has one GPT implementation"),
    "--use-legacy-models": ({"action": "store_true"}, "rapidlite has one GPT implementation"),
    "--transformer-impl": ({}, "rapidlite's blocks are PyTorch modules"),
    "--no-masked-softmax-fusion": ({"action": "store_true"}, "no fused softmax kernel to turn off"),
    "--no-bias-gelu-fusion": ({"action": "store_true"}, "no fused bias-GeLU kernel to turn off"),
    "--no-bias-swiglu-fusion": ({"action": "store_true"}, "no fused bias-SwiGLU kernel to turn off"),
    "--no-bias-dropout-fusion": ({"action": "store_true"}, "no fused bias-dropout kernel to turn off"),
    "--no-rope-fusion": ({"action": "store_true"}, "no fused rotary kernel to turn off"),
    "--no-gradient-accumulation-fusion": ({"action": "store_true"}, "no fused weight-gradient kernel to turn off"),
    "--no-async-tensor-model-parallel-allreduce": ({"action": "store_true"}, "DTensor schedules the collectives"),
    "--overlap-grad-reduce": ({"action": "store_true"}, "DDP and FSDP2 overlap gradient reduction already"),
    "--overlap-param-gather": ({"action": "store_true"}, "FSDP2 prefetches parameters already"),
    "--DDP-impl": ({}, "data parallelism is PyTorch's DDP"),
    "--accumulate-allreduce-grads-in-fp32": ({"action": "store_true"}, "gradients are accumulated in fp32"),
    "--attention-softmax-in-fp32": ({"action": "store_true"}, "SDPA's softmax accumulates in fp32"),
    "--apply-query-key-layer-scaling": ({"action": "store_true"}, "SDPA keeps fp16 scores in range without it"),
    "--empty-unused-memory-level": ({"type": int}, "PyTorch's caching allocator is left to itself"),
    "--use-cpu-initialization": ({"action": "store_true"}, "weights are initialised where the model is built"),
    "--distribute-saved-activations": ({"action": "store_true"}, "recomputed blocks keep only their input"),
    "--log-throughput": ({"action": "store_true"}, "throughput is always logged"),
    "--timing-log-level": ({"type": int}, "rapidlite logs step times, not Megatron's timers"),
    "--log-timers-to-tensorboard": ({"action": "store_true"}, "rapidlite logs step times, not Megatron's timers"),
    "--log-memory-to-tensorboard": ({"action": "store_true"}, "peak memory is always logged"),
    "--log-validation-ppl-to-tensorboard": ({"action": "store_true"}, "validation perplexity is always logged"),
    "--tensorboard-log-interval": ({"type": int}, "TensorBoard gets every --log-interval"),
    "--ckpt-format": ({}, "rapidlite writes its own checkpoints (safetensors and torch files per rank)"),
    "--dataloader-type": ({}, "samples are read in Megatron's 'single' order"),
    "--no-save-rng": ({"action": "store_true"}, "the RNG states are a few kilobytes and keep a resume exact"),
    "--data-cache-path": ({}, "indices are cached beside the data (PREFIX_cache/), else under $RAPIDLITE_CACHE"),
    "--moe-permute-fusion": ({"action": "store_true"}, "no fused token-permutation kernel to turn on"),
    "--moe-router-dtype": ({}, "the router's probabilities are computed in fp32"),
    "--moe-shared-expert-overlap": ({"action": "store_true"}, "the shared expert runs beside the routed ones"),
}


MEGATRON_DESCRIPTION = (
    "Megatron's flags a pretrain_gpt.py script carries: the ones below are translated; "
    + ", ".join(NO_EFFECT)
    + " are accepted and one line names them (nothing to change here)"
)


def add_megatron_args(g: argparse._ArgumentGroup) -> None:
    """The Megatron flags no settings section declares: refused ones, and the ones with nothing to change here
    (the translated ones are fields of the sections, in the same ``--help`` group)."""
    g.add_argument("--bert-no-binary-head", dest="binary_head", action="store_false", help="BERT: --no-binary-head")
    g.add_argument("--group-query-attention", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--num-query-groups", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--kv-channels", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    for flag in ("--train-data-path", "--valid-data-path", "--test-data-path"):
        g.add_argument(flag, nargs="+", default=None, help=argparse.SUPPRESS)
    for flag, (kwargs, _) in NO_EFFECT.items():
        g.add_argument(flag, help=argparse.SUPPRESS, **({"default": None} | kwargs))


def _flag(dest: str) -> str:
    return dest.replace("_", "-")


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest)
    return value is not None and value is not False


def check_megatron_flags(args: argparse.Namespace) -> list[str]:
    """Before the batch is resolved: refuse what rapidlite cannot do, translate the flags that need no batch
    arithmetic; returns the notice naming the flags that change nothing here."""
    if args.group_query_attention or args.num_query_groups is not None:
        heads = args.num_attention_heads
        if not (args.num_query_groups is not None and heads is not None and args.num_query_groups == heads):
            raise ConfigError(
                "--group-query-attention: the built-in GPT has one key/value head per query head; pretrain a LLaMA "
                "config with num_key_value_heads instead (--pretrained-model-name-or-path DIR)"
            )
    if args.kv_channels is not None:
        heads, hidden = args.num_attention_heads, args.hidden_size
        if not (heads and hidden and args.kv_channels * heads == hidden):
            raise ConfigError(
                f"--kv-channels {args.kv_channels}: the built-in GPT's head size is --hidden-size / "
                "--num-attention-heads; drop --kv-channels"
            )
    if args.rotary_percent != 1.0:
        raise ConfigError(
            f"--rotary-percent {args.rotary_percent:g}: the built-in GPT rotates whole heads; drop it (1.0)"
        )
    if args.rampup_batch_size is not None:
        raise ConfigError("--rampup-batch-size: the global batch is constant here; give --global-batch-size only")
    for dest in ("train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, dest) is not None:
            raise ConfigError(
                f"--{dest.replace('_', '-')}: give one --data-path (prefixes, or weight-prefix pairs) and divide it "
                "with --split"
            )
    # An iteration count an embedded demo filled in gives way to the samples asked for.
    given = args.explicit_flags if args.explicit_flags is not None else frozenset(vars(args))
    demo_values = args.demo_defaults
    for samples, iters in (
        ("train_samples", "train_iters"),
        ("train_tokens", "train_iters"),
        ("lr_decay_samples", "lr_decay_iters"),
    ):
        if getattr(args, samples) is not None and getattr(args, iters) is not None:
            if iters in given and iters not in demo_values:
                raise ConfigError(f"--{_flag(samples)} and --{_flag(iters)} are exclusive: give one of them")
    if args.train_samples is not None and args.train_tokens is not None:
        raise ConfigError("--train-samples and --train-tokens are exclusive: give one of them")
    warmups = [args.lr_warmup_samples, args.lr_warmup_iters, args.lr_warmup_fraction]
    if args.lr_warmup_samples is not None and sum(w is not None for w in warmups) > 1:
        raise ConfigError("--lr-warmup-samples, --lr-warmup-iters and --lr-warmup-fraction are exclusive: give one")
    for dest in ("train_samples", "train_tokens", "lr_decay_samples", "exit_interval"):
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ConfigError(f"--{dest.replace('_', '-')} {value}: must be a positive integer")
    if args.lr_warmup_samples is not None and args.lr_warmup_samples < 0:
        raise ConfigError(f"--lr-warmup-samples {args.lr_warmup_samples}: must be >= 0")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins}: must be positive")

    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.no_position_embedding and args.position_embedding_type != "rope":
        raise ConfigError(
            "--no-position-embedding: the built-in GPT needs positions; add --position-embedding-type rope"
        )
    given = [flag for flag in NO_EFFECT if _given(args, flag.lstrip("-").replace("-", "_"))]
    if not given:
        return []
    return [
        "Megatron-LM flags with nothing to change here: "
        + "; ".join(f"{flag} ({NO_EFFECT[flag][1]})" for flag in given)
    ]


def samples_to_iterations(args: argparse.Namespace) -> None:
    """After the batch is resolved: ``--train-samples``/``--lr-decay-samples``/``--lr-warmup-samples`` as
    iterations of the global batch (rounded up, as Megatron does), and ``--train-tokens`` as iterations of the
    global batch's sequences."""
    batch = args.global_batch_size
    for samples, iters in (
        ("train_samples", "train_iters"),
        ("lr_decay_samples", "lr_decay_iters"),
        ("lr_warmup_samples", "lr_warmup_iters"),
    ):
        value = getattr(args, samples)
        if value is not None:
            setattr(args, iters, math.ceil(value / batch))
    if args.train_tokens is not None:
        if args.seq_length is None:
            raise ConfigError(
                f"--train-tokens {args.train_tokens}: an iteration is --global-batch-size x --seq-length tokens; "
                "give --seq-length"
            )
        args.train_iters = math.ceil(args.train_tokens / (batch * args.seq_length))
