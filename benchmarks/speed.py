"""rapidlite against a plain PyTorch loop and the Hugging Face Trainer, and its speed switches, side by side.

    python benchmarks/speed.py              # workload W: about 25 minutes on 2 cores
    python benchmarks/speed.py --quick      # a tiny model for a few steps, in two processes: checks the script works

Workload W (``benchmarks/speed_workload.py``): GPT2LMHeadModel (6 layers, 384 wide, 6 heads, 256
positions, vocabulary 8192, dropout 0) on synthetic token rows, micro-batch 8 x 256 tokens, 4 micro-batches
a step, AdamW (lr 3e-4, weight decay 0.1 on the >= 2-D weights), clipping 1.0, 10 warmup steps then cosine,
30 optimizer steps, 2 threads a process. Contenders, each in its own process:

    plain loop                      a hand-written loop (torch.optim.AdamW with its defaults), fp32
    HF Trainer                      transformers.Trainer with the same settings, fp32
    rapidlite                       the white-box PreTrainer of speed_workload.py, fp32
    rapidlite --torch-compile       ... with each block compiled
    rapidlite --checkpoint-act...   ... with activation checkpointing
    plain loop bf16                 the plain loop under CPU bf16 autocast
    rapidlite --mixed-precision     rapidlite's mixed precision (bf16 on a CPU with a bf16 fast path, else fp32)
    ... --torch-compile --mixed-p.  both: where compilation has more than matrix multiplies to speed up
    plain loop, again               the plain loop in a second process: the run's noise floor

They run interleaved step by step: every process stops after each optimizer step (a global optimizer
step hook) until this script lets it run its next one, so the contenders take turns (A B C ... A B C ...)
and a change in the machine's load hits them all alike. A step's time is the wall time of its turn; the
table gives the median over steps 6-30 (the first steps warm up, compile, allocate). ``--quick``, which measures
nothing, runs the contenders in two processes that take turns (the baselines one after another in one, rapidlite's
in the other: ``process_groups``): every path of the script for two start-ups of torch and transformers, not nine.
The script first checks that the contenders reach the same loss curve (plain loop, Trainer and rapidlite within
1e-4), then prints median tokens/s, the ratio to the plain loop, MFU against the matmul peak measured at the start
(fp32 or bf16, as the contender computes), the seconds to the end of step 1 (start-up and compilation), peak RSS
and the final loss, and the targets.

Activation checkpointing's memory is measured apart, with a longer sequence (1024) where activations
dominate: rapidlite with and without ``--checkpoint-activations``, one after the other, 3 steps of one
micro-batch of 4, with glibc returning freed blocks to the system at once (``MALLOC_MMAP_THRESHOLD_``), so
that the peak resident size minus the resident parameters and optimizer state is the step's peak memory
for activations (and the gradients live at that moment); ``--quick`` probes both in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD_SCRIPT = Path(__file__).resolve().with_name("speed_workload.py")
sys.path.insert(0, str(WORKLOAD_SCRIPT.parent))

from speed_workload import QUICK, W, Workload, build_model, dataset  # noqa: E402


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    kind: str  # "plain", "trainer" or "rapidlite" ("group": a process running several, see spawn)
    bf16: bool = False
    flags: tuple[str, ...] = ()


CONTENDERS = [
    Contender("plain", "plain loop", "plain"),
    Contender("trainer", "HF Trainer", "trainer"),
    Contender("rapidlite", "rapidlite", "rapidlite"),
    Contender("compile", "rapidlite --torch-compile", "rapidlite", flags=("--torch-compile",)),
    Contender("ckpt", "rapidlite --checkpoint-activations", "rapidlite", flags=("--checkpoint-activations",)),
    Contender("plain_bf16", "plain loop bf16 autocast", "plain", bf16=True),
    Contender("mixed", "rapidlite --mixed-precision", "rapidlite", bf16=True, flags=("--mixed-precision",)),
    Contender(
        "compile_mixed",
        "rapidlite --torch-compile --mixed-precision",
        "rapidlite",
        bf16=True,
        flags=("--torch-compile", "--mixed-precision"),
    ),
    # The same plain loop in a second process: how far two identical contenders land apart in this run.
    Contender("plain_again", "plain loop, again (noise floor)", "plain"),
]
BY_KEY = {c.key: c for c in CONTENDERS}

# Loss agreement with the plain loop (largest relative difference over all steps).
LOSS_TOLERANCE = {
    "trainer": 1e-4,
    "rapidlite": 1e-4,
    "compile": 1e-3,
    "ckpt": 1e-3,
    "plain_again": 1e-4,
    "plain_bf16": 5e-2,
    "mixed": 5e-2,
    "compile_mixed": 5e-2,
}
BF16_PAIR_TOLERANCE = 2e-2  # rapidlite's bf16 contenders against the plain loop under bf16 autocast


# ---------------------------------------------------------------------- inside a contender's process


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Turns:
    """After each optimizer step: tell the coordinator the step is done, and wait for its go."""

    def __init__(self, fds: str) -> None:
        go, done = (int(fd) for fd in fds.split(","))
        self.go, self.done = os.fdopen(go, "rb", buffering=0), os.fdopen(done, "wb", buffering=0)

    def __call__(self, optimizer, args, kwargs) -> None:
        self.done.write(b".")
        if not self.go.read(1):  # the coordinator is gone
            os._exit(3)


class StepState:
    """After step ``at``: the resident bytes of parameters and optimizer state (the resident size minus the
    gradients, which are freed before the next step's forward)."""

    def __init__(self, at: int) -> None:
        self.at, self.steps, self.bytes = at, 0, None

    def __call__(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps == self.at:
            grads = sum(
                p.grad.numel() * p.grad.element_size()
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            )
            self.bytes = rss_bytes() - grads


def lr_lambda(w: Workload):
    def factor(step: int) -> float:  # linear warmup from 0, then cosine to 0 (as rapidlite and the Trainer)
        if step < w.warmup:
            return step / w.warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - w.warmup) / (w.steps - w.warmup)))

    return factor


def run_plain(w: Workload, bf16: bool) -> list[float]:
    import torch

    model = build_model(w)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": w.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=w.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(w))
    batches = iter(torch.utils.data.DataLoader(dataset(w), batch_size=w.micro_batch))
    losses = []
    for _ in range(w.steps):
        total = 0.0
        for _ in range(w.accumulation):
            batch = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                loss = model(**batch).loss / w.accumulation
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def run_trainer(w: Workload, workdir: str) -> list[float]:
    import torch
    from transformers import Trainer, TrainingArguments

    class InOrder(torch.utils.data.IterableDataset):  # rows 0, 1, 2, ... as the other contenders read them
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            return (self.rows[i] for i in range(len(self.rows)))

    args = TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.accumulation,
        learning_rate=w.lr,
        weight_decay=w.weight_decay,
        max_grad_norm=w.clip,
        lr_scheduler_type="cosine",
        warmup_steps=w.warmup,
        max_steps=w.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=build_model(w), args=args, train_dataset=InOrder(dataset(w)))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_rapidlite(w: Workload, flags: tuple[str, ...], workdir: str) -> list[float]:
    from rapidlite.cli.main import main as rapidlite_main

    argv = [
        *("--user-script", str(WORKLOAD_SCRIPT), *w.model_flags()),
        *("--micro-batch-size", str(w.micro_batch), "--global-batch-size", str(w.global_batch)),
        *("--train-iters", str(w.steps), "--lr", str(w.lr), "--min-lr", "0", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", str(w.warmup), "--lr-decay-iters", str(w.steps)),
        *("--weight-decay", str(w.weight_decay), "--clip-grad", str(w.clip)),
        *("--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "0"),
        *("--log-interval", "1", "--save", workdir, "--no-save-optim"),
        *flags,
    ]
    code = rapidlite_main(argv)
    if code:
        raise SystemExit(f"rapidlite exited with {code}")
    metrics = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in metrics if "split" not in r and "loss" in r]


def contender_main(keys: list[str], result: str, quick: bool, memory_seq: int | None) -> None:
    """The contenders ``keys`` one after another (one, but where --quick groups them), their records by key in
    ``result``; taking turns with the other processes, or with ``memory_seq`` the activation-memory probe."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    w = QUICK if quick else W
    if memory_seq:  # the activation-memory probe: no turns, 3 steps of one micro-batch of 4
        w = replace(w, seq=memory_seq, micro_batch=4, accumulation=1, steps=3, warmup=1)
    elif TURN_FDS in os.environ:
        register_optimizer_step_post_hook(Turns(os.environ[TURN_FDS]))
    records = {}
    for key in keys:
        contender = BY_KEY[key]
        if memory_seq:
            state = StepState(at=2)
            probe = register_optimizer_step_post_hook(state)
        with tempfile.TemporaryDirectory(prefix=f"speed_{key}_") as workdir:
            if contender.kind == "plain":
                losses = run_plain(w, contender.bf16)
            elif contender.kind == "trainer":
                losses = run_trainer(w, workdir)
            else:
                losses = run_rapidlite(w, contender.flags, workdir)
        records[key] = {"losses": losses, "max_rss": max_rss_bytes()}
        if memory_seq:
            probe.remove()
            records[key]["step_peak_above_state"] = max_rss_bytes() - state.bytes
    Path(result).write_text(json.dumps(records))


# ---------------------------------------------------------------------- the coordinator


@dataclass
class Running:
    contender: Contender
    proc: subprocess.Popen
    go: object
    done: object
    log: Path
    result: Path
    start: float
    first_step_s: float = 0.0
    step_s: list[float] = field(default_factory=list)

    def wait_done(self) -> None:
        if not self.done.read(1):
            self.fail("stopped before finishing its step")

    def fail(self, what: str) -> None:
        self.proc.wait()
        tail = self.log.read_text()[-4000:]
        raise SystemExit(f"{self.contender.label}: {what} (exit {self.proc.returncode}); its log ends:\n{tail}")


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# The pipes a contender that takes turns (Turns) reads its go from and writes its step's end to.
TURN_FDS = "BENCHMARK_TURN_FDS"


def start_contender(c: Contender, argv: list[str], log: Path, result: Path, env: dict[str, str]) -> Running:
    """Start a contender's process (``argv``, its output in ``log``, its result file ``result``) that takes turns
    with the others: it registers ``Turns(os.environ[TURN_FDS])`` after its optimizer step. Shared by the
    benchmarks that interleave their contenders (``take_turns``)."""
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    env = {**env, TURN_FDS: f"{go_r},{done_w}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=(go_r, done_w))
    os.close(go_r)
    os.close(done_w)
    go, done = os.fdopen(go_w, "wb", buffering=0), os.fdopen(done_r, "rb", buffering=0)
    return Running(c, proc, go, done, log, result, time.perf_counter())


def spawn(group: list[Contender], tmp: Path, quick: bool, threads: int, script: str = __file__) -> Running:
    """A process of ``script`` (this one, or a benchmark built on it) running the contenders of ``group`` one
    after another (see ``process_groups``)."""
    name = "+".join(c.key for c in group)
    log, result = tmp / f"{name}.log", tmp / f"{name}.json"
    argv = [sys.executable, script, "--contender", ",".join(c.key for c in group), "--result", str(result)]
    process = Contender(name, " + ".join(c.label for c in group), "group")
    return start_contender(process, argv + (["--quick"] if quick else []), log, result, child_env(threads))


def process_groups(contenders: list, quick: bool, together) -> list[list]:
    """Which contenders share a process: none in a full run (each is measured in a process of its own); with
    ``--quick``, which checks the script and measures nothing, those for which ``together(contender)`` is the same,
    one after another in the contenders' order: a start-up of torch and transformers each group, not each
    contender. Shared by the benchmarks that interleave their contenders."""
    if not quick:
        return [[c] for c in contenders]
    groups: dict = {}
    for c in contenders:
        groups.setdefault(together(c), []).append(c)
    return list(groups.values())


def take_turns(running: list[Running], steps: int | list[int]) -> dict[str, dict]:
    """Step 1 (start-up, compilation) side by side; then one process at a time, each step's wall time recorded,
    until each has run its ``steps`` (one count for all, or one a process). Returns each process's result file by
    its contender's key, with its ``run`` and ``step_s``; a process still running on the way out is killed. Shared
    by the benchmarks that interleave their contenders."""
    counts = [steps] * len(running) if isinstance(steps, int) else steps
    try:
        for r in running:
            r.wait_done()
            r.first_step_s = time.perf_counter() - r.start
        for step in range(2, max(counts) + 1):
            for r in (r for r, n in zip(running, counts, strict=True) if step <= n):
                start = time.perf_counter()
                r.go.write(b".")
                r.wait_done()
                r.step_s.append(time.perf_counter() - start)
            print(f"  step {step}/{max(counts)}", end="\r", file=sys.stderr, flush=True)
        for r in running:
            r.go.write(b".")
        results = {}
        for r in running:
            if r.proc.wait() != 0 or not r.result.exists():
                r.fail("did not finish")
            results[r.contender.key] = {**json.loads(r.result.read_text()), "run": r, "step_s": r.step_s}
        return results
    finally:
        for r in running:
            if r.proc.poll() is None:
                r.proc.kill()


def take_turns_grouped(running: list[Running], groups: list[list[str]], steps: int) -> dict[str, dict]:
    """``take_turns`` for processes each running the contenders of a group (their keys in ``groups``) one after
    another, ``steps`` optimizer steps each, the process's result file holding their records by key. Returns each
    contender's record with its ``first_step_s`` (the process's start-up included for a group's first) and its
    ``step_s`` (steps 2..``steps``). Shared by the benchmarks that interleave their contenders."""
    finished = take_turns(running, [steps * len(group) for group in groups])
    results = {}
    for r, group in zip(running, groups, strict=True):
        for i, key in enumerate(group):  # r.step_s[j] is the process's step j + 2
            first = r.first_step_s if i == 0 else r.step_s[i * steps - 1]
            step_s = r.step_s[i * steps : (i + 1) * steps - 1]
            results[key] = {**finished[r.contender.key][key], "first_step_s": first, "step_s": step_s}
    return results


def run_interleaved(contenders: list[Contender], w: Workload, quick: bool, threads: int, tmp: Path) -> dict:
    groups = process_groups(contenders, quick, together=lambda c: c.kind == "rapidlite")
    running = [spawn(group, tmp, quick, threads) for group in groups]
    return take_turns_grouped(running, [[c.key for c in group] for group in groups], w.steps)


def memory_probe(seq: int, quick: bool, threads: int, tmp: Path) -> dict[str, int]:
    """Peak step memory above parameters + optimizer state, rapidlite without and with checkpointing."""
    env = child_env(threads)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    peaks = {}
    for keys in [["rapidlite", "ckpt"]] if quick else [["rapidlite"], ["ckpt"]]:  # --quick: one start-up
        name = "+".join(keys)
        result, log = tmp / f"memory_{name}.json", tmp / f"memory_{name}.log"
        argv = [sys.executable, __file__, "--contender", ",".join(keys), "--result", str(result)]
        argv += ["--memory-seq", str(seq)] + (["--quick"] if quick else [])
        with open(log, "w") as out:
            code = subprocess.call(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        if code != 0:
            raise SystemExit(f"memory probe {name} failed (exit {code}); its log ends:\n{log.read_text()[-4000:]}")
        peaks.update({key: r["step_peak_above_state"] for key, r in json.loads(result.read_text()).items()})
    return peaks


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def check_losses(results: dict) -> list[str]:
    """Every contender's loss curve against the plain loop's (and the bf16 pair against each other)."""
    reference = results["plain"]["losses"]
    lines, failed = [], False
    pairs = [(key, "plain", tol) for key, tol in LOSS_TOLERANCE.items() if key in results]
    if "plain_bf16" in results:
        pairs += [(key, "plain_bf16", BF16_PAIR_TOLERANCE) for key in ("mixed", "compile_mixed") if key in results]
    for key, against, tol in pairs:
        diff = max_relative_difference(results[key]["losses"], results[against]["losses"])
        ok = diff <= tol
        failed |= not ok
        lines.append(
            f"  {BY_KEY[key].label} vs {BY_KEY[against].label}: max relative loss difference {diff:.2e} "
            f"(<= {tol:g}): {'ok' if ok else 'DIFFERENT'}"
        )
    if failed or len(reference) == 0:
        print("\n".join(lines))
        raise SystemExit("the contenders do not reach the same loss curve: no speeds are printed")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (checks the script)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per contender (default 2)")
    p.add_argument("--only", default=None, help="comma-separated contender keys (plain is always included)")
    p.add_argument("--memory-seq", type=int, default=None, help="sequence length of the memory probe")
    p.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.contender:
        contender_main(args.contender.split(","), args.result, args.quick, args.memory_seq)
        return

    import torch

    from rapidlite.models.flops import ModelFlops, measure_matmul_peak

    torch.set_num_threads(args.threads)
    w = QUICK if args.quick else W
    keys = set(args.only.split(",")) | {"plain"} if args.only else set(BY_KEY)
    unknown = keys - set(BY_KEY)
    if unknown:
        raise SystemExit(f"--only: unknown contender(s) {sorted(unknown)}; choose from {list(BY_KEY)}")
    contenders = [c for c in CONTENDERS if c.key in keys]
    if "trainer" in keys and importlib.util.find_spec("accelerate") is None:
        raise SystemExit(
            "the HF Trainer contender needs accelerate: pip install 'rapidlite[bench]' (or leave it out with --only)"
        )
    sizes = (256, 512) if args.quick else (1024, 2048, 3072)
    peaks = {
        bf16: measure_matmul_peak(dtype, sizes=sizes)[0]
        for bf16, dtype in ((False, torch.float32), (True, torch.bfloat16))
    }
    flops_per_token = ModelFlops.of(build_model(w)).per_token(w.seq)
    print(
        f"workload: GPT-2 {w.layers} layers x {w.hidden}, vocab {w.vocab}, {w.micro_batch} x {w.seq} tokens x "
        f"{w.accumulation} micro-batches, {w.steps} steps; {args.threads} threads a process; "
        f"{flops_per_token / 1e6:.1f} MFLOP/token"
    )
    print(f"measured matmul peak: fp32 {peaks[False] / 1e9:.1f} GFLOP/s, bf16 {peaks[True] / 1e9:.1f} GFLOP/s")

    first_timed = 6 if not args.quick else 3
    with tempfile.TemporaryDirectory(prefix="speed_") as tmp:
        results = run_interleaved(contenders, w, args.quick, args.threads, Path(tmp))
        print("loss curves:")
        print("\n".join(check_losses(results)))
        memory = None
        if "ckpt" in keys:
            memory = memory_probe(args.memory_seq or (128 if args.quick else 1024), args.quick, args.threads, Path(tmp))

    rates = {
        key: w.tokens_per_step / statistics.median(res["step_s"][first_timed - 2 :]) for key, res in results.items()
    }
    print()
    header = "| contender | tokens/s | vs plain loop | MFU | to end of step 1 s | peak RSS MiB | final loss |"
    print(header)
    print("|---|---|---|---|---|---|---|")
    for c in contenders:
        res = results[c.key]
        mfu = rates[c.key] * flops_per_token / peaks[c.bf16]
        print(
            f"| {c.label} | {rates[c.key]:.0f} | {rates[c.key] / rates['plain']:.3f} | {mfu:.1%} "
            f"({'bf16' if c.bf16 else 'fp32'}) | {res['first_step_s']:.1f} | {res['max_rss'] / 2**20:.0f} | "
            f"{res['losses'][-1]:.4f} |"
        )
    print()
    print_targets(rates, results, memory, flops_per_token, peaks)


def print_targets(rates: dict, results: dict, memory: dict | None, flops_per_token: float, peaks: dict) -> None:
    def line(name: str, value: float, target: float, fmt: str = ".3f", higher: bool = True) -> None:
        met = value >= target if higher else value <= target
        op = ">=" if higher else "<="
        print(f"{name}: {value:{fmt}} (target {op} {target:{fmt}}): {'met' if met else 'MISSED'}")

    plain = rates["plain"]
    if "rapidlite" in rates:
        line("rapidlite vs plain loop", rates["rapidlite"] / plain, 0.98)
        mfu = rates["rapidlite"] * flops_per_token / peaks[False]
        line("rapidlite MFU / measured fp32 matmul peak", mfu, 0.75)
    if "rapidlite" in rates and "trainer" in rates:
        line("rapidlite vs HF Trainer", rates["rapidlite"] / rates["trainer"], 1.05)
    if "compile" in rates:
        line("rapidlite --torch-compile vs plain loop", rates["compile"] / plain, 1.2)
    if "mixed" in rates:
        from rapidlite.precision import cpu_bf16_is_fast

        # Without a bf16 fast path --mixed-precision trains fp32 (bf16 would be many times slower): parity then.
        fast = cpu_bf16_is_fast()
        if not fast:
            print("this CPU has no bf16 fast path: --mixed-precision trains fp32 here (target: parity)")
        line("rapidlite --mixed-precision vs fp32 plain loop", rates["mixed"] / plain, 2.0 if fast else 0.95)
    if "compile_mixed" in rates and "mixed" in rates:
        print(
            f"--torch-compile under bf16: x{rates['compile_mixed'] / rates['mixed']:.3f} over --mixed-precision alone"
        )
    if "plain_again" in rates:
        print(f"noise floor: the plain loop's second process ran at x{rates['plain_again'] / plain:.3f} of the first")
    if "ckpt" in rates and "rapidlite" in rates:
        line("--checkpoint-activations extra time", rates["rapidlite"] / rates["ckpt"] - 1, 0.35, ".1%", higher=False)
    if memory:
        cut = 1 - memory["ckpt"] / memory["rapidlite"]
        print(
            f"step memory above parameters + optimizer state: {memory['rapidlite'] / 2**20:.0f} MiB without, "
            f"{memory['ckpt'] / 2**20:.0f} MiB with --checkpoint-activations"
        )
        line("--checkpoint-activations memory cut", cut, 0.5, ".1%")


if __name__ == "__main__":
    main()
