"""``--dry-run``: the plan and per-rank memory prediction, checked against what the same runs measure.

Each layout the other suites train (one process, DDP, ZeRO-1/2/3, tensor, pipeline, context and expert
parallelism, with and without activation checkpointing) is planned, then trained for two iterations: the
predicted parameter, gradient and optimizer bytes must equal the run's logged model state, and the predicted
peak must be within 15% of the peak memory the run logs. The model is sized so that its tensors, not the Python runtime,
make most of the peak (a 32768-token padded vocabulary: 12M parameters and 64 MiB logits per micro-batch)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, rapidlite, rapidlite_captured, run_cli, write_tiny_corpus

COMMON = [
    "--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
    "--make-vocab-size-divisible-by", "32768", "--num-layers", "4", "--hidden-size", "256",
    "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "2", "--train-iters", "2",
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
]  # fmt: skip
TWO = ["--nproc-per-node", "2"]
LAYOUTS = {
    "single": ["--global-batch-size", "2"],
    "single_checkpointed": ["--global-batch-size", "2", "--checkpoint-activations"],
    "ddp": [*TWO, "--global-batch-size", "4"],
    "zero1": [*TWO, "--global-batch-size", "4", "--zero-1-memory-optimization"],
    "zero2": [*TWO, "--global-batch-size", "4", "--zero-2-memory-optimization"],
    "zero3": [*TWO, "--global-batch-size", "4", "--zero-3-memory-optimization"],
    "zero3_checkpointed": [
        *TWO,
        "--global-batch-size",
        "4",
        "--zero-3-memory-optimization",
        "--checkpoint-activations",
    ],
    "tp2": [*TWO, "--global-batch-size", "2", "--tensor-model-parallel-size", "2"],
    "pp2": [*TWO, "--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--per-rank-logs"],
    # Each sequence split over the 2 ranks (ring attention).
    "cp2": [*TWO, "--global-batch-size", "2", "--context-parallel-size", "2", "--attention-dropout", "0"],
    # The MLPs as 8 experts, top 2, split over the 2 ranks.
    "moe_ep2": [*TWO, "--global-batch-size", "4", "--num-experts", "8", "--expert-model-parallel-size", "2"],
    # ZeRO-1 beside the experts' own optimizer; the mixture of experts in a pipeline.
    "moe_ep2_zero1": [
        *TWO, "--global-batch-size", "4", "--num-experts", "8", "--expert-model-parallel-size", "2",
        "--zero-1-memory-optimization",
    ],
    "moe_pp2": [*TWO, "--global-batch-size", "4", "--num-experts", "8", "--pipeline-model-parallel-size", "2",
                "--per-rank-logs"],
}  # fmt: skip


def plans(argvs: dict[str, list[str]]) -> dict[str, list[dict]]:
    lines = "\n".join(f"{name} {shlex.join(argv)}" for name, argv in argvs.items())
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "plan_layouts.py")],
        input=lines, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _logged(log: str, rank: int) -> tuple[dict[str, float], float]:
    """A run's logged model state of ``rank`` (bytes, from MiB with two decimals) and its largest peak (bytes)."""
    sizes = re.search(rf"model state on rank {rank} .*: param ([\d.]+) MiB, grad ([\d.]+) MiB, optimizer ([\d.]+)", log)
    peaks = [float(x) for x in re.findall(r"peak_memory_mb: ([\d.]+)", log)]
    assert sizes and len(peaks) >= 2, log[-3000:]
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    return {k: float(v) * 2**20 for k, v in zip(keys, sizes.groups(), strict=True)}, max(peaks) * 2**20


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "tiny"
    write_tiny_corpus(prefix)
    return str(prefix)


@pytest.mark.slow
@pytest.mark.distributed
def test_predicted_memory_matches_measured(corpus, tmp_path):
    argv = lambda name: [*COMMON, "--data-path", corpus, *LAYOUTS[name]]
    predicted = plans({name: [a for a in argv(name) if a != "--per-rank-logs"] for name in LAYOUTS})
    rows = []
    for name in LAYOUTS:
        # The logs are the records: only the pipelines save (the last stage's rank logs to --save DIR/logs/rank1.log).
        save, pipeline = tmp_path / name, "--per-rank-logs" in LAYOUTS[name]
        # A mixture of experts' rows per expert vary every step: glibc's allocator then keeps freed heap around (its
        # mmap threshold grows), which the plan does not model (docs/guides/mixture-of-experts.md). A pipeline's
        # interleaved micro-batches show it by the second step: a fixed threshold measures the tensors themselves.
        moe_pipeline = "--num-experts" in LAYOUTS[name] and pipeline
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"} if moe_pipeline else None
        proc = rapidlite(*argv(name), *(["--save", str(save)] if pipeline else []), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = {0: _logged(proc.stdout + proc.stderr, 0)}
        if pipeline:  # the last stage's rank logs its own numbers
            measured[1] = _logged((save / "logs" / "rank1.log").read_text(), 1)
        for rank_plan in predicted[name]:
            state, peak = measured[rank_plan["rank"]]
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                assert rank_plan[key] == pytest.approx(state[key], rel=0.01, abs=2**16), (name, key)
            rows.append((name, rank_plan["rank"], rank_plan["peak_bytes"] / 2**20, peak / 2**20))
    print("\nlayout, rank, predicted MiB, measured MiB, ratio")
    for name, rank, p, m in rows:
        print(f"{name:20s} {rank} {p:8.0f} {m:8.0f} {p / m:6.3f}")
    for name, rank, p, m in rows:
        assert abs(p - m) <= 0.15 * m, (name, rank, p, m)


def test_dry_run_prints_the_plan_and_writes_nothing(corpus, tmp_path):
    save = tmp_path / "run"
    argv = [*COMMON, "--data-path", corpus, "--save", str(save), "--nproc-per-node", "4"]
    argv += ["--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--zero-3-memory-optimization"]
    proc = rapidlite_captured(*argv, "--dry-run", "--memory-budget", "0.75")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "world: 4 processes (1 node) = data parallel 2 x tensor parallel 2 x pipeline parallel 1" in out
    assert "replica 1: tensor-parallel shards [2, 3]" in out
    assert "micro 2 x accumulation 1 x data parallel 2 = global 4" in out
    assert "ZeRO-3 (FSDP2) x tensor parallel 2" in out
    assert re.search(r"--memory-budget 0.75 GiB: this layout (fits|does NOT fit)", out)
    assert not save.exists()  # nothing written, no worker started


BOUNDARY = """
import json, sys
from rapidlite.resolve import parse_args
from rapidlite.planning import largest_micro_batch, plan

budget, argv = float(sys.argv[1]) * 2**30, sys.argv[2:]
sized = lambda mb: parse_args([*argv, "--micro-batch-size", str(mb), "--global-batch-size", str(2 * mb)]).sections
worst = lambda p: max(p.ranks, key=lambda r: r.peak)
base = worst(plan(sized(2)))
fits = largest_micro_batch(base, budget, 2)
device = lambda r: r.peak - r.runtime  # the runtime is this process's resident size: it moves between plans
print(json.dumps({"fits": fits, "room": budget - base.runtime,
                  "at": device(worst(plan(sized(fits)))), "over": device(worst(plan(sized(fits + 1))))}))
"""


@pytest.mark.slow
def test_largest_micro_batch_is_the_boundary(corpus):
    """The micro-batch the plan names for a budget fits it, and one more does not (replanned at both sizes)."""
    argv = [*COMMON, "--data-path", corpus, *TWO, "--zero-3-memory-optimization"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDARY, "1.0", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["fits"] > 2
    assert found["at"] <= found["room"] < found["over"], found


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory-budget", "8"], "--memory-budget is read by the plan: add --dry-run"),
        (["--dry-run", "--memory-budget", "0"], "--memory-budget 0: must be a positive number"),
    ],
)
def test_bad_input_is_one_line(corpus, argv, message):
    proc = run_cli(*COMMON, "--data-path", corpus, "--global-batch-size", "2", *argv)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rapidlite: error: {message}")


def test_a_model_class_named_by_the_config_is_built_on_meta(tmp_path):
    """A task the planner has no auto class for falls back to the class the config's ``architectures`` names; model
    classes build with ``_from_config`` (only the auto classes have ``from_config``)."""

    from transformers import BertConfig

    from rapidlite.config.settings import Sections
    from rapidlite.planning.model import meta_model

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config.architectures = ["BertForMaskedLM"]
    config.save_pretrained(tmp_path)
    model = meta_model(Sections.of({"pretrained_model_name_or_path": str(tmp_path), "task": "other"}))
    assert type(model).__name__ == "BertForMaskedLM"
    assert next(model.parameters()).device.type == "meta"


@pytest.mark.parametrize("task", ["multiple_choice", "masked_lm"])
def test_fine_tuning_tasks_are_planned(task, tmp_path):
    """The task's model class is built and profiled on meta; multiple choice with four choices a question
    (question answering's plan is tested with its task)."""
    from transformers import BertConfig

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    config.save_pretrained(tmp_path / "model")
    argv = ["--task", task, "--pretrained-model-name-or-path", str(tmp_path / "model"), "--data-path", "unused"]
    proc = rapidlite_captured(*argv, "--micro-batch-size", "2", "--seq-length", "32", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted memory per rank" in proc.stdout


def test_task_default_length_is_lowered_to_a_short_position_table(tmp_path):
    """A model whose position table is shorter than the task's default length (128) is planned at its table, as
    the task trains it; an explicit longer --seq-length is the run's one-line refusal, not a failed probe."""
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    argv = ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(tmp_path / "model")]
    proc = rapidlite_captured(*argv, "--data-path", "unused", "--micro-batch-size", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sequence length 64 (the task's default" in proc.stdout
    argv += ["--data-path", "unused", "--micro-batch-size", "2"]
    proc = rapidlite_captured(*argv, "--seq-length", "100", "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "rapidlite: error: --seq-length 100: the model has learned position embeddings for 64 positions; "
        "use --seq-length 64 or less"
    )


def test_a_default_length_set_by_the_task_is_lowered_too(tmp_path):
    """causal_lm's default --seq-length (512) is set by the task's defaults, not given: a GPT-2 with 64 positions
    is planned at 64, as the task trains it."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64).save_pretrained(tmp_path / "gpt2")
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(tmp_path / "gpt2"), "--data-path", "unused"]
    proc = rapidlite_captured(*argv, "--micro-batch-size", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sequence length 64" in proc.stdout


@pytest.mark.parametrize(
    "extra", [[], ["--packing"], ["--device-profile", "h100-sxm"]], ids=["plain", "packing", "h100"]
)
def test_a_forward_that_reads_its_inputs_values_is_planned(tmp_path, extra):
    """GPT-2 with a pad token looks for padding in ``input_ids`` when no attention mask is given
    (``Tensor.item()``): on meta tensors the value read is zero, and the activations are counted."""
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0)
    config.save_pretrained(tmp_path / "gpt2")
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(tmp_path / "gpt2"), "--data-path", "unused"]
    proc = rapidlite_captured(*argv, "--micro-batch-size", "2", "--seq-length", "32", "--dry-run", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("0 ")]
    assert float(row[7]) > 0 and "NOT counted" not in proc.stdout  # activations (MiB)


def test_a_forward_the_profile_cannot_run_is_one_line_and_the_rest_is_planned(tmp_path, monkeypatch):
    """A forward whose shapes depend on its inputs' values (``nonzero``) cannot run on meta tensors: the profile
    says so in one line, and the plan still holds the model states."""
    import torch

    from rapidlite.planning.activations import ProfileError, profile_activations

    class Gather(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)

        def forward(self, input_ids, **kwargs):
            return self.embed(input_ids[torch.nonzero(input_ids, as_tuple=True)]).sum()

    with torch.device("meta"):
        model = Gather()
    with pytest.raises(ProfileError, match="nonzero"):
        profile_activations(model, 2, 8, 8)

    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64).save_pretrained(tmp_path / "gpt2")
    argv = ["--task", "causal_lm", "--pretrained-model-name-or-path", str(tmp_path / "gpt2"), "--data-path", "unused"]
    import rapidlite.planning.memory as memory

    def unprofiled(*args, **kwargs):
        raise ProfileError("aten::nonzero: no meta function")

    monkeypatch.setattr(memory, "profile_activations", unprofiled)
    proc = rapidlite_captured(*argv, "--micro-batch-size", "2", "--seq-length", "32", "--dry-run")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "activations NOT counted: GPT2LMHeadModel's forward could not run on meta tensors (aten::nonzero" in (
        proc.stdout
    )
    assert "predicted memory per rank" in proc.stdout


def test_an_attention_mask_that_trains_takes_the_math_path_on_a_cpu():
    """T5's relative position bias is added to the attention mask, which then requires grad: a CPU's
    ``scaled_dot_product_attention`` takes its math path, which saves the ``[batch, heads, T, T]`` probabilities
    in every block (the plan could not profile T5 at all while it assumed the fused kernel there). A GPU's
    memory-efficient kernel takes the mask's gradient itself, and its plan saves the fused kernel's tensors."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from rapidlite.planning.activations import profile_activations

    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
                      decoder_start_token_id=0)  # fmt: skip
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    batch, seq = 2, 256
    encoder = {cpu: sum(profile_activations(model, batch, seq, 32, cpu=cpu).blocks_split[:2]) for cpu in (True, False)}
    probabilities = batch * 4 * seq * seq * 4  # one [batch, heads, T, T] fp32 tensor
    assert encoder[True] - encoder[False] >= 2 * probabilities, encoder


def _one_rank_plan(corpus, **bytes_of):
    """A CPU plan (a runtime of 300 MiB) of one rank with the given byte counts, for what ``format_plan`` prints."""
    from rapidlite.planning.memory import Plan, RankPlan
    from rapidlite.resolve import parse_args

    settings = parse_args([*COMMON, "--data-path", corpus]).sections
    rank = RankPlan(rank=0, stage=0, **{"runtime": 300 * 2**20, **bytes_of})
    return Plan(settings, 1, "DDP", "fp32", 10**6, 10**6, [rank])


def test_the_memory_table_keeps_its_columns_when_cells_read_alike(corpus):
    """Each cell sits under its own header, whatever the values (an activations cell that read like the params
    cell was once widened in the params column instead)."""
    from rapidlite.planning.report import format_plan

    same = 3 * 2**20
    plan = _one_rank_plan(corpus, params=same, grads=same, optimizer=2 * same, activations=same, transient=same,
                          reference=same)  # fmt: skip
    lines = format_plan(plan).splitlines()
    header = next(line for line in lines if line.split()[:2] == ["rank", "params"])
    row = lines[lines.index(header) + 1]
    names = header.split()
    assert names == ["rank", "params", "grads", "optimizer", "activations", "transient", "reference", "runtime", "peak"]
    assert len(row) == len(header)
    for name in names:  # every cell ends where its header ends (right-aligned)
        end = header.index(name) + len(name)
        assert row[end - 1] != " " and (end == len(row) or row[end] == " "), (name, header, row)


@pytest.mark.parametrize(("glibc", "said"), [((2, 36), True), ((2, 39), False), ((2, 41), False), (None, False)])
def test_a_cpu_plan_names_a_glibc_that_keeps_more_holes(corpus, monkeypatch, glibc, said):
    """glibc before 2.39 keeps more heap holes (bug 30723): the plan says so where the machine has one."""
    from rapidlite.planning import report

    monkeypatch.setattr(report, "glibc_version", lambda: glibc)
    out = report.format_plan(_one_rank_plan(corpus, params=1, grads=1, optimizer=2, activations=1, transient=1))
    assert ("bug 30723" in out) == said
    if said:
        assert "glibc 2.36 keeps more of those holes than glibc 2.39 and later" in out
