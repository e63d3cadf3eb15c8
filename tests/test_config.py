"""The settings are parsed once per process and resolved once into a frozen config: defaults have one home,
a task's defaults come from its TaskSpec, and what a DeepSpeed file decides is checked like a flag."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pickle
import sys

import pytest

from helpers import ToyFinetuner
from rapidlite.cli.main import main
from rapidlite.config import parser as arguments
from rapidlite.config import tasks as registry
from rapidlite.config.parser import build_parser, parse
from rapidlite.errors import ConfigError
from rapidlite.resolve import FrozenConfigError, RunConfig, parse_args, resolve, with_embedded_demo

BASE = ["--task", "sequence_classification", "--demo"]


def test_the_resolved_config_is_frozen_and_reads_like_a_namespace():
    def extra(parser):
        parser.add_argument("--my-flag", type=int, default=3)

    args = parse_args(["--my-flag", "5", "--micro-batch-size", "4"], extra_args_provider=extra, require_task=False)
    assert isinstance(args, RunConfig) and isinstance(args, argparse.Namespace)
    for name, value in (("micro_batch_size", 8), ("my_flag", 6), ("brand_new", 1)):
        with pytest.raises(FrozenConfigError, match=f"frozen: cannot set '{name}'"):
            setattr(args, name, value)
    with pytest.raises(AttributeError):  # a FrozenConfigError is both, like a frozen dataclass's error
        args.lr = 1.0
    with pytest.raises(ConfigError):
        del args.lr
    assert args.micro_batch_size == 4 and args.my_flag == 5 and not hasattr(args, "brand_new")
    assert vars(args)["gradient_accumulation_steps"] == 1 and getattr(args, "missing", "default") == "default"
    assert "notices" not in vars(args)  # what resolve tells the user travels beside the flags, not among them
    for twin in (pickle.loads(pickle.dumps(args)), copy.deepcopy(args), copy.copy(args)):
        assert twin == args and twin.notices == args.notices
        with pytest.raises(FrozenConfigError):
            twin.micro_batch_size = 2


def test_a_scripts_own_flags_keep_argparse_semantics():
    def extra(parser):
        parser.add_argument("--tag", action="append", default=[])
        parser.add_argument("-v", "--verbose", action="count", default=0)
        parser.add_argument("--ratio", type=float, default="0.5")  # a string default goes through its type

    args = parse_args(["--tag", "a", "--tag", "b", "-vv"], extra_args_provider=extra, require_task=False)
    assert args.tag == ["a", "b"] and args.verbose == 2 and args.ratio == 0.5
    args = parse_args([], extra_args_provider=extra, require_task=False)
    assert args.tag == [] and args.verbose == 0
    assert parse([]).explicit_flags == frozenset() and parse(["--fp16"]).explicit_flags == {"fp16"}


def test_resolve_returns_a_new_object_and_leaves_the_parsed_flags_alone():
    namespace = parse(BASE + ["--train-iters", "9", "--lr-warmup-iters", "100", "--checkpoint-activations"])
    before = copy.deepcopy(vars(namespace))
    config = resolve(namespace)
    assert vars(namespace) == before and not hasattr(namespace, "precision")
    assert config.lr_warmup_iters == 9 and config.recompute_granularity == "full" and config.precision == "fp32"
    assert config.notices and "--lr-warmup-iters 100 is longer than --train-iters 9" in config.notices[0]
    assert resolve(namespace) == config  # the same flags resolve to the same settings


def test_one_parse_per_cli_run(monkeypatch, log_lines):
    calls = []
    real = arguments._Parser.parse_known_args

    def counting(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("args"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(arguments._Parser, "parse_known_args", counting)
    spec = registry.TaskSpec(name="toy_count", summary="a test task", trainer="test_task_registry:toy_trainer")
    monkeypatch.setitem(registry.TASKS, spec.name, spec)
    assert main(["--task", "toy_count", "--micro-batch-size", "16", "--epochs", "1"]) == 0
    assert len(calls) == 1, calls
    # A user script run with python: its RapidliteEngine() parses sys.argv once, with the script's own flags.
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["my_trainer.py", "--micro-batch-size", "16", "--epochs", "1", "--mine", "2"])
    from rapidlite import RapidliteEngine

    trainer = ToyFinetuner(RapidliteEngine(extra_args_provider=lambda p: p.add_argument("--mine", type=int)))
    assert len(calls) == 1 and trainer.args.mine == 2


def test_help_shows_the_defaults_that_apply():
    parser = build_parser()
    lr = next(a for a in parser._actions if a.dest == "lr")
    text = " ".join(parser.format_help().split())
    assert f"peak learning rate (default {lr.default:g}" in text
    assert parse_args(BASE, require_task=False).lr == lr.default == 1e-4  # nothing after parsing invents it
    epochs = next(a for a in parser._actions if a.dest == "epochs")
    assert f"(Finetuner; default {epochs.default})" in text and parse_args(BASE).epochs == epochs.default


def test_a_task_default_comes_from_its_task_spec(tmp_path, monkeypatch):
    base = ["--task", "pretraining", "--train-iters", "4"]
    assert parse_args(base).seq_length == 1024  # GPT
    assert parse_args(base + ["--seq-length", "77"]).seq_length == 77  # a flag given wins
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    assert parse_args(base + ["--pretrained-model-name-or-path", str(tmp_path)]).seq_length == 512  # BERT
    spec = registry.get_task("pretraining")
    monkeypatch.setitem(registry.TASKS, "pretraining", dataclasses.replace(spec, defaults={"seq_length": 333}))
    assert parse_args(base).seq_length == 333
    assert parse_args(["--train-iters", "4"], require_task=False).seq_length is None  # no task, no task default


def test_the_embedded_demo_is_flag_values_until_the_cli_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    config = resolve(with_embedded_demo(parse(["--task", "pretraining", "--lr", "0.5"])))
    assert config.demo and config.train_iters == 2000 and config.lr == 0.5  # the demo's values; the flag's wins
    assert config.time_budget == 3.5
    assert config.data_path[0].startswith(str(tmp_path / "cache")) and config.tokenizer_type == "GPT2BPETokenizer"
    assert config.dataset_path == config.data_path[0]  # derived from the demo's data like from a flag
    assert not (tmp_path / "cache").exists()  # nothing built by resolving
    plain = parse(["--task", "pretraining", "--data-path", "x", "--tokenizer-type", "NullTokenizer"])
    assert with_embedded_demo(plain) is plain


def write(tmp_path, content) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_deepspeed_decided_precision_is_checked_against_loss_scale(tmp_path):
    base = BASE + ["--micro-batch-size", "2", "--loss-scale", "128"]
    fp16 = write(tmp_path, {"fp16": {"enabled": True}})
    args = parse_args(base + ["--deepspeed-config", fp16])
    assert args.precision == "fp16" and args.loss_scale == 128  # the file chose fp16: a static scale applies
    bf16 = write(tmp_path, {"bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="--loss-scale only applies to fp16"):
        parse_args(base + ["--deepspeed-config", bf16])
    with pytest.raises(ConfigError, match="--loss-scale only applies to fp16"):
        parse_args(base)  # fp32 by the flags, no file


def test_graph_flags_are_resolved_with_the_rest():
    args = parse_args(BASE + ["--onnx-runtime-training", "--nproc-per-node", "2", "--micro-batch-size", "2"])
    assert args.torch_compile and not args.use_ort  # two ranks: ORTModule is single-process only
    assert any("--onnx-runtime-training" in n and "torch.compile" in n for n in args.notices)
    plain = parse_args(BASE)
    assert not plain.use_ort and not plain.torch_compile and plain.notices == []
