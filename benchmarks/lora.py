"""LoRA and QLoRA fine-tuning: rapidlite against a plain peft + PyTorch loop and ``transformers.Trainer``.

    python benchmarks/lora.py            # workload L, 7 or 9 contenders: 10 minutes on 2 idle cores
    python benchmarks/lora.py --quick    # a tiny model for a few steps, in two processes: checks the script only
    python benchmarks/lora.py --only trainer,plain_again    # some contenders (plain and rapidlite always run)

Workload L (``benchmarks/lora_workload.py``): ``LlamaForCausalLM`` (4 layers, hidden 512, 8 heads, SwiGLU
1376, vocabulary 8192, untied output layer, 21M parameters) built with the same seed in every contender, on
synthetic token rows read in the same order by all; micro-batch 8 x 256, accumulation 2 (4096 tokens a step);
LoRA rank 16, alpha 32, dropout 0 on q/k/v/o/gate/up/down of every block, the adapters drawn from the same
seed; AdamW lr 1e-3, no weight decay, clipping 1.0, 4 warmup steps then cosine to 0; 16 steps; fp32 (bf16
matrix multiplies are 40x slower than fp32 on CPUs without AVX-512 BF16); 2 threads a process. Contenders,
each its own process:

    plain peft loop          get_peft_model and a hand-written loop (torch.optim.AdamW, its defaults)
    HF Trainer + peft        transformers.Trainer on the same peft model, the same settings
    rapidlite                the white-box PreTrainer of lora_workload.py with --lora-rank 16 --lora-alpha 32
    rapidlite --load-in-4bit the same, base linear layers in NF4 (bitsandbytes), fp32 compute
    rapidlite --load-in-8bit the same, base linear layers in LLM.int8 (bitsandbytes)
    rapidlite full f-t       the same model without LoRA: every weight trains (the state-bytes reference)
    plain peft loop, again   the plain loop in a second process: the run's noise floor
    and, on a CPU with a bf16 fast path only (else many times slower than the rest together):
    rapidlite --bf16         LoRA on a bf16 base (bf16 autocast)
    rapidlite --bf16 --load-in-4bit --bnb-4bit-use-double-quant    the QLoRA recipe

As in ``speed.py`` the contenders take turns step by step (a global optimizer-step hook stops each after its
step until this script lets it run the next), so a change in the machine's load hits them alike; a step's
time is the wall time of its turn, the table gives the median over steps 3-16 (``--quick``, which measures nothing,
runs the baselines one after another in one process and rapidlite's contenders in another, taking turns: two
start-ups of torch, transformers and peft instead of nine; see ``speed.process_groups``). Before printing any speed the
script checks that the contenders started from the same adapters (a fingerprint of the trainable tensors
before the first step) and that the Trainer's, rapidlite's and the second plain loop's loss curves match the
plain loop's within 1e-4 relative at every step. The quantised and bf16 runs train a different base (rounded
weights) or compute differently: their loss difference is shown, not checked.

Memory, per contender: the trainable state (trainable parameters, their gradients and the optimizer state,
counted from the optimizer after step 1), peak RSS of the whole process, and peak RSS while training (the
kernel's high-water mark reset after step 1, so building and quantising the model is left out). Weight bytes
of the base model (the state dict: 4-bit and 8-bit weights with their scales) in fp32, bf16, NF4, NF4 with
double quantisation and int8, measured without training (what is not quantised, the embedding and the output
layer, in bf16 in the quantised rows: the QLoRA recipe's compute dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_workload import LORA_SEED, QUICK, L, LoraWorkload, build_model, dataset, peft_config  # noqa: E402
from speed import (
    TURN_FDS,
    Turns,
    lr_lambda,
    max_relative_difference,
    process_groups,
    spawn,
    take_turns_grouped,
)  # noqa: E402

WORKLOAD_SCRIPT = Path(__file__).resolve().with_name("lora_workload.py")
LOSS_TOLERANCE = 1e-4  # relative, every step: fp32 contenders computing the same thing in the same order
TARGETS = {"plain": 1.0, "trainer": 1.05}  # rapidlite's tokens/s over these contenders'


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    kind: str  # "plain", "trainer" or "rapidlite" ("group": a process running several, see spawn)
    flags: tuple[str, ...] = ()
    lora: bool = True
    bf16: bool = False


CONTENDERS = [
    Contender("plain", "plain peft loop", "plain"),
    Contender("trainer", "HF Trainer + peft", "trainer"),
    Contender("rapidlite", "rapidlite", "rapidlite"),
    Contender("qlora4", "rapidlite --load-in-4bit", "rapidlite", ("--load-in-4bit",)),
    Contender("qlora8", "rapidlite --load-in-8bit", "rapidlite", ("--load-in-8bit",)),
    Contender("full", "rapidlite full fine-tuning", "rapidlite", lora=False),
    Contender("plain_again", "plain peft loop, again (noise floor)", "plain"),
    Contender("bf16", "rapidlite --bf16", "rapidlite", ("--bf16",), bf16=True),
    Contender(
        "qlora4_bf16",
        "rapidlite --bf16 --load-in-4bit --bnb-4bit-use-double-quant",
        "rapidlite",
        ("--bf16", "--load-in-4bit", "--bnb-4bit-use-double-quant"),
        bf16=True,
    ),
]
BY_KEY = {c.key: c for c in CONTENDERS}
CHECKED = ("trainer", "rapidlite", "plain_again")  # must equal the plain loop's curve


# ---------------------------------------------------------------------- inside a contender's process


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the high-water mark restarts from the current RSS


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class FirstStep:
    """Before step 1: a fingerprint of the trainable tensors (the adapters as created). After step 1: the bytes
    of the trainable state, then the peak-RSS reset (what follows is training only)."""

    def __init__(self) -> None:
        self.fingerprint: float | None = None
        self.state: dict[str, int] | None = None
        self.peak_before = 0

    def before(self, optimizer, args, kwargs) -> None:
        if self.fingerprint is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.fingerprint = sum(float(p.detach().double().abs().sum()) for p in params)

    def after(self, optimizer, args, kwargs) -> None:
        if self.state is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.state = {
                "trainable_params": sum(p.numel() for p in params),
                "param_bytes": tensor_bytes(params),
                "grad_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
                "optimizer_bytes": tensor_bytes(
                    v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")
                ),
            }
            self.peak_before = peak_rss_kib() * 1024  # getrusage's ru_maxrss is reset with it
            reset_peak_rss()


def peft_model(w: LoraWorkload):
    import torch
    from peft import get_peft_model

    model = build_model(w)
    torch.manual_seed(LORA_SEED)
    return get_peft_model(model, peft_config(w))


def run_plain(w: LoraWorkload) -> list[float]:
    import torch

    model = peft_model(w)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=w.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(w))
    batches = iter(torch.utils.data.DataLoader(dataset(w), batch_size=w.micro_batch))
    losses = []
    for _ in range(w.steps):
        total = 0.0
        for _ in range(w.accumulation):
            loss = model(**next(batches)).loss / w.accumulation
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable, w.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def run_trainer(w: LoraWorkload, workdir: str) -> list[float]:
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
        weight_decay=0.0,
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
    trainer = Trainer(model=peft_model(w), args=args, train_dataset=InOrder(dataset(w)))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_rapidlite(w: LoraWorkload, c: Contender, workdir: str) -> list[float]:
    from rapidlite.cli.main import main as rapidlite_main

    argv = [
        *("--user-script", str(WORKLOAD_SCRIPT), *w.model_flags(), *(w.lora_flags() if c.lora else ())),
        *("--micro-batch-size", str(w.micro_batch), "--global-batch-size", str(w.global_batch)),
        *("--train-iters", str(w.steps), "--lr", str(w.lr), "--min-lr", "0", "--lr-decay-style", "cosine"),
        *("--lr-warmup-iters", str(w.warmup), "--lr-decay-iters", str(w.steps)),
        *("--weight-decay", "0", "--clip-grad", str(w.clip), "--seed", "0"),
        *("--log-interval", "1", "--save", workdir, "--no-save-optim"),
        *c.flags,
    ]
    code = rapidlite_main(argv)
    if code:
        raise SystemExit(f"rapidlite exited with {code}")
    metrics = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in metrics if "split" not in r and "loss" in r]


def contender_main(keys: list[str], result: str, quick: bool) -> None:
    """The contenders ``keys`` one after another (one, but where --quick groups them), taking turns with the other
    processes; their records by key in ``result``."""
    import peft  # noqa: F401  (every contender imports the same libraries before the baseline RSS)
    import torch
    import transformers  # noqa: F401
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    import rapidlite.cli.main  # noqa: F401

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rss_start = peak_rss_kib() * 1024
    w = QUICK if quick else L
    turns = Turns(os.environ[TURN_FDS])
    records = {}
    for key in keys:
        contender = BY_KEY[key]
        first = FirstStep()
        hooks = [
            register_optimizer_step_pre_hook(first.before),
            register_optimizer_step_post_hook(first.after),  # before the turn-taking hook: measured, then wait
            register_optimizer_step_post_hook(turns),
        ]
        with tempfile.TemporaryDirectory(prefix=f"lora_bench_{key}_") as workdir:
            if contender.kind == "plain":
                losses = run_plain(w)
            elif contender.kind == "trainer":
                losses = run_trainer(w, workdir)
            else:
                losses = run_rapidlite(w, contender, workdir)
        for hook in hooks:
            hook.remove()
        records[key] = {
            "losses": losses,
            "fingerprint": first.fingerprint,
            "state": first.state,
            "rss_start": rss_start,
            "max_rss": max(first.peak_before, peak_rss_kib() * 1024),
            "train_peak_rss": peak_rss_kib() * 1024,
        }
    Path(result).write_text(json.dumps(records))


# ---------------------------------------------------------------------- the coordinator


def run_interleaved(contenders: list[Contender], w: LoraWorkload, quick: bool, threads: int, tmp: Path) -> dict:
    """Step 1 (start-up, building and quantising the model) side by side; then every process in turn."""
    groups = process_groups(contenders, quick, together=lambda c: c.kind == "rapidlite")
    running = [spawn(group, tmp, quick, threads, __file__) for group in groups]
    return take_turns_grouped(running, [[c.key for c in group] for group in groups], w.steps)


def check(results: dict) -> bool:
    """Same adapters at the start everywhere; the fp32 LoRA curves equal the plain loop's."""
    ok = True
    reference = results["plain"]
    for key, res in results.items():
        c = BY_KEY[key]
        if not c.lora:
            continue
        # peft creates the adapters in the base's dtype: a bf16 base rounds them (rapidlite then trains them in fp32)
        tolerance = 4e-3 if c.bf16 else 1e-9
        same = abs(res["fingerprint"] - reference["fingerprint"]) <= tolerance * abs(reference["fingerprint"])
        ok &= same
        print(
            f"check adapters before step 1, {c.label} vs plain peft loop: "
            f"{res['fingerprint']:.9g} vs {reference['fingerprint']:.9g}: {'ok' if same else 'DIFFERENT'}"
        )
    for key in (k for k in CHECKED if k in results):
        diff = max_relative_difference(results[key]["losses"], reference["losses"])
        good = diff <= LOSS_TOLERANCE
        ok &= good
        print(
            f"check loss {BY_KEY[key].label} vs plain peft loop over {len(reference['losses'])} steps: max relative "
            f"difference {diff:.1e} (tolerance {LOSS_TOLERANCE:.0e}): {'ok' if good else 'DIFFERENT'}"
        )
    for key in ("qlora4", "qlora8", "bf16", "qlora4_bf16"):
        if key in results:
            diff = max_relative_difference(results[key]["losses"], reference["losses"])
            print(f"loss {BY_KEY[key].label} vs plain peft loop: max relative difference {diff:.1e} (not checked)")
    return ok


def weight_bytes(w: LoraWorkload) -> dict[str, int]:
    """Bytes of the base model's state dict in each storage (tied tensors counted once), without training."""
    import torch

    from rapidlite.config.sections import LoraConfig
    from rapidlite.models import lora

    def size(model) -> int:
        seen, total = set(), 0
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    out = {"fp32": size(build_model(w)), "bf16": size(build_model(w, torch.bfloat16))}
    for name, settings in (
        ("nf4", LoraConfig(lora_rank=w.rank, load_in_4bit=True)),
        ("nf4 double quant", LoraConfig(lora_rank=w.rank, load_in_4bit=True, bnb_4bit_use_double_quant=True)),
        ("int8", LoraConfig(lora_rank=w.rank, load_in_8bit=True)),
    ):
        model = build_model(w, torch.bfloat16)
        lora.quantize(model, settings, torch.bfloat16, torch.device("cpu"))
        out[name] = size(model)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (checks the script)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per contender (default 2)")
    p.add_argument("--only", default=None, help="comma-separated contender keys (plain and rapidlite always run)")
    p.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.contender:
        contender_main(args.contender.split(","), args.result, args.quick)
        return 0

    import torch

    from rapidlite.precision import cpu_bf16_is_fast

    torch.set_num_threads(args.threads)
    w = QUICK if args.quick else L
    fast_bf16 = cpu_bf16_is_fast()
    keys = set(args.only.split(",")) | {"plain", "rapidlite"} if args.only else set(BY_KEY)
    if keys - set(BY_KEY):
        raise SystemExit(f"--only: unknown contender(s) {sorted(keys - set(BY_KEY))}; choose from {list(BY_KEY)}")
    contenders = [c for c in CONTENDERS if c.key in keys and (fast_bf16 or not c.bf16)]
    model = build_model(w)
    print(
        f"workload: LLaMA {w.layers} layers x {w.hidden} (SwiGLU {w.ffn}), vocab {w.vocab}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {w.micro_batch} x {w.seq} tokens x "
        f"{w.accumulation} micro-batches, {w.steps} steps; LoRA rank {w.rank}, alpha {w.alpha:g}; "
        f"{args.threads} threads a process"
    )
    if not fast_bf16:
        print("this CPU has no bf16 fast path: the bf16 contenders are left out (their weight bytes are not)")
    bytes_of = weight_bytes(w)

    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        results = run_interleaved(contenders, w, args.quick, args.threads, Path(tmp))
    if not check(results):
        print("the contenders differ: no speed is reported")
        return 1

    first_timed = 3
    rates = {k: w.tokens_per_step / statistics.median(r["step_s"][first_timed - 2 :]) for k, r in results.items()}
    full = results.get("full", {}).get("state")
    full_trainable = full["param_bytes"] + full["grad_bytes"] + full["optimizer_bytes"] if full else None
    print()
    print(
        "| contender | tokens/s | vs plain loop | vs rapidlite | trainable params | trainable state MiB | "
        "vs full f-t | peak RSS MiB | training peak RSS MiB | loss 1 | loss last |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in contenders:
        res, state = results[c.key], results[c.key]["state"]
        trainable = state["param_bytes"] + state["grad_bytes"] + state["optimizer_bytes"]
        vs_full = f"{trainable / full_trainable:.4f}" if full_trainable else "-"
        print(
            f"| {c.label} | {rates[c.key]:.0f} | {rates[c.key] / rates['plain']:.3f} | "
            f"{rates[c.key] / rates['rapidlite']:.3f} | {state['trainable_params']:,d} | {trainable / 2**20:.2f} | "
            f"{vs_full} | {res['max_rss'] / 2**20:.0f} | {res['train_peak_rss'] / 2**20:.0f} | "
            f"{res['losses'][0]:.4f} | {res['losses'][-1]:.4f} |"
        )
    print()
    print("| base weights | MiB | vs bf16 |")
    print("|---|---|---|")
    for name, size in bytes_of.items():
        print(f"| {name} | {size / 2**20:.2f} | {size / bytes_of['bf16']:.3f} |")
    print()
    for key, target in ((k, t) for k, t in TARGETS.items() if k in rates):
        ratio = rates["rapidlite"] / rates[key]
        verdict = "" if args.quick else f" (target >= {target:.2f}): {'met' if ratio >= target else 'MISSED'}"
        print(f"rapidlite vs {BY_KEY[key].label} tokens/s: x{ratio:.3f}{verdict}")
    if "plain_again" in rates:
        print(f"noise floor: the plain loop's second process ran at x{rates['plain_again'] / rates['plain']:.3f}")
    for key in ("qlora4", "qlora8", "qlora4_bf16"):
        if key in rates:
            print(f"{BY_KEY[key].label} step time: x{rates['rapidlite'] / rates[key]:.2f} of fp32 LoRA's")
    if args.quick:
        print("quick mode: speeds are not meaningful")
    return 0


if __name__ == "__main__":
    sys.exit(main())
