"""``--task grpo`` against TRL's ``GRPOTrainer`` (generation with ``generate``, no vLLM), in one run.

    python benchmarks/grpo.py            # workload G: a few minutes on 2 cores
    python benchmarks/grpo.py --quick    # a tiny model for a few steps: checks the script works

Workload G: a randomly initialised LLaMA (4 layers, 256 wide, 4 heads, vocabulary 8000, 6M parameters), prompts
of 32 tokens (one prompt, repeated), 8 completions a prompt of up to 128 tokens, a global batch of 32 completions
(4 prompts) in one micro-batch, a reward of the completion's letters, DAPO's loss, beta 0, AdamW (lr 1e-5), fp32,
6 steps; the first 2 are warm-up and not timed. Generation takes most of a step, as in online RL of a real model.
Both contenders decode
greedily (``--top-k 1``): the work of a step is the same as sampling's, and both then produce the same
completions, which is the check that they run the same workload (the same completions' mean reward and length at
every step, and the same first-step loss). Contenders, each in its own process, one after the other:

    TRL GRPOTrainer       its generate-based rollout (unwrap_model_for_generation), then the loss
    rapidlite             --task grpo: the key/value-cached sampler, the chunked output layer's log-probabilities

It prints each one's rollout tokens per second (completion tokens per second of whole steps: sampling, scoring,
forward, backward and optimizer step) and its peak memory (the peak resident size of the steps after the first,
above what the process held after its imports; ``preference.TrainingPeak``), the ratios to TRL and the targets:
tokens/s >= 1.3 x TRL's and peak memory <= 0.8 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from preference import TrainingPeak  # noqa: E402


@dataclass(frozen=True)
class Workload:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 688
    vocab: int = 8000
    prompt_words: int = 31  # + the newline: 32 prompt tokens
    completion: int = 128
    generations: int = 8
    batch: int = 32  # completions a step
    prompts: int = 64
    steps: int = 6
    warmup: int = 2


G = Workload()
QUICK = Workload(hidden=64, layers=2, heads=2, intermediate=128, vocab=2000, prompt_words=7, completion=12,
                 generations=4, batch=8, prompts=16, steps=3, warmup=1)  # fmt: skip


def letters(prompts, completions, completion_ids, **kwargs):
    """The share of letters in a completion."""
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def import_everything() -> None:
    """What either contender imports, imported before its baseline is read: the peak above it is the run's."""
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import rapidlite.cli.main  # noqa: F401
    import rapidlite.tasks.grpo  # noqa: F401


# ---------------------------------------------------------------------- assets (the parent process)


def write_assets(root: Path, w: Workload) -> None:
    """A tokenizer whose every word is one token, a random LLaMA (its EOS never sampled greedily: completions run
    to their limit) and prompt rows."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.tasks.causal_lm_demo import WORDS
    from rapidlite.tasks.demo_build import DemoBuild
    from rapidlite.tasks.dpo_demo import build_tokenizer

    # One prompt, repeated: each contender reads the prompts in its own order, and the same prompt everywhere makes
    # their completions comparable step by step.
    rng = random.Random(0)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(w.prompt_words)) + "\n"}] * w.prompts
    (root / "data").mkdir(parents=True)
    with open(root / "data" / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    model_dir = root / "model"
    model_dir.mkdir()
    sft = [{"prompt": r["prompt"], "completion": r["prompt"]} for r in rows]
    pairs = [{"prompt": r["prompt"], "chosen": r["prompt"]} for r in rows]
    (root / "scratch").mkdir()
    tokenizer = build_tokenizer(DemoBuild(0, {"sft": sft, "train": pairs}, model_dir, root / "scratch"))
    tokenizer.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
        intermediate_size=w.intermediate, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # never the argmax: every completion is full length
    model.save_pretrained(model_dir)
    (root / "rewards.py").write_text(
        "def letters(prompts, completions, completion_ids, **kwargs):\n"
        "    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]\n"
    )


# ---------------------------------------------------------------------- contenders (each in its own process)


class StepClock:
    """Wall time between optimizer steps' ends (a step's whole work: its rollout included), and the peak."""

    def __init__(self) -> None:
        self.ends: list[float] = [time.perf_counter()]
        self.peak = TrainingPeak()

    def step_ended(self) -> None:
        self.ends.append(time.perf_counter())
        self.peak.step_ended()

    def step_s(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def run_trl(w: Workload, root: Path) -> dict:
    import transformers
    import trl
    from datasets import load_dataset

    import_everything()
    clock = StepClock()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "model")
    tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "model")
    rows = load_dataset("json", data_files=str(root / "data" / "train.jsonl"), split="train")

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.step_ended()

    args = trl.GRPOConfig(
        output_dir=str(root / "trl"), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=w.batch,
        gradient_accumulation_steps=1, num_generations=w.generations, max_completion_length=w.completion, top_k=1,
        max_steps=w.steps, learning_rate=1e-5, logging_steps=1, save_strategy="no", beta=0.0, loss_type="dapo",
        lr_scheduler_type="constant", dataloader_num_workers=0, seed=0, shuffle_dataset=False,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=letters, args=args, train_dataset=rows, processing_class=tokenizer
    )
    trainer.add_callback(Clock())
    clock.ends = [time.perf_counter()]
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {
        "step_s": clock.step_s(), "peak": clock.peak.bytes(),
        "lengths": [r["completions/mean_length"] for r in logs], "rewards": [r["reward"] for r in logs],
        "first_loss": logs[0]["loss"],
    }  # fmt: skip


def run_rapidlite(w: Workload, root: Path) -> dict:
    from rapidlite.cli.main import main
    from rapidlite.trainer.base import BaseTrainer

    import_everything()
    clock = StepClock()
    after_step = BaseTrainer.after_step

    def measured(self, samples):
        after_step(self, samples)
        clock.step_ended()

    BaseTrainer.after_step = measured
    save = root / "rapidlite"
    argv = [
        "--task", "grpo", "--pretrained-model-name-or-path", str(root / "model"), "--data-path", str(root / "data"),
        "--split", "100,0,0", "--reward-funcs", f"{root / 'rewards.py'}:letters", "--num-generations",
        str(w.generations), "--micro-batch-size", str(w.batch), "--global-batch-size", str(w.batch),
        "--max-completion-length", str(w.completion), "--top-k", "1", "--train-iters", str(w.steps), "--lr", "1e-5",
        "--lr-decay-style", "constant", "--log-interval", "1", "--save", str(save), "--no-progress", "--seed", "0",
    ]  # fmt: skip
    clock.ends = [time.perf_counter()]
    code = main(argv)
    if code not in (0, None):
        raise SystemExit(f"rapidlite exited {code}")
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    train = [r for r in records if "split" not in r and "loss" in r]
    return {
        "step_s": clock.step_s()[: w.steps], "peak": clock.peak.bytes(),
        "lengths": [r["completions/mean_length"] for r in train], "rewards": [r["reward"] for r in train],
        "first_loss": train[0]["loss"],
    }  # fmt: skip


CONTENDERS = {"trl": ("TRL GRPOTrainer", run_trl), "rapidlite": ("rapidlite --task grpo", run_rapidlite)}


def launch(key: str, root: Path, quick: bool) -> dict:
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
    }  # fmt: skip
    result = root / f"{key}.json"
    argv = [sys.executable, __file__, "--contender", key, "--root", str(root), "--result", str(result)]
    proc = subprocess.run(argv + (["--quick"] if quick else []), env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"{key}: exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contender")
    parser.add_argument("--root")
    parser.add_argument("--result")
    args = parser.parse_args()
    w = QUICK if args.quick else G
    if args.contender:
        out = CONTENDERS[args.contender][1](w, Path(args.root))
        Path(args.result).write_text(json.dumps(out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_assets(root, w)
        results = {key: launch(key, root, args.quick) for key in CONTENDERS}
    trl, ours = results["trl"], results["rapidlite"]
    same_lengths = trl["lengths"] == ours["lengths"]
    same_rewards = all(abs(a - b) <= 1e-5 for a, b in zip(trl["rewards"], ours["rewards"], strict=True))
    same_loss = abs(trl["first_loss"] - ours["first_loss"]) <= 1e-5
    print(f"{'contender':<24} {'tokens/s':>9} {'x TRL':>6} {'peak MiB':>9} {'x TRL':>6} {'step s':>7}")
    rates = {}
    for key, (label, _) in CONTENDERS.items():
        r = results[key]
        step = statistics.median(r["step_s"][w.warmup :])
        rates[key] = statistics.mean(r["lengths"][w.warmup :]) * w.batch / step
        print(
            f"{label:<24} {rates[key]:>9.0f} {rates[key] / rates['trl']:>6.2f} {r['peak'] / 2**20:>9.1f} "
            f"{r['peak'] / trl['peak']:>6.2f} {step:>7.3f}"
        )
    ok = same_lengths and same_rewards and same_loss
    print(
        f"check the same completions (mean length and reward at every step) and first-step loss "
        f"({trl['first_loss']:.6f}, {ours['first_loss']:.6f}): {'ok' if ok else 'FAILED'}"
    )
    speed, memory = rates["rapidlite"] / rates["trl"], ours["peak"] / trl["peak"]
    print(f"target rollout tokens/s >= 1.3 x TRL: x{speed:.2f} {'met' if speed >= 1.3 else 'NOT met'}")
    print(f"target peak memory <= 0.8 x TRL: x{memory:.2f} {'met' if memory <= 0.8 else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
