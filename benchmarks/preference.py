"""``--task dpo`` against TRL's ``DPOTrainer``: the same model, data, precision and batches, in one run.

    python benchmarks/preference.py            # workload P: a few minutes on 2 cores
    python benchmarks/preference.py --quick    # a tiny model for a few steps, in two launches: checks the script works

Workload P: a randomly initialised LLaMA (8 layers, 512 wide, 8 heads, vocabulary 16000, 42M parameters) on
prompt/chosen/rejected rows of fixed length (a 32-token prompt, 16-token responses, so every step holds the same
tokens), sigmoid DPO with beta 0.1, micro-batch 2 pairs x accumulation 4, AdamW (lr 1e-5), fp32, 8 steps; the
first 2 are warm-up and not timed. Short rows and small micro-batches make the model's states, not activations,
most of the memory, as in fine-tuning a large model (where the frozen reference is the complaint). Contenders, each
in its own processes, one after the other (``--quick``, which measures nothing, runs the three one-process ones in
one process: a start-up of torch, transformers and TRL instead of three):

    TRL DPOTrainer                 a frozen copy of the model as the reference (TRL's default)
    rapidlite                      the same: a frozen copy laid out as the policy
    rapidlite --precompute-ref...  the reference's scores computed once before training, no reference kept
    rapidlite ZeRO-3 x 2           2 ranks, the policy and its frozen reference both sharded (per rank)

It prints each one's tokens/s (the real tokens of chosen and rejected sequences, per second of training steps),
its peak memory (the peak resident size of the training steps after the first, above what the process held after
its imports: model states, the reference, activations and buffers; with 2 ranks the larger rank's; see
``TrainingPeak``), the memory its reference takes, and the ratios to TRL with the targets: tokens/s >= 1.05 x
TRL's, and peak memory <= 0.8 x TRL's with a precomputed or sharded reference. The first-step losses are
checked equal (the same model and batch give the same DPO loss: ln 2 at step 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    intermediate: int = 1376
    vocab: int = 16000
    prompt_words: int = 31  # + the newline: 32 prompt tokens
    response_words: int = 16
    pairs: int = 64
    micro: int = 2
    accumulation: int = 4
    steps: int = 8
    warmup: int = 2


P = Workload()
QUICK = Workload(hidden=64, layers=2, heads=2, intermediate=128, vocab=2000, prompt_words=15, response_words=8,
                 pairs=16, micro=2, accumulation=2, steps=4, warmup=1)  # fmt: skip


def import_everything() -> None:
    """What either contender imports, imported before its baseline is read: the peak above it is the run's."""
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import rapidlite.cli.main  # noqa: F401
    import rapidlite.tasks.dpo  # noqa: F401


def vm(field: str) -> int:
    """This process's ``VmRSS``/``VmHWM`` in bytes."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class ReferenceBytes(logging.Handler):
    """The reference's weight bytes on this rank, from rapidlite's log line about its frozen copy (0 without one)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.bytes = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"frozen copy .*?, ([0-9.]+) MiB of weights on this rank", record.getMessage())
        if match:
            self.bytes = float(match.group(1)) * 2**20


class TrainingPeak:
    """The peak resident size of the training steps after the first: at the end of step 1 (the model, its
    reference and the optimizer state all built, the first batch's buffers allocated) the high-water mark restarts
    from the current size (Linux ``clear_refs``), so loading and building (a whole model in each rank's memory
    before sharding) do not count; glibc returns freed blocks at once (``MALLOC_MMAP_THRESHOLD_``)."""

    def __init__(self) -> None:
        self.baseline = vm("VmRSS")
        self.steps = 0

    def step_ended(self) -> None:
        self.steps += 1
        if self.steps == 1:
            Path("/proc/self/clear_refs").write_text("5")

    def bytes(self) -> int:
        return vm("VmHWM") - self.baseline


# ---------------------------------------------------------------------- assets (the parent process)


def write_assets(root: Path, w: Workload) -> tuple[Path, Path]:
    """A tokenizer whose every word is one token, a random LLaMA and fixed-length pair rows."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.models.hf import plain_save
    from rapidlite.tasks.causal_lm_demo import WORDS
    from rapidlite.tasks.demo_build import DemoBuild
    from rapidlite.tasks.dpo_demo import build_tokenizer

    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [
        {"prompt": words(w.prompt_words) + "\n", "chosen": words(w.response_words), "rejected": words(w.response_words)}
        for _ in range(w.pairs)
    ]
    data = root / "data"
    data.mkdir(parents=True)
    with open(data / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    model_dir = root / "model"
    model_dir.mkdir()
    sft = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows]
    scratch = root / "scratch"
    scratch.mkdir()
    tokenizer = build_tokenizer(DemoBuild(0, {"sft": sft, "train": rows}, model_dir, scratch))
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
        intermediate_size=w.intermediate, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with plain_save():  # no DeepSpeed import (1.5 s) to learn that the model is not wrapped
        LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir, data


# ---------------------------------------------------------------------- contenders (each in its own process)


def run_trl(w: Workload, model_dir: Path, data: Path, work: Path) -> dict:
    import transformers
    import trl
    from datasets import load_dataset

    import_everything()
    peak = TrainingPeak()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    rows = load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    times, tokens, losses = [], [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)
            peak.step_ended()

    args = trl.DPOConfig(
        output_dir=str(work / "trl"), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=w.micro,
        gradient_accumulation_steps=w.accumulation, max_steps=w.steps, learning_rate=1e-5, logging_steps=1,
        save_strategy="no", beta=0.1, max_length=1024, lr_scheduler_type="constant", dataloader_num_workers=0,
        seed=0,
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=rows, processing_class=tokenizer)
    original = trainer.compute_loss

    def counting(model, inputs, *a, **k):
        tokens.append(int(inputs["attention_mask"].sum()))
        return original(model, inputs, *a, **k)

    trainer.compute_loss = counting
    trainer.add_callback(Clock())
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    per_step = sum(tokens) / len(times)
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    return {"step_s": times, "tokens_per_step": per_step, "peak": peak.bytes(), "reference": ref_bytes,
            "first_loss": losses[0]}  # fmt: skip


def rapidlite_argv(w: Workload, model_dir: Path, data: Path, save: Path, flags: list[str]) -> list[str]:
    return [
        "--task", "dpo", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data),
        "--split", "100,0,0", "--micro-batch-size", str(w.micro),
        "--global-batch-size", str(w.micro * w.accumulation), "--train-iters", str(w.steps), "--lr", "1e-5",
        "--lr-decay-style", "constant", "--weight-decay", "0.0", "--clip-grad", "1.0", "--beta", "0.1",
        "--log-interval", "1", "--save", str(save), "--no-progress", "--seed", "0", *flags,
    ]  # fmt: skip


def run_rapidlite(w: Workload, model_dir: Path, data: Path, save: Path, flags: list[str], result: Path) -> None:
    """rapidlite in this process (one of the ranks, under torchrun): after every step this rank's training peak
    so far and its reference's bytes go to ``result`` (a rank's process ends inside the run: gloo workers exit at
    its end)."""
    from rapidlite.cli.main import main
    from rapidlite.observe.logging import LOGGER_NAME
    from rapidlite.trainer.base import BaseTrainer

    import_everything()
    peak, reference = TrainingPeak(), ReferenceBytes()
    after_step = BaseTrainer.after_step

    def measured(self, samples):
        after_step(self, samples)
        peak.step_ended()
        result.write_text(json.dumps({"peak": peak.bytes(), "reference": reference.bytes}))

    BaseTrainer.after_step = measured
    logging.getLogger(LOGGER_NAME).addHandler(reference)
    try:
        code = main(rapidlite_argv(w, model_dir, data, save, flags))
    finally:  # the next contender of a --quick process runs unpatched
        BaseTrainer.after_step = after_step
        logging.getLogger(LOGGER_NAME).removeHandler(reference)
    if code not in (0, None):
        raise SystemExit(f"rapidlite exited {code}")


def rapidlite_metrics(save: Path) -> dict:
    """Step times, tokens per step and the first loss of a run's metrics.jsonl."""
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    train = [r for r in records if "split" not in r and "step_time_s" in r]
    return {
        "step_s": [r["step_time_s"] for r in train],
        "tokens_per_step": statistics.median(r["tokens_per_s"] * r["step_time_s"] for r in train),
        "first_loss": train[0]["loss"],
    }


FLAGS = {"rapidlite": [], "precomputed": ["--precompute-ref-logprobs"], "zero3": ["--zero-3-memory-optimization"]}


def contender_main(keys: list[str], w: Workload, root: Path) -> None:
    """The contenders ``keys`` one after another (one, but where --quick groups them), each rank's result in
    ``root/KEY.RANK.json``."""
    model_dir, data = root / "model", root / "data"
    for key in keys:
        mine = root / f"{key}.{os.environ.get('RANK', '0')}.json"
        if key == "trl":
            mine.write_text(json.dumps(run_trl(w, model_dir, data, Path(tempfile.mkdtemp(dir=root)))))
        else:
            run_rapidlite(w, model_dir, data, root / key, FLAGS[key], mine)


CONTENDERS = {
    "trl": "TRL DPOTrainer",
    "rapidlite": "rapidlite",
    "precomputed": "rapidlite --precompute-ref-logprobs",
    "zero3": "rapidlite ZeRO-3 x 2 ranks",
}


def launch(keys: list[str], w: Workload, root: Path, quick: bool) -> dict[str, dict]:
    """The contenders ``keys`` in processes of their own (2 ranks under torchrun for ZeRO-3), one after another:
    each one's result, with the largest rank's peak and rank 0's reference bytes."""
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAPIDLITE_CACHE": str(root / "cache"),
        "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
    }  # fmt: skip
    argv = [__file__, "--contender", ",".join(keys), "--root", str(root)] + (["--quick"] if quick else [])
    if keys == ["zero3"]:
        env["OMP_NUM_THREADS"] = "1"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    else:  # --quick: one thread, as the tests run everything (two wait on each other for a tiny model's steps)
        env["OMP_NUM_THREADS"] = "1" if quick else "2"
        argv = [sys.executable, *argv]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    results = {}
    for key in keys:
        ranks = [json.loads(p.read_text()) for p in sorted(root.glob(f"{key}.*.json"))]
        if proc.returncode != 0 or not ranks:
            raise SystemExit(f"{key}: exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        out = ranks[0] if key == "trl" else {**rapidlite_metrics(root / key), "reference": ranks[0]["reference"]}
        results[key] = {**out, "peak": max(r["peak"] for r in ranks)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contender")  # keys, comma-separated
    parser.add_argument("--root")
    args = parser.parse_args()
    w = QUICK if args.quick else P
    if args.contender:
        contender_main(args.contender.split(","), w, Path(args.root))
        return 0
    # --quick: the one-process contenders in one process (the script is checked, nothing is measured)
    groups = [["trl", "rapidlite", "precomputed"], ["zero3"]] if args.quick else [[key] for key in CONTENDERS]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_assets(root, w)
        results = {key: r for keys in groups for key, r in launch(keys, w, root, args.quick).items()}
    print(f"{'contender':<38} {'tokens/s':>9} {'x TRL':>6} {'peak MiB':>9} {'x TRL':>6} {'reference MiB':>14}")
    trl_rate = results["trl"]["tokens_per_step"] / statistics.median(results["trl"]["step_s"][w.warmup :])
    for key, label in CONTENDERS.items():
        r = results[key]
        rate = r["tokens_per_step"] / statistics.median(r["step_s"][w.warmup :])
        r["rate"] = rate
        print(
            f"{label:<38} {rate:>9.0f} {rate / trl_rate:>6.2f} {r['peak'] / 2**20:>9.1f} "
            f"{r['peak'] / results['trl']['peak']:>6.2f} {r['reference'] / 2**20:>14.1f}"
        )
    losses = [results[k]["first_loss"] for k in CONTENDERS]
    same = all(abs(x - losses[0]) <= 1e-4 * abs(losses[0]) for x in losses)
    print(f"check first-step losses equal ({', '.join(f'{x:.6f}' for x in losses)}): {'ok' if same else 'FAILED'}")
    speed = results["rapidlite"]["rate"] / trl_rate
    memory = min(results[k]["peak"] for k in ("precomputed", "zero3")) / results["trl"]["peak"]
    print(f"target tokens/s >= 1.05 x TRL: x{speed:.2f} {'met' if speed >= 1.05 else 'NOT met'}")
    print(f"target peak memory <= 0.8 x TRL (precomputed or sharded reference): x{memory:.2f} "
          f"{'met' if memory <= 0.8 else 'NOT met'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
