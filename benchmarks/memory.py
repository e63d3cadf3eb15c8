"""Memory of LLM fine-tuning: rapidlite's chunked output layer against ``transformers.Trainer`` (+ peft).

    python benchmarks/memory.py            # workload M: about 10 minutes on 2 cores
    python benchmarks/memory.py --quick    # a tiny model for a few steps: checks the script only

Workload M: ``LlamaForCausalLM`` (4 layers, hidden 512, 8 heads, SwiGLU 1376, untied output layer) built with
one seed, vocabularies of 32,000 and 128,256 tokens, sequence 1024, micro-batch 1, AdamW (lr 1e-4, no weight
decay), fp32, 8 optimizer steps on the speed benchmark's synthetic token rows (the same rows, in the same
order, for every contender), 2 threads. Each vocabulary trains in two modes: LoRA (rank 16, alpha 32,
dropout 0 on the seven projections of every block) and full fine-tuning. Contenders, each its own process,
the two of a mode side by side for step 1 (start-up) and then taking turns step by step (the speed
benchmark's ``take_turns``: one runs while the other waits, so both see the same machine; ``--quick``, which
measures nothing, trains both modes one after the other in each contender's process: two start-ups, not four):

    trainer     transformers.Trainer on the model (with peft's get_peft_model for LoRA): its own loss over the
                whole logits
    rapidlite   rapidlite's white-box PreTrainer (``_pretrainer_class`` below): engine.compose (its LoRA),
                the loss through ``rapidlite.models.head.output_logps``, the path --task causal_lm and
                --task pretraining take

Before anything is compared, rapidlite's loss curve must equal the Trainer's within 1e-4 relative at every
step (the same model, rows, fp32 loss and AdamW update; the script stops otherwise). Measured in each
process, with glibc returning freed blocks to the system at once
(``MALLOC_MMAP_THRESHOLD_=65536``), by a global optimizer-step hook, over steps 2..N (step 1 allocates the
gradients and the optimizer state):

    peak MiB            the process's peak resident size
    act+logits MiB      from a step's first forward call to its optimizer step, the largest rise of the
                        resident size above its size at that call, minus the gradient bytes the step
                        allocated (the Trainer's zero_grad frees them each step, rapidlite keeps them): the
                        activations and the logits with their gradients
    tokens/s            over the median wall time of steps 2..N, each timed while the other contender waits

Longest sequence within a budget: the budget is the Trainer's peak at 1024 tokens (full fine-tuning, the
larger vocabulary), so the Trainer's longest is 1024 by construction. rapidlite's is found by ``--dry-run
--memory-budget`` (a bisection over ``--seq-length`` of ``rapidlite --task pretraining`` on the same LLaMA
config) and checked by a run of 3 steps at that length whose logged peak must be within the budget.

Targets (at the 128k vocabulary): act+logits <= 0.5x the Trainer's, longest sequence >= 2x, tokens/s >= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGETS = {"act_logits": 0.5, "longest": 2.0, "tokens_per_s": 1.0}  # rapidlite over the Trainer, 128k vocabulary


@dataclass(frozen=True)
class Workload:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    ffn: int = 1376
    seq: int = 1024
    vocabs: tuple[int, ...] = (32000, 128256)
    steps: int = 8
    lr: float = 1e-4
    rank: int = 16
    alpha: float = 32.0

    def config(self, vocab: int, seq: int | None = None):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab, hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, max_position_embeddings=seq or self.seq, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip


M = Workload()
QUICK = Workload(layers=2, hidden=64, heads=2, ffn=176, seq=128, vocabs=(8192,), steps=3, rank=4)
LOSSES: list[float] = []  # the contender's loss at each step, checked against the other's
LOSS_TOLERANCE = 1e-4  # relative, every step: both compute the same fp32 loss and AdamW update
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- measuring inside a contender
def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the high-water mark restarts from the current RSS


class StepMeter:
    """Global hooks: from a step's first forward call (its resident size and the gradient bytes it starts
    with then) to its optimizer step, the rise of the resident size above that start minus the gradient bytes
    the step allocated (none where gradients are kept between steps, all of them where ``zero_grad`` frees
    them): the activations and logits with their gradients, at their peak, before the optimizer's own
    temporaries; and the process's peak at each step's end (its time is the driver's: the contenders take
    turns)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.params: list = []
        self.begun = False

    def _grads(self) -> int:
        return sum(p.grad.nbytes for p in self.params if p.grad is not None)

    def forward_pre_hook(self, module, args) -> None:
        if not self.begun:  # the step's first forward call
            self.begun = True
            self.start_rss, self.held = _status("VmRSS"), self._grads()
            _reset_peak()

    def step_pre_hook(self, optimizer, args, kwargs) -> None:
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.begun:
            self.act_logits = _status("VmHWM") - self.start_rss - (self._grads() - self.held)

    def __call__(self, optimizer, args, kwargs) -> None:
        if self.begun:
            self.steps.append({"peak": _status("VmHWM"), "act_logits": self.act_logits})
        self.begun = False


def _model(w: Workload, vocab: int, lora: bool):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(w.config(vocab))
    model.config.use_cache = False
    return model


def run_trainer(w: Workload, vocab: int, lora: bool, work: Path) -> int:
    """The Trainer's steps; returns the trainable parameter count."""
    import torch
    from speed_workload import SyntheticTokens
    from transformers import Trainer, TrainingArguments

    model = _model(w, vocab, lora)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=w.rank, lora_alpha=w.alpha, lora_dropout=0.0,
                                                 target_modules=list(PROJECTIONS), task_type="CAUSAL_LM"))  # fmt: skip
    args = TrainingArguments(
        output_dir=str(work / "trainer"), per_device_train_batch_size=1, max_steps=w.steps, learning_rate=w.lr,
        weight_decay=0.0, lr_scheduler_type="constant", logging_strategy="no", save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0, max_grad_norm=0.0,
    )  # fmt: skip

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            LOSSES.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    class InOrder(torch.utils.data.IterableDataset):  # rows 0, 1, 2, ... as rapidlite reads them
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            return (self.rows[i] for i in range(len(self.rows)))

    RecordingTrainer(model=model, args=args, train_dataset=InOrder(SyntheticTokens(w.steps, w.seq, vocab))).train()
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_rapidlite(w: Workload, vocab: int, lora: bool, work: Path) -> int:
    from rapidlite import RapidliteEngine

    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1), "--seq-length", str(w.seq)]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(w.steps), "--lr", str(w.lr)]
    argv += ["--min-lr", "0", "--weight-decay", "0", "--lr-decay-style", "constant", "--log-interval", "1000"]
    argv += ["--no-progress"]
    argv += ["--clip-grad", "0", "--num-layers", str(w.layers), "--hidden-size", str(w.hidden)]
    argv += ["--num-attention-heads", str(w.heads), "--ffn-hidden-size", str(w.ffn)]
    if lora:
        argv += ["--lora-rank", str(w.rank), "--lora-alpha", str(w.alpha), "--lora-dropout", "0"]
    sys.argv = ["memory_workload", *argv]
    trainer = _pretrainer_class()(engine=RapidliteEngine())
    trainer.workload, trainer.vocab = w, vocab
    trainer.train()
    models = trainer.model if isinstance(trainer.model, list) else [trainer.model]
    return sum(p.numel() for m in models for p in m.parameters() if p.requires_grad)


def _pretrainer_class():
    from rapidlite import PreTrainer

    class _MemoryPreTrainer(PreTrainer):
        """rapidlite's contender: the workload's model, the loss as the black-box causal LM tasks compute it."""

        workload: Workload
        vocab: int

        def train_valid_test_datasets_provider(self, train_val_test_num_samples):
            from speed_workload import SyntheticTokens

            return SyntheticTokens(train_val_test_num_samples[0], self.workload.seq, self.vocab), None, None

        def model_optimizer_lr_scheduler_provider(self):
            import torch

            model = _model(self.workload, self.vocab, False)
            torch.manual_seed(1)  # compose creates the adapters next, from this state
            return model, None, None

        def run_forward_step(self, data_iterator, model):
            from rapidlite.models.head import output_logps

            batch = next(data_iterator)
            labels = batch["labels"]
            logp_sum = output_logps(model, {"input_ids": batch["input_ids"]}, labels, shift=True, sum_only=True)
            count = int((labels[:, 1:] != -100).sum())
            LOSSES.append(float(-logp_sum.detach()) / count)
            return -logp_sum, count

    return _MemoryPreTrainer


def mode_name(lora: bool) -> str:
    return "LoRA" if lora else "full"


def contender_main(key: str, vocab: int, modes: list[bool], quick: bool, result: Path) -> None:
    """The contender ``key`` at ``vocab`` in each of ``modes`` (LoRA or not; one, but where --quick runs both), one
    after the other, taking turns with the other contender's process; its records by ``key/mode`` in ``result``."""
    import torch

    w = QUICK if quick else M
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from speed import TURN_FDS, Turns
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    turns = Turns(os.environ[TURN_FDS])
    records = {}
    for lora in modes:
        meter = StepMeter()
        LOSSES.clear()
        hooks = [
            register_optimizer_step_pre_hook(meter.step_pre_hook),
            register_optimizer_step_post_hook(meter),  # before the turn-taking hook: measured, then wait
            register_optimizer_step_post_hook(turns),
            register_module_forward_pre_hook(meter.forward_pre_hook),
        ]
        with tempfile.TemporaryDirectory() as work:
            (run_trainer if key == "trainer" else run_rapidlite)(w, vocab, lora, Path(work))
        for hook in hooks:
            hook.remove()
        steps = meter.steps[1:]
        records[f"{key}/{mode_name(lora)}"] = {
            "peak": max(s["peak"] for s in steps),
            "act_logits": max(s["act_logits"] for s in steps),
            "tokens": w.seq - 1,  # a step's; the driver times the steps (contend)
            "steps": len(meter.steps),
            "losses": list(LOSSES),
        }
    result.write_text(json.dumps(records))


# ---------------------------------------------------------------- the driver
def child_env(threads: int) -> dict[str, str]:
    from speed import child_env as speed_env

    # Freed blocks go back at once: the resident size is what is live.
    return {**speed_env(threads), "MALLOC_MMAP_THRESHOLD_": "65536"}


def contend(vocab: int, modes: list[bool], quick: bool, threads: int, tmp: Path, steps: int) -> dict[tuple, dict]:
    """The two contenders in ``modes``, each in a process of its own, taking turns (``speed.take_turns``): each
    one's result by (mode, contender), its tokens/s from the steps it ran alone."""
    from speed import Contender, start_contender, take_turns_grouped

    names = [mode_name(lora) for lora in modes]
    running = []
    for key in ("trainer", "rapidlite"):
        stem = f"{key}-{vocab}-{'+'.join(names)}"
        result, log = tmp / f"{stem}.json", tmp / f"{stem}.log"
        argv = [sys.executable, __file__, "--contender", key, "--vocab", str(vocab), "--modes", ",".join(names)]
        argv += ["--result", str(result)] + (["--quick"] if quick else [])
        label = f"{key} (vocabulary {vocab}, {' then '.join(names)})"
        running.append(start_contender(Contender(stem, label, key), argv, log, result, child_env(threads)))
    groups = [[f"{key}/{name}" for name in names] for key in ("trainer", "rapidlite")]
    results = take_turns_grouped(running, groups, steps)
    for r in results.values():
        r["tokens_per_s"] = r.pop("tokens") / statistics.median(r["step_s"])
    return {(lora, key): results[f"{key}/{mode_name(lora)}"] for lora in modes for key in ("trainer", "rapidlite")}


def pretraining_argv(w: Workload, vocab: int, seq: int, config_dir: Path) -> list[str]:
    """``rapidlite --task pretraining`` on the workload's LLaMA config (full fine-tuning), at ``seq`` tokens, on
    the corpus beside the config (without --data-path the task would run its embedded demo at its own sizes)."""
    return [
        "--task", "pretraining", "--pretrained-model-name-or-path", str(config_dir),
        "--data-path", str(config_dir.with_name("corpus")), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(vocab - 1), "--seq-length", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", "1", "--lr", str(w.lr), "--min-lr", "0", "--weight-decay", "0", "--no-progress",
        "--train-iters", "3",
    ]  # fmt: skip


def rapidlite_cli(argv: list[str], threads: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rapidlite", *argv], env=child_env(threads), capture_output=True, text=True
    )


def planned_peak(w: Workload, vocab: int, seq: int, config_dir: Path, budget: int, threads: int) -> float:
    """The peak ``--dry-run`` plans for rank 0, in bytes."""
    proc = rapidlite_cli([*pretraining_argv(w, vocab, seq, config_dir), "--dry-run"], threads)
    if proc.returncode != 0:
        raise SystemExit(f"--dry-run at --seq-length {seq} failed:\n{proc.stderr[-2000:]}")
    row = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["0"])
    value, unit = row.split()[-2:]
    return float(value) * {"MiB": 2**20, "GiB": 2**30}[unit]


def longest_sequence(w: Workload, vocab: int, budget: int, config_dir: Path, tmp: Path, threads: int):
    """The longest ``--seq-length`` (a multiple of ``w.seq // 4``, up to 64 ``w.seq``) whose planned peak fits
    ``budget`` and whose run's peak does: ``(found, checked)``, each ``(length, the peak a 3-step run at that
    length logged)``. ``found`` is the plan's answer; where its run is over the budget, the length steps down
    (at most three times) until a run fits: ``checked``."""
    step, cap = (w.seq // 4, 64 * w.seq) if w is M else (w.seq, 4 * w.seq)  # --quick: a few dry runs
    fits = lambda seq: planned_peak(w, vocab, seq, config_dir, budget, threads) <= budget
    low = w.seq
    high = 2 * low
    while high < cap and fits(high):
        low, high = high, 2 * high
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    found = checked = (low, checked_peak(w, vocab, low, config_dir, tmp, threads))
    for _ in range(3):
        if checked[1] <= budget or checked[0] - step < w.seq:
            break
        length = checked[0] - step
        checked = (length, checked_peak(w, vocab, length, config_dir, tmp, threads))
    return found, checked


def checked_peak(w: Workload, vocab: int, seq: int, config_dir: Path, tmp: Path, threads: int) -> float:
    """The peak a 3-step run at ``seq`` tokens logs, in bytes."""
    save = tmp / f"check-{seq}"
    argv = pretraining_argv(w, vocab, seq, config_dir)
    proc = rapidlite_cli([*argv, "--log-interval", "1", "--save", str(save)], threads)
    if proc.returncode != 0:
        raise SystemExit(f"the check run at --seq-length {seq} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return max(r["peak_memory_mb"] for r in records if "peak_memory_mb" in r) * 2**20


def _write_corpus(prefix: Path, vocab: int, seq: int) -> None:
    import numpy as np

    from rapidlite.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(4):  # documents as long as the longest sequence searched: any length finds its samples
        builder.add_item(np.append(rng.integers(0, vocab - 1, size=seq + 1), vocab - 1))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contender", choices=("trainer", "rapidlite"), help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--modes", help=argparse.SUPPRESS)  # LoRA,full
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.contender:
        modes = [name == mode_name(True) for name in args.modes.split(",")]
        contender_main(args.contender, args.vocab, modes, args.quick, args.result)
        return 0
    w = QUICK if args.quick else M
    mib = lambda b: f"{b / 2**20:8.0f}"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        results = {}
        print(f"{'vocabulary':>10} {'mode':5} {'contender':10} {'peak MiB':>9} {'act+logits MiB':>15} {'tokens/s':>9}")
        for vocab in w.vocabs:
            for modes in [[True, False]] if args.quick else [[True], [False]]:  # --quick: both in one process
                pairs = contend(vocab, modes, args.quick, args.threads, tmp, w.steps)
                for lora, key in pairs:
                    r = results[vocab, lora, key] = pairs[lora, key]
                    if key == "rapidlite":
                        expected = results[vocab, lora, "trainer"]["losses"]
                        gap = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], expected, strict=True))
                        if gap > LOSS_TOLERANCE:
                            raise SystemExit(f"the loss curves differ by {gap:.1e}: {r['losses']} vs {expected}")
                    print(f"{vocab:>10} {mode_name(lora):5} {key:10} {mib(r['peak'])} {mib(r['act_logits']):>15} "
                          f"{r['tokens_per_s']:9.1f}", flush=True)  # fmt: skip
        big = max(w.vocabs)
        print("\nrapidlite / Trainer (act+logits, tokens/s):")
        ratios = {}
        for vocab in w.vocabs:
            for lora in (True, False):
                t, r = results[vocab, lora, "trainer"], results[vocab, lora, "rapidlite"]
                ratio = {k: r[k] / t[k] for k in ("act_logits", "tokens_per_s")}
                ratios[vocab, lora] = ratio
                print(f"  vocabulary {vocab:>6} {'LoRA' if lora else 'full':4}: act+logits {ratio['act_logits']:.2f}x, "
                      f"tokens/s {ratio['tokens_per_s']:.2f}x")  # fmt: skip
        budget = int(results[big, False, "trainer"]["peak"])
        w.config(big).save_pretrained(tmp / "llama")  # pretraining grows its position table to --seq-length
        _write_corpus(tmp / "corpus", big, 64 * w.seq)
        (planned, planned_run), (longest, checked) = longest_sequence(w, big, budget, tmp / "llama", tmp, args.threads)
        verdict = lambda peak: f"{peak / 2**20:.0f} MiB, {'within' if peak <= budget else 'OVER'} the budget"
        print(f"\nlongest sequence within {budget / 2**20:.0f} MiB (the Trainer's peak at {w.seq} tokens, full, "
              f"vocabulary {big}): Trainer {w.seq}, rapidlite {longest} (--dry-run found {planned}, whose run "
              f"peaked at {verdict(planned_run)}" + (f"; at {longest}: {verdict(checked)}" if longest != planned
              else "") + ")")  # fmt: skip
        worst = {k: max(ratios[big, lora][k] for lora in (True, False)) for k in ("act_logits",)}
        worst["tokens_per_s"] = min(ratios[big, lora]["tokens_per_s"] for lora in (True, False))
        met = {
            "act_logits": worst["act_logits"] <= TARGETS["act_logits"],
            "longest": longest / w.seq >= TARGETS["longest"] and checked <= budget,
            "tokens_per_s": worst["tokens_per_s"] >= TARGETS["tokens_per_s"],
        }
        shown = {
            "act_logits": f"act+logits <= {TARGETS['act_logits']}x ({worst['act_logits']:.2f}x",
            "longest": f"longest >= {TARGETS['longest']}x ({longest / w.seq:.1f}x",
            "tokens_per_s": f"tokens/s >= {TARGETS['tokens_per_s']}x ({worst['tokens_per_s']:.2f}x",
        }
        verdicts = [f"{shown[k]}: {'met' if met[k] else 'NOT met'})" for k in shown]
        print(f"\ntargets at vocabulary {big}: " + ", ".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
