"""``--packing`` against padded batches and the Hugging Face Trainer's padding: useful tokens/s, equal loss.

    python benchmarks/packing.py            # about 5 minutes on 2 cores
    python benchmarks/packing.py --quick    # a tiny model for 3 steps, in two processes: checks the script only

In one invocation, in a temporary directory: an instruction set (prompt/completion jsonl) whose row lengths
follow a seeded log-normal distribution (median 80 tokens, a long tail up to the sequence length of 512), a
byte-level BPE tokenizer trained on it (a word is about one token) and a randomly initialised LLaMA-style model
(4 layers, hidden 256, 4 heads, SwiGLU 688), in Hugging Face format. Contenders, each its own process, fp32, one
thread each (``--threads``), the same model, data and optimizer (AdamW, constant lr 1e-3, no weight decay,
clipping 1.0):

    rapidlite --packing   rapidlite --task causal_lm --packing: rows packed in order into sequences of at most
                          512 tokens, micro-batches of 2 packs (about the real tokens of 8 rows)
    rapidlite padded      the same command without --packing: micro-batches of 8 rows, padded to the longest
    HF Trainer            transformers.Trainer, micro-batches of 8 rows padded to the longest by
                          DataCollatorForSeq2Seq, on the same token ids (rapidlite's encoding of the rows)

Every optimizer step is the whole data set (one global batch per epoch), so at every step each contender's
loss is the per-token loss over the same tokens, whatever the batching and the order: the curves must agree,
and the script checks that before printing any speed. Useful tokens are the loss-bearing ones (the response
and its EOS, labels != -100), the same count for every contender; useful tokens/s is that count over the
median step time. As in ``speed.py``, the contenders run side by side and take turns step by step (a global
optimizer-step hook stops each after its step until this script lets it go), so a change in the machine's
load hits them alike; the first step (start-up and first-use costs) is not timed (``--quick``, which measures
nothing, runs rapidlite's two contenders one after the other in one process: ``speed.process_groups``). Target:
packing >= 1.5x the padded batches' useful tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed import (
    TURN_FDS,
    Running,
    Turns,
    child_env,
    max_rss_bytes,
    process_groups,
    start_contender,
    take_turns_grouped,
)  # noqa: E402  (its turn-taking, shared)

TARGET = 1.5
LOSS_TOLERANCE = 1e-4  # relative, every step: rapidlite packed against padded, and the Trainer against both

# 200 short words: a 512-entry BPE trained on the rows learns most of them as one token.
SYLLABLES = ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "de", "po")
WORDS = [f"{a}{b}" for a in SYLLABLES for b in "abcdefghijklmnopqrst"]


@dataclass(frozen=True)
class Setup:
    rows: int
    seq_length: int
    median_words: float
    sigma: float
    hidden: int
    layers: int
    heads: int
    ffn: int
    micro_padded: int  # rows per micro-batch
    micro_packed: int  # packs of seq_length per micro-batch: about the padded micro-batch's real tokens
    steps: int
    lr: float = 1e-3


FULL = Setup(256, 512, 80, 0.8, 256, 4, 4, 688, micro_padded=8, micro_packed=2, steps=4)
QUICK = Setup(48, 128, 24, 0.8, 64, 2, 2, 128, micro_padded=4, micro_packed=1, steps=3)


# ---------------------------------------------------------------------- data, tokenizer, model


def write_rows(path: Path, s: Setup, seed: int = 0) -> None:
    """Prompt/completion rows whose total length in words is log-normal (cut to fit ``seq_length`` with its
    EOS), split at a random point between prompt and completion."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(math.log(s.median_words), s.sigma, s.rows)), 4, s.seq_length - 8)
    with open(path, "w") as f:
        for n in lengths.astype(int):
            words = rng.choice(WORDS, n)
            cut = int(rng.integers(1, n - 1))
            row = {"prompt": " ".join(words[:cut]) + "\n", "completion": " ".join(words[cut:])}
            f.write(json.dumps(row) + "\n")


def write_model(out: Path, rows_file: Path, s: Setup) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe
    from rapidlite.models.hf import plain_save

    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    vocab, merges = train_byte_level_bpe([r["prompt"] + r["completion"] for r in rows], 512, out / "bpe")
    tokenizer = GPT2BPETokenizer(vocab, merges).hf_tokenizer()
    tokenizer.save_pretrained(out / "model")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden,
        intermediate_size=s.ffn,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        max_position_embeddings=s.seq_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with plain_save():  # no DeepSpeed import (1.5 s) to learn that the model is not wrapped
        LlamaForCausalLM(config).save_pretrained(out / "model")


def encoded(model_dir: Path, data_dir: Path, s: Setup, packing: bool):
    """The rows as ``--task causal_lm`` encodes them (the Trainer contender trains on the same token ids)."""
    from rapidlite.data.instruction import build_instruction_data
    from rapidlite.data.tabular import load_raw_datasets
    from rapidlite.models.hf import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    raw = load_raw_datasets(str(data_dir), split="100,0,0")
    return tokenizer, build_instruction_data(raw, tokenizer, s.seq_length, packing=packing)


def padded_slots(lengths: list[int], micro: int, seed: int = 0, shuffles: int = 20) -> float:
    """Token slots a padded epoch computes (each micro-batch padded to its longest row), mean over shuffles."""
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(shuffles):
        order = np.asarray(lengths)[rng.permutation(len(lengths))]
        total += sum(int(order[i : i + micro].max()) * len(order[i : i + micro]) for i in range(0, len(order), micro))
    return total / shuffles


# ---------------------------------------------------------------------- inside a contender's process


def rapidlite_argv(work: Path, s: Setup, key: str, batches: int) -> list[str]:
    micro = s.micro_packed if key == "packed" else s.micro_padded
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(work / "model"),
        "--data-path", str(work / "data"), "--split", "100,0,0", "--seq-length", str(s.seq_length),
        "--micro-batch-size", str(micro), "--global-batch-size", str(micro * batches), "--epochs", str(s.steps),
        "--lr", str(s.lr), "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "1.0",
        "--log-interval", "1", "--save", str(work / key), *(["--packing"] if key == "packed" else []),
    ]  # fmt: skip


def run_trainer(work: Path, s: Setup) -> list[float]:
    """transformers.Trainer on the rows as rapidlite encodes them, one optimizer step per epoch."""
    import datasets
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer, data = encoded(work / "model", work / "data", s, packing=False)
    tokenizer.pad_token = tokenizer.eos_token  # the usual recipe, and what rapidlite does (padding is masked)
    train = datasets.Dataset.from_list(data.train)
    args = TrainingArguments(
        output_dir=str(work / "trainer"),
        per_device_train_batch_size=s.micro_padded,
        gradient_accumulation_steps=math.ceil(len(train) / s.micro_padded),
        num_train_epochs=s.steps,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(work / "model"),
        args=args,
        train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def contender_main(keys: list[str], work: Path, s: Setup, batches: dict[str, int], result: Path) -> None:
    """The contenders ``keys`` one after another (one, but where --quick groups them), taking turns with the other
    processes; their records by key in ``result``."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    register_optimizer_step_post_hook(Turns(os.environ[TURN_FDS]))
    records = {}
    for key in keys:
        if key == "trainer":
            losses = run_trainer(work, s)
        else:
            from rapidlite.cli.main import main as rapidlite_main

            if rapidlite_main(rapidlite_argv(work, s, key, batches[key])) != 0:
                raise SystemExit(f"rapidlite {key} failed")
            metrics = [json.loads(line) for line in (work / key / "metrics.jsonl").read_text().splitlines()]
            losses = [r["loss"] for r in metrics if "split" not in r]
        records[key] = {"losses": losses, "max_rss": max_rss_bytes()}
    result.write_text(json.dumps(records))


# ---------------------------------------------------------------------- the coordinator


@dataclass(frozen=True)
class Contender:
    key: str
    label: str


CONTENDERS = [
    Contender("packed", "rapidlite --packing"),
    Contender("padded", "rapidlite padded"),
    Contender("trainer", "HF Trainer"),
]


def spawn(group: list[Contender], work: Path, quick: bool, batches: dict[str, int], threads: int) -> Running:
    """A process running the contenders of ``group`` one after another (``speed.process_groups``)."""
    name = "+".join(c.key for c in group)
    log, result = work / f"{name}.log", work / f"{name}.json"
    argv = [sys.executable, __file__, "--contender", ",".join(c.key for c in group), "--work", str(work)]
    argv += ["--batches", json.dumps(batches), "--result", str(result)] + (["--quick"] if quick else [])
    return start_contender(Contender(name, " + ".join(c.label for c in group)), argv, log, result, child_env(threads))


def run_interleaved(work: Path, s: Setup, quick: bool, batches: dict[str, int], threads: int) -> dict[str, dict]:
    """The contenders take turns step by step (each process stops after its optimizer step until it is let go)."""
    groups = process_groups(CONTENDERS, quick, together=lambda c: c.key == "trainer")
    running = [spawn(group, work, quick, batches, threads) for group in groups]
    return take_turns_grouped(running, [[c.key for c in group] for group in groups], s.steps)


def max_relative(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model for 3 steps: checks the script only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per contender (default 1)")
    parser.add_argument("--contender", help=argparse.SUPPRESS)  # keys, comma-separated
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=json.loads, help=argparse.SUPPRESS)  # batches per epoch, by key
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    if args.contender:
        contender_main(args.contender.split(","), Path(args.work), s, args.batches, Path(args.result))
        return 0

    with tempfile.TemporaryDirectory(prefix="packing_bench_") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        write_rows(work / "data" / "train.jsonl", s)
        write_model(work, work / "data" / "train.jsonl", s)
        _, padded = encoded(work / "model", work / "data", s, packing=False)
        _, packed = encoded(work / "model", work / "data", s, packing=True)
        lengths = [len(r["input_ids"]) for r in padded.train]
        useful = padded.trained_tokens
        slots = padded_slots(lengths, s.micro_padded)
        print(
            f"data: {len(lengths)} rows, {sum(lengths)} tokens (median {int(np.median(lengths))}, p90 "
            f"{int(np.percentile(lengths, 90))}, p99 {int(np.percentile(lengths, 99))}, max {max(lengths)}; "
            f"{padded.truncated} cut at {s.seq_length}), {useful} useful (loss-bearing) tokens; "
            f"{len(packed.train)} packs of <= {s.seq_length}: {sum(lengths) / (len(packed.train) * s.seq_length):.1%}"
            f" full; padded micro-batches of {s.micro_padded} rows: {sum(lengths) / slots:.1%} real tokens"
        )
        print(f"setup: {json.dumps(asdict(s))}")
        batches = {
            "packed": math.ceil(len(packed.train) / s.micro_packed),
            "padded": math.ceil(len(lengths) / s.micro_padded),
        }
        results = run_interleaved(work, s, args.quick, batches, args.threads)

    curves = {key: r["losses"] for key, r in results.items()}
    ok = True
    for a, b in (("packed", "padded"), ("trainer", "padded"), ("trainer", "packed")):
        diff = max_relative(curves[a], curves[b])
        first = abs(curves[a][0] - curves[b][0]) / abs(curves[b][0])
        good = diff <= LOSS_TOLERANCE
        ok &= good
        print(
            f"check loss {a} vs {b} over {len(curves[b])} steps: first step {first:.1e}, max relative difference "
            f"{diff:.1e} (tolerance {LOSS_TOLERANCE:.0e}): {'ok' if good else 'FAILED'}"
        )
    if not ok:
        print("the loss curves differ: no speed is reported")
        return 1

    step_s = {key: statistics.median(r["step_s"]) for key, r in results.items()}
    speed = {key: useful / t for key, t in step_s.items()}
    print()
    print("| contender | step s | useful tokens/s | vs padded | vs HF Trainer | peak RSS MiB | loss 1 | loss last |")
    print("|---|---|---|---|---|---|---|---|")
    for c in CONTENDERS:
        key = c.key
        print(
            f"| {c.label} | {step_s[key]:.2f} | {speed[key]:.0f} | {speed[key] / speed['padded']:.2f} | "
            f"{speed[key] / speed['trainer']:.2f} | {results[key]['max_rss'] / 2**20:.0f} | {curves[key][0]:.4f} | "
            f"{curves[key][-1]:.4f} |"
        )
    print()
    ratio = speed["packed"] / speed["padded"]
    print(f"packing vs padded useful tokens/s: x{ratio:.2f}")
    print(f"packing vs HF Trainer useful tokens/s: x{speed['packed'] / speed['trainer']:.2f}")
    if args.quick:
        print("quick mode: speeds are not meaningful")
        return 0
    print(f"target packing >= {TARGET}x padded: {ratio:.2f} {'met' if ratio >= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
