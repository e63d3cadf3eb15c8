"""``--dry-run`` on every task: the predicted peak within 15% of the peak a run of 2 iterations, an evaluation
after the first, measures (the logged high-water mark of the process's resident set: the record of iteration 2
holds the peaks of the optimizer's first state and of the evaluation).

Each task trains a model of activation-dominated shape (hidden 384, sequences of 256 tokens, rows long enough
to fill them) on data in its own layout, with one tokenizer of 8,300 words (so the causal and masked language
models' output layers take the chunked loss), and a Qwen3-MoE fine-tuned with LoRA on its experts. The layouts of
``tests/test_dry_run.py`` cover the strategies."""

import random
import re

import pytest
from test_dry_run import plans

from helpers import rapidlite, word_tokenizer, write_jsonl, write_tiny_corpus

WORDS = [f"w{i}" for i in range(8300)]
SEQ, HIDDEN = 256, 384
BERT = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 6, "intermediate_size": 1536}
LLAMA = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 6, "intermediate_size": 1024}
# 8 experts of 256, top 2: the experts hold 3 of the model's 4 non-embedding parameters.
QWEN3_MOE = {
    "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 6,
    "head_dim": 64, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 1024,
}  # fmt: skip
T5 = {"d_model": HIDDEN, "d_ff": 1024, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 6, "d_kv": 64}
RUN = [
    "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--log-interval",
    "1", "--no-progress", "--hidden-dropout", "0",
]  # fmt: skip
COMMON = ["--seq-length", str(SEQ), *RUN]


def _model(directory, family, **extra):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    tok = word_tokenizer(directory, WORDS, family == "bert", model_max_length=1024)
    ids = {"pad_token_id": tok.pad_token_id}
    if family == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=len(tok), max_position_embeddings=512, **BERT, **ids, **extra))
    elif family == "llama":
        ids |= {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024, **LLAMA, **ids, **extra)
        model = LlamaForCausalLM(config)
    elif family == "qwen3_moe":
        ids |= {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tok), **QWEN3_MOE, **ids, **extra))
    else:
        ids |= {"eos_token_id": tok.eos_token_id, "decoder_start_token_id": tok.pad_token_id}
        model = T5ForConditionalGeneration(T5Config(vocab_size=len(tok), **T5, **ids, **extra))
    model.save_pretrained(directory)
    return str(directory)


def _text(rng, n):
    return " ".join(rng.choices(WORDS, k=n))


def _rows(task, rng, n):
    """``n`` rows of ``task``'s layout, each long enough to fill ``SEQ`` tokens (a reward model's pair fits in
    it: longer ones are dropped)."""
    rows = []
    for i in range(n):
        if task == "sequence_classification":
            rows.append({"sentence": _text(rng, 300), "label": rng.choice(["a", "b", "c"])})
        elif task == "token_classification":
            tokens = rng.choices(WORDS, k=300)
            rows.append({"tokens": tokens, "ner_tags": [rng.choice(["O", "B-X", "I-X"]) for _ in tokens]})
        elif task == "question_answering":
            words = rng.choices(WORDS, k=400)
            start = rng.randrange(350)
            context, answer = " ".join(words), " ".join(words[start : start + 3])
            offset = len(" ".join(words[:start])) + (1 if start else 0)
            rows.append(
                {
                    "id": str(i),
                    "context": context,
                    "question": _text(rng, 12),
                    "answers": {"text": [answer], "answer_start": [offset]},
                }
            )
        elif task == "multiple_choice":
            row = {"sent1": _text(rng, 150), "sent2": _text(rng, 50), "label": rng.randrange(4)}
            rows.append(row | {f"ending{k}": _text(rng, 100) for k in range(4)})
        elif task in ("masked_lm", "causal_lm"):
            rows.append({"text": _text(rng, 300)})
        elif task == "seq2seq":
            rows.append({"document": _text(rng, 300), "summary": _text(rng, 300)})
        elif task in ("dpo", "reward_model"):
            rows.append({"prompt": _text(rng, 100), "chosen": _text(rng, 150), "rejected": _text(rng, 150)})
        elif task in ("grpo", "rloo"):
            rows.append({"prompt": _text(rng, 200)})
        elif task == "kto":
            rows.append({"prompt": _text(rng, 100), "completion": _text(rng, 150), "label": i % 2 == 0})
    return rows


# Long prompts, short completions: a sequence of SEQ tokens for 56 decoding steps (not 156: the sampling's time).
ONLINE_RL = ["--max-prompt-length", "200", "--max-completion-length", str(SEQ - 200)]
REWARD = "def reward(prompts, completions, completion_ids, **kwargs):\n    return [len(c) % 7 for c in completions]\n"

# task: (model family, extra flags)
TASKS = {
    "sequence_classification": ("bert", []),
    "token_classification": ("bert", []),
    "question_answering": ("bert", ["--doc-stride", "64"]),
    "multiple_choice": ("bert", ["--micro-batch-size", "1"]),
    "masked_lm": ("bert", []),
    "causal_lm": ("llama", []),
    "dpo": ("llama", ["--micro-batch-size", "1"]),
    "kto": ("llama", []),
    "reward_model": ("llama", []),
    # Untrained, the model samples every completion to its full length: 200 prompt + 56 completion tokens = SEQ.
    "grpo": ("llama", [*ONLINE_RL, "--num-generations", "2", "--global-batch-size", "2"]),
    "rloo": ("llama", [*ONLINE_RL, "--num-generations", "2", "--global-batch-size", "2", "--beta", "0.1"]),
    # Last: the plans share one process, and its plan imports ROUGE's libraries (TaskSpec.libraries).
    # Targets of 64 tokens: the evaluation generates that many (a target of SEQ took 4 times the run's time).
    "seq2seq": ("t5", ["--max-target-length", "64"]),
}


# Cases beyond one per task: name -> (task, model family, extra flags). A mixture of experts fine-tuned with LoRA
# (the adapters reach the 3-D expert tensors).
MORE = {"causal_lm_moe_lora": ("causal_lm", "qwen3_moe", ["--lora-rank", "8"])}
ONE_PER_TASK = {task: (task, *spec) for task, spec in TASKS.items() if task != "seq2seq"}
CASES = ONE_PER_TASK | MORE | {"seq2seq": ("seq2seq", *TASKS["seq2seq"])}  # seq2seq last (see TASKS)


@pytest.fixture(scope="module")
def argvs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    models = {family: _model(root / family, family) for family in ("bert", "llama", "t5", "qwen3_moe")}
    prefix = root / "corpus"
    write_tiny_corpus(prefix, docs=2000)
    # First: the plans share one process, and a fine-tuning task's plan imports libraries pretraining's run does
    # not load (TaskSpec.libraries), which would count in pretraining's runtime after it.
    out = {
        "pretraining": [
            "--task", "pretraining", "--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "96", "--make-vocab-size-divisible-by", "8192", "--num-layers", "2", "--hidden-size", str(HIDDEN),
            "--num-attention-heads", "6", "--global-batch-size", "2", "--attention-dropout", "0", *COMMON,
        ]
    }  # fmt: skip
    for name, (task, family, flags) in CASES.items():
        data = root / "data" / name
        write_jsonl(data, "train", _rows(task, rng, 24))
        write_jsonl(data, "validation", _rows(task, rng, 4))
        out[name] = ["--task", task, "--pretrained-model-name-or-path", models[family], "--data-path", str(data)]
        if task in ("grpo", "rloo"):  # a sequence is prompt + completion (ONLINE_RL), not --seq-length
            (root / "reward.py").write_text(REWARD)
            out[name] += [*RUN, *flags, "--reward-funcs", f"{root / 'reward.py'}:reward"]
        else:
            out[name] += [*COMMON, *flags]
    return out


@pytest.fixture(scope="module")
def ratios(argvs):
    """``{task: (predicted MiB, measured MiB)}``: each task planned, then run for 2 iterations. The run's log
    lines are its records (no --save: a checkpoint and export at the end would come after the last record)."""
    predicted = plans(argvs)
    out = {}
    for task, argv in argvs.items():
        # A mixture of experts' rows per expert vary every step, and glibc keeps the freed heap (its mmap threshold
        # grows): a fixed threshold measures the tensors the plan counts (docs/guides/mixture-of-experts.md).
        env = {"MALLOC_MMAP_THRESHOLD_": "131072"} if "moe" in task else None
        proc = rapidlite(*argv, env=env)
        assert proc.returncode == 0, (task, proc.stderr[-3000:])
        log = proc.stdout + proc.stderr
        assert "evaluation (validation) | iteration: 1 |" in log, task  # an evaluation ran before iteration 2
        peaks = [float(x) for x in re.findall(r"\| peak_memory_mb: ([\d.]+)", log)]
        assert len(peaks) >= 2, task
        (rank,) = predicted[task]
        out[task] = (rank["peak_bytes"] / 2**20, max(peaks))
    print("\ntask, predicted MiB, measured MiB, ratio")
    for task, (p, m) in out.items():
        print(f"{task:24s} {p:8.0f} {m:8.0f} {p / m:6.3f}")
    return out


def test_every_task_is_covered():
    from rapidlite.config.tasks import task_names

    assert set(TASKS) | {"pretraining"} == set(task_names())  # a new task is added to TASKS


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pretraining", *CASES])
def test_the_plan_matches_the_run(ratios, case):
    predicted, measured = ratios[case]
    assert abs(predicted - measured) <= 0.15 * measured, (case, predicted, measured)
