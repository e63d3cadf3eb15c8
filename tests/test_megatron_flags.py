"""Megatron-LM's flags a pretrain_gpt.py script carries: translated (ZeRO-1, sample counts, rotary aliases, the
built-in GPT's bias and rotary base, exit interval and duration), refused in one line, or named in one line as
changing nothing here. A flag is never taken and ignored in silence."""

import json
import shlex

import pytest

from helpers import ToyFinetuner, engine, read_metrics
from rapidlite.errors import ConfigError
from rapidlite.models.gpt import GPTConfig
from rapidlite.resolve import parse_args
from rapidlite.runtime import time_budget

BASE = ["--task", "pretraining", "--micro-batch-size", "2", "--global-batch-size", "8"]

# The flags of Megatron-LM's GPT-3 and LLaMA example scripts (sizes scaled down), as a user pastes them.
MEGATRON_SCRIPT = """
--use-mcore-models --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
--max-position-embeddings 64 --attention-backend auto --micro-batch-size 2 --global-batch-size 8 --train-iters 20
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --bf16 --lr 6.0e-5
--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 20
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-flash-attn --disable-bias-linear --swiglu --normalization RMSNorm
--untie-embeddings-and-output-weights --position-embedding-type rope --no-position-embedding --rotary-base 500000
--no-masked-softmax-fusion --attention-softmax-in-fp32 --transformer-impl local --log-throughput
--log-interval 10 --eval-interval 10 --eval-iters 2 --split 949,50,1 --ckpt-format torch
"""


def resolved(*argv: str):
    return parse_args([*BASE, *argv])


def test_a_megatron_example_script_is_accepted_and_named():
    args = resolved(*shlex.split(MEGATRON_SCRIPT))
    assert args.zero_1_memory_optimization  # the distributed optimizer is ZeRO-1
    config = GPTConfig.of(args.sections, vocab_size=100)
    assert (config.rotary_base, config.bias, config.position_embedding_type) == (500000.0, False, "rope")
    (line,) = [n for n in args.notices if n.startswith("Megatron-LM flags")]
    for flag in ("--use-mcore-models", "--use-flash-attn", "--overlap-grad-reduce", "--ckpt-format"):
        assert flag in line
    assert "--use-distributed-optimizer" not in line and "--swiglu" not in line


def test_translations():
    args = resolved("--train-samples", "100", "--lr-decay-samples", "80", "--lr-warmup-samples", "9")
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (13, 10, 2)  # rounded up
    assert resolved("--train-iters", "5", "--use-rotary-position-embeddings").position_embedding_type == "rope"
    zero3 = resolved("--train-iters", "5", "--use-distributed-optimizer", "--zero-3-memory-optimization")
    assert zero3.zero_3_memory_optimization and not zero3.zero_1_memory_optimization  # it shards the state already
    assert not [n for n in resolved("--train-iters", "5").notices if "Megatron" in n]
    assert (
        resolved("--train-iters", "5").binary_head
        and not resolved("--train-iters", "5", "--bert-no-binary-head").binary_head
    )


def test_samples_replace_the_embedded_defaults_length():
    args = parse_args(["--task", "pretraining", "--train-samples", "64"])
    assert args.train_iters == -(-64 // args.global_batch_size) and args.time_budget is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--train-iters", "5", "--train-samples", "40"], "--train-samples and --train-iters are exclusive"),
        (["--train-iters", "5", "--lr-warmup-samples", "8", "--lr-warmup-iters", "1"], "exclusive"),
        (["--train-iters", "5", "--group-query-attention", "--num-query-groups", "2"], "num_key_value_heads"),
        (["--train-iters", "5", "--num-attention-heads", "4", "--hidden-size", "64", "--kv-channels", "8"],
         "drop --kv-channels"),
        (["--train-iters", "5", "--rotary-percent", "0.5"], "rotates whole heads"),
        (["--train-iters", "5", "--rampup-batch-size", "2", "2", "100"], "the global batch is constant"),
        (["--train-iters", "5", "--train-data-path", "a"], "divide it with --split"),
        (["--train-iters", "5", "--no-position-embedding"], "add --position-embedding-type rope"),
        (["--train-iters", "5", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
          "--nproc-per-node", "2"], "with it use --zero-2-memory-optimization"),
        (["--train-iters", "5", "--exit-interval", "0"], "--exit-interval 0: must be a positive integer"),
        (["--train-iters", "5", "--pretrained-model-name-or-path", "gpt2", "--swiglu"],
         "--swiglu shapes the built-in GPT"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_is_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolved(*argv)


def test_matching_sizes_are_accepted():
    """GQA with as many groups as heads, and --kv-channels equal to the head size, are the plain model."""
    args = resolved("--train-iters", "5", "--num-attention-heads", "4", "--hidden-size", "64", "--kv-channels", "16",
                    "--group-query-attention", "--num-query-groups", "4")  # fmt: skip
    assert args.kv_channels == 16


TOY = ["--micro-batch-size", "8", "--epochs", "2", "--lr", "1e-2", "--log-interval", "1"]  # 8 steps an epoch


def test_exit_interval_saves_and_stops_then_resumes(tmp_path):
    save = str(tmp_path / "run")
    trainer = ToyFinetuner(engine(*TOY, "--exit-interval", "3", "--save", save))
    trainer.train()
    assert trainer.iteration == 3
    assert (tmp_path / "run" / "latest").read_text().strip() == "3"
    assert not (tmp_path / "run" / "hf").exists()  # not the run's end: no final export
    resumed = ToyFinetuner(engine(*TOY, "--exit-interval", "3", "--save", save, "--load", save))
    resumed.train()
    assert resumed.iteration == 6


def test_exit_duration_stops_after_the_first_late_step(tmp_path, monkeypatch):
    monkeypatch.setattr(time_budget, "command_start", lambda: 0.0)  # the command started long ago
    save = tmp_path / "run"
    trainer = ToyFinetuner(engine(*TOY, "--exit-duration-in-mins", "1", "--save", str(save)))
    trainer.train()
    assert trainer.iteration == 1 and (save / "latest").read_text().strip() == "1"
    assert json.loads((save / "metrics.jsonl").read_text().splitlines()[-1])  # closed, still valid JSON lines
    assert [r["iteration"] for r in read_metrics(save) if "loss" in r and "split" not in r] == [1]
