"""``--dry-run --device-profile`` against published throughput: torchtitan's Llama 3.1 tables, Megatron-LM's
weak-scaling table and Megatron-Core's mixture-of-experts figure for Mixtral 8x7B, each row planned from its
published set-up and predicted by the step-time model.

    python benchmarks/step_time.py            # every row (about a minute: large models are planned on meta)
    python benchmarks/step_time.py --quick    # two small rows: checks the script works

Sources (docs/guides/step-time.md has the table and what each row leaves out):

- torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (H100 96 GB HBM2e at 500 W, 8 a node, NVLink,
  400 Gb/s per GPU; sequence 8192, bf16): tokens/s per GPU.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", Table 1 (A100 80 GB,
  Selene; GPT, vocabulary 51200, sequence 2048, fp16, full recomputation): TFLOP/s per GPU counted as the paper
  counts them, ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per iteration (recomputation's forward included).
- Megatron-LM ``megatron/core/transformer/moe/README.md`` (MCore v0.8; H100 80 GB HBM3 SXM, 8 a node, NVLink,
  8 x 400 Gb/s InfiniBand a node): "Mixtral 8X7B bf16 training to achieve 438 TFLOPS", and the same file's
  reference mapping for Mixtral 8x7B (dropless, sequence 4096, all-to-all dispatcher, bf16, 64 GPUs: TP 1,
  EP 8, PP 4, VPP 8, micro-batch 1, global batch 256). The README gives the figure and the mapping side by side
  without saying the figure was measured at that mapping. TFLOP/s counted as Megatron counts them
  (``megatron_moe_flops``). The built-in GPT has no grouped-query attention: the row is planned with Mixtral's
  32 heads as key/value heads too, about 6% more compute than Mixtral's 8 (said in the table). Megatron's
  distributed optimizer is planned as ZeRO-1.

Megatron's rows use the built-in ``a100-80g`` profile as it is. torchtitan's H100s are 500 W parts with HBM2e,
whose peak is not published: their profile (``benchmarks/profiles/h100-96g-500w.yaml``, on ``h100-sxm``) has its
efficiencies calibrated on one row, the 8-GPU FSDP one; ``--calibrate`` prints what each calibration row needs.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
H100 = str(REPO / "benchmarks" / "profiles" / "h100-96g-500w.yaml")  # torchtitan's 500 W HBM2e H100

LLAMA = {  # Llama 3.1: (layers, hidden, heads, key/value heads, MLP, vocabulary)
    "8B": (32, 4096, 32, 8, 14336, 128256),
    "70B": (80, 8192, 64, 8, 28672, 128256),
    "405B": (126, 16384, 128, 8, 53248, 128256),
}


@dataclass
class Row:
    source: str
    name: str
    profile: str
    flags: list[str]
    published: float
    metric: str  # "tokens/s/GPU" or "TFLOP/s/GPU"
    flops: float = 0.0  # a TFLOP/s row: the source's own count of one step's FLOPs
    calibration: bool = False
    not_modelled: str = ""  # what the row depends on that the model cannot know
    approximated: str = ""  # what the plan changes in the row's set-up (the ratio still counts)


def _llama_dir(root: Path, size: str) -> str:
    from transformers import LlamaConfig

    layers, hidden, heads, kv, mlp, vocab = LLAMA[size]
    path = root / f"llama-{size}"
    if not path.exists():
        LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
            intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
        ).save_pretrained(path)  # fmt: skip
    return str(path)


def torchtitan_rows(root: Path) -> list[Row]:
    def llama(size: str, gpus: int, local: int, ac: str, *extra: str) -> list[str]:
        layers, hidden, heads, _, mlp, _ = LLAMA[size]
        recompute = ["--checkpoint-activations", "--recompute-granularity", ac]
        return [
            "--pretrained-model-name-or-path", _llama_dir(root, size), "--num-layers", str(layers),
            "--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--ffn-hidden-size", str(mlp),
            "--seq-length", "8192", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128000",
            "--mixed-precision", *recompute,
            "--nnodes", str(max(1, gpus // 8)), "--nproc-per-node", str(min(gpus, 8)), "--micro-batch-size", str(local),
            *extra,
        ]  # fmt: skip

    src = "torchtitan"
    fp8 = "torch.compile, Float8 matmuls"
    return [
        Row(src, "8B, 8 GPUs, FSDP, local batch 2", H100,
            llama("8B", 8, 2, "selective", "--zero-3-memory-optimization", "--global-batch-size", "16"),
            5762, "tokens/s/GPU", calibration=True),
        Row(src, "8B, 128 GPUs, FSDP, local batch 2", H100,
            llama("8B", 128, 2, "selective", "--zero-3-memory-optimization", "--global-batch-size", "256"),
            5605, "tokens/s/GPU"),
        Row(src, "8B, 8 GPUs, FSDP + compile", H100,
            llama("8B", 8, 2, "selective", "--zero-3-memory-optimization", "--global-batch-size", "16"),
            6667, "tokens/s/GPU", not_modelled="torch.compile"),
        Row(src, "70B, 256 GPUs, FSDP 32 x TP 8, local batch 16", H100,
            llama("70B", 256, 16, "full", "--zero-3-memory-optimization", "--tensor-model-parallel-size", "8",
                  "--sequence-parallel", "--global-batch-size", "512"),
            829, "tokens/s/GPU", not_modelled=fp8),
        Row(src, "405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, 1F1B", H100,
            llama("405B", 512, 1, "full", "--zero-3-memory-optimization", "--tensor-model-parallel-size", "8",
                  "--sequence-parallel", "--pipeline-model-parallel-size", "8", "--global-batch-size", "256"),
            100, "tokens/s/GPU", not_modelled=fp8 + ", async TP"),
    ]  # fmt: skip


MEGATRON = [  # params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def megatron_rows() -> list[Row]:
    rows = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON:
        flags = [
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "51200", "--make-vocab-size-divisible-by", "128",
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--fp16", "--checkpoint-activations",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--nnodes", str(gpus // 8), "--nproc-per-node", "8", "--global-batch-size", str(batch),
            "--micro-batch-size", "1",
        ]  # fmt: skip
        name = f"{params:g}B, TP {tp} x PP {pp}, {gpus} GPUs, batch {batch}"
        s, v = 2048, 51200  # the paper's count of a step's FLOPs
        flops = 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
        rows.append(Row("Megatron-LM", name, "a100-80g", flags, tflops, "TFLOP/s/GPU", flops))
    return rows


def megatron_moe_flops(
    batch: int, seq: int, layers: int, hidden: int, heads: int, groups: int, ffn: int, top_k: int, vocab: int
) -> float:
    """A step's FLOPs as Megatron-LM counts them for a SwiGLU mixture of experts (``num_floating_point_operations``
    of MCore v0.8's ``training.py``): ``12 B s L h^2 ((1 + g/a + s/h) + (F/h) k 3/2 + V / 2Lh)``."""
    attention = 1 + groups / heads + seq / hidden
    mlp = ffn / hidden * top_k * 1.5
    return 12 * batch * seq * layers * hidden**2 * (attention + mlp + vocab / (2 * layers * hidden))


def megatron_moe_rows() -> list[Row]:
    layers, hidden, heads, groups, ffn, experts, top_k, vocab, seq, batch = (
        32,
        4096,
        32,
        8,
        14336,
        8,
        2,
        32000,
        4096,
        256,
    )
    flags = [
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--num-layers", str(layers),
        "--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq), "--num-experts", str(experts), "--moe-router-topk", str(top_k),
        "--moe-ffn-hidden-size", str(ffn), "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
        "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16", "--moe-grouped-gemm",
        "--nnodes", "8", "--nproc-per-node", "8", "--pipeline-model-parallel-size", "4",
        "--expert-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "1",
        "--pipeline-schedule", "interleaved-1f1b", "--micro-batch-size", "1", "--global-batch-size", str(batch),
        "--zero-1-memory-optimization",
    ]  # fmt: skip
    flops = megatron_moe_flops(batch, seq, layers, hidden, heads, groups, ffn, top_k, vocab)
    name = "Mixtral 8x7B, 64 GPUs, EP 8 x PP 4 (VPP 8), batch 256, dropless"
    approx = "no grouped-query attention in the built-in GPT: 32 key/value heads planned for Mixtral's 8"
    return [Row("Megatron-Core MoE", name, "h100-sxm", flags, 438, "TFLOP/s/GPU", flops, approximated=approx)]


def predict(row: Row, profiles: dict) -> tuple[float, str]:
    """(the predicted figure in the row's metric, the dominant terms)."""
    from rapidlite.planning import plan
    from rapidlite.planning.timing import step_time
    from rapidlite.resolve import parse_args

    argv = ["--task", "pretraining", "--data-path", "unused", "--train-iters", "1", "--dry-run", *row.flags]
    settings = parse_args(argv).sections
    per_node = settings.parallel.nproc_per_node
    t = step_time(plan(settings, gpu=True), profiles[row.profile], per_node)
    terms = sorted(t.step.terms.items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{k} {100 * v / t.step.seconds:.0f}%" for k, v in terms[:3] if v > 0)
    if row.metric == "tokens/s/GPU":
        return t.tokens_per_second_per_device, shares
    return row.flops / (t.step.seconds * t.world_size) / 1e12, shares


# ------------------------------------------------------------------------------------------ this machine
HERE_MODEL = [
    "--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "4",
    "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "1",
]  # fmt: skip
TWO = ["--nproc-per-node", "2"]
HERE_LAYOUTS = {
    "DDP": TWO,
    "ZeRO-1": [*TWO, "--zero-1-memory-optimization"],
    "ZeRO-2": [*TWO, "--zero-2-memory-optimization"],
    "ZeRO-3": [*TWO, "--zero-3-memory-optimization"],
    "TP2": [*TWO, "--tensor-model-parallel-size", "2"],
    "PP2": [*TWO, "--pipeline-model-parallel-size", "2"],
}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks, tied values sharing their average rank (the model
    predicts the same step for layouts it cannot tell apart, such as DDP at two micro-batch sizes)."""

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and math.isclose(xs[order[j + 1]], xs[order[i]], rel_tol=1e-9):
                j += 1
            for k in order[i : j + 1]:
                out[k] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def here(
    layouts: dict[str, list[str]],
    micro_batches: tuple[int, ...],
    iters: int,
    rounds: int,
    data: str,
    stop_at: float | None = None,
) -> list:
    """Each layout at each micro-batch size: (name, predicted s, measured s, largest term), measured as the
    fastest step of a run's iterations after the first, over ``rounds`` rounds of every layout in turn:
    another process on the machine only ever slows a step, and the machine's speed drifts over minutes, which
    the rounds spread over all layouts alike. With ``stop_at``, a round after which the predicted and measured
    order already agree that well (Spearman) is the last: more rounds only matter to an order not yet clear."""
    import os
    import re
    import subprocess

    from rapidlite.planning import plan
    from rapidlite.planning.devices import device_profile
    from rapidlite.planning.timing import step_time
    from rapidlite.resolve import parse_args

    profile = device_profile("cpu")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    runs = []
    for name, flags in layouts.items():
        for micro in micro_batches:
            argv = [*HERE_MODEL, "--data-path", data, *flags, "--micro-batch-size", str(micro)]
            argv += ["--train-iters", str(iters)]
            t = step_time(plan(parse_args(argv).sections, gpu=False), profile, 2)
            top = max(t.step.terms.items(), key=lambda kv: kv[1])[0]
            runs.append((f"{name}, micro-batch {micro}", name, micro, argv, t.step.seconds, top))
    measured: dict[str, float] = {}
    step_line = re.compile(r"iteration: (\d+) \|.*\| step_time_s: ([\d.]+)")
    for turn in range(rounds):
        for label, _, _, argv, *_ in runs:
            # No --save: the log's lines carry each step's time, and a checkpoint and export would only add time.
            cmd = [sys.executable, "-m", "rapidlite", *argv, "--no-progress"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(f"{label} failed:\n{proc.stderr[-2000:]}")
            steps = [(int(i), float(t)) for i, t in step_line.findall(proc.stdout + proc.stderr)]
            times = [t for i, t in steps if i > 1]  # the first step warms the allocator and the kernels
            if not times:
                raise SystemExit(f"{label}: no step times in its log:\n{proc.stderr[-2000:]}")
            measured[label] = min(times + [measured.get(label, math.inf)])
            print(f"round {turn + 1}: {label}: {min(times):.3f} s", file=sys.stderr, flush=True)
        if stop_at is not None and turn + 1 < rounds:
            agreement = spearman([r[4] for r in runs], [measured[r[0]] for r in runs])
            if agreement >= stop_at:
                print(f"round {turn + 1}: Spearman {agreement:.2f} >= {stop_at}: no further round", file=sys.stderr)
                break
    rows = []
    for label, name, micro, _, predicted, top in runs:
        rows.append((label, predicted, measured[label], top))
        print(f"| {name} | {micro} | {predicted:.3f} | {measured[label]:.3f} | {predicted / measured[label]:.2f} | "
              f"{top} |", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small rows: checks the script works")
    parser.add_argument("--calibrate", action="store_true", help="print the efficiency each calibration row needs")
    parser.add_argument("--here", action="store_true", help="the 2-rank layouts on this machine, run and predicted")
    parser.add_argument(
        "--stop-at", type=float, metavar="SPEARMAN",
        help="--here: end after the first round whose Spearman reaches this (default: both rounds)",
    )  # fmt: skip
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    from rapidlite.planning.devices import device_profile

    if args.here:
        return main_here(args.quick, args.stop_at)
    profiles = {name: device_profile(name) for name in (H100, "a100-80g", "h100-sxm")}
    with tempfile.TemporaryDirectory() as tmp:
        rows = [*torchtitan_rows(Path(tmp)), *megatron_rows(), *megatron_moe_rows()]
        if args.quick:
            rows = [rows[0], next(r for r in rows if r.source == "Megatron-LM"), rows[-1]]
        print("| source | row | published | predicted | predicted / published | what dominates |")
        print("|---|---|---|---|---|---|")
        ratios = []
        for row in rows:
            predicted, shares = predict(row, profiles)
            ratio = predicted / row.published
            note = " (calibration row)" if row.calibration else ""
            note += f" (not modelled: {row.not_modelled})" if row.not_modelled else ""
            note += f" (approximated: {row.approximated})" if row.approximated else ""
            print(f"| {row.source} | {row.name}{note} | {row.published:,.0f} {row.metric} | {predicted:,.0f} | "
                  f"{ratio:.2f} | {shares} |", flush=True)  # fmt: skip
            if not row.not_modelled and not row.calibration:
                ratios.append(ratio)
            if args.calibrate and row.calibration:
                profile, factor = profiles[row.profile], row.published / predicted
                matmul, attention = factor * profile.matmul_efficiency, factor * profile.attention_efficiency
                print(f"  calibration: matched at matmul_efficiency {matmul:.3f}, attention_efficiency {attention:.3f}")
        if ratios:
            within = sum(abs(r - 1) <= 0.25 for r in ratios)
            print(f"\npredicted rows within 25% of the published figure: {within} of {len(ratios)} "
                  f"(ratios {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
    return 0


def main_here(quick: bool, stop_at: float | None = None) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import write_tiny_corpus

    layouts = {k: HERE_LAYOUTS[k] for k in ("DDP", "TP2")} if quick else HERE_LAYOUTS
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus"
        write_tiny_corpus(data, docs=400)
        print("| layout | micro-batch | predicted s/step | measured s/step | predicted / measured | largest term |")
        print("|---|---|---|---|---|---|")
        rows = here(layouts, (1, 2), 3 if quick else 4, 1 if quick else 2, str(data), stop_at)
    predicted, measured = [r[1] for r in rows], [r[2] for r in rows]
    within = sum(abs(p / m - 1) <= 0.30 for p, m in zip(predicted, measured, strict=True))
    print(f"\nSpearman rank correlation of predicted and measured step times: {spearman(predicted, measured):.2f}")
    print(f"predicted within 30% of measured: {within} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
