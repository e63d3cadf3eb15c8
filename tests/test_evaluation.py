"""rapidlite-eval: multiple-choice accuracy as lm-eval scores it and perplexity, on 1 rank or 2, and the
one-line refusals of bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, english_corpus

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GPT-2 and the byte-level BPE tokenizer it was sized for, saved as transformers saves them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    root = tmp_path_factory.mktemp("eval-model")
    tokenizer = GPT2BPETokenizer(*train_byte_level_bpe(english_corpus(200, seed=0), 300, root / "bpe")).hf_tokenizer()
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.3,
        bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return str(root / "model")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny LLaMA whose tokenizer puts BOS before every text, as LLaMA's do: lm-eval's context/whole split
    then runs with special tokens on both sides."""
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM

    from rapidlite.data.tokenizers import GPT2BPETokenizer, train_byte_level_bpe

    root = tmp_path_factory.mktemp("eval-llama")
    tokenizer = GPT2BPETokenizer(*train_byte_level_bpe(english_corpus(200, seed=0), 300, root / "bpe")).hf_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)]
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        bos_token_id=bos, eos_token_id=bos,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return str(root / "model")


def mc_rows(count: int, seed: int) -> list[dict]:
    """HellaSwag-like items: one with an empty context, one longer than the model's 64 positions (left-truncated)
    and some whose context ends in a space."""
    rng = np.random.default_rng(seed)
    sentences = english_corpus(count * 6, seed=seed)
    rows = []
    for i in range(count):
        context = sentences[i].split(".")[0] + "." + (" " if i % 3 == 0 else "")
        context = {1: "", 2: " ".join(sentences[:count])}.get(i, context)
        endings = [s.split(".")[0].lower() + "." for s in sentences[count + 4 * i : count + 4 * i + 4]]
        rows.append({"context": context, "endings": endings, "label": int(rng.integers(0, 4))})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def hand_scores(model_dir: str, rows: list[dict]) -> dict[str, float]:
    """acc/acc_norm from the model's log-probs, one unbatched forward per ending, tokenised as lm-eval does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    acc, acc_norm = [], []
    for row in rows:
        lls = []
        for ending in row["endings"]:
            context, continuation = row["context"].rstrip(), row["context"][len(row["context"].rstrip()) :]
            continuation += " " + ending
            if context:
                ids = tok.encode(context + continuation)
                n = len(ids) - len(tok.encode(context))
            else:
                cont = tok.encode(continuation, add_special_tokens=False)
                ids, n = [tok.eos_token_id, *cont], len(cont)
            ids = ids[-65:]  # the model's 64 positions and the last token, which is only predicted
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0], -1)
            lls.append(sum(float(logprobs[len(ids) - 1 - n + j, t]) for j, t in enumerate(ids[-n:])))
        lengths = np.array([len(e) for e in row["endings"]], dtype=float)
        acc.append(float(np.argmax(lls) == row["label"]))
        acc_norm.append(float(np.argmax(np.array(lls) / lengths) == row["label"]))
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm)}


def run_eval(*argv: str, threads: int = 1) -> subprocess.CompletedProcess:
    """``rapidlite-eval ARGV`` in a fresh process, as a user runs it (one thread per process: two cores)."""
    env = {k: v for k, v in os.environ.items() if k != "RAPIDLITE_NO_PROGRESS"}  # as a user's: bars by the rule
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "rapidlite.cli.evaluate", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["model_dir", "llama_dir"])
def test_multiple_choice_equals_the_hand_computed_scores(model, tmp_path, capsys, request):
    from rapidlite.cli.evaluate import main

    model_dir = request.getfixturevalue(model)
    capsys.readouterr()  # what building the model printed
    rows = mc_rows(12, seed=1)
    data = write_jsonl(tmp_path / "items.jsonl", rows)
    output = tmp_path / "out" / "results.json"
    assert main(["--model", model_dir, "--data", data, "--micro-batch-size", "3", "--output", str(output)]) == 0
    printed = json.loads(capsys.readouterr().out.strip())
    assert printed == json.loads(output.read_text())
    expected = hand_scores(model_dir, rows)
    assert printed["task"] == "multiple_choice" and printed["n"] == 12
    assert (printed["acc"], printed["acc_norm"]) == (expected["acc"], expected["acc_norm"])
    assert 0 < printed["acc"] < 1 or 0 < printed["acc_norm"] < 1  # not a degenerate fixture
    p = printed["acc"]
    assert printed["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) * 12 / 11 / 12))
    assert os.listdir(output.parent) == ["results.json"]  # no temporary file left behind


def test_perplexity_equals_the_models_own_loss(model_dir, tmp_path):
    """Each row conditioned on the BOS (here EOS) token, every token predicted once, no EOS appended."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rapidlite.evaluation.data import load_eval_data
    from rapidlite.evaluation.scoring import evaluate, load_scorer

    texts = [doc.split(". ")[0] + "." for doc in english_corpus(6, seed=3)]
    task, items = load_eval_data(write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts]))
    assert task == "perplexity"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert max(len(tok.encode(t)) for t in texts) < 64  # one window per row at the model's length
    nll = tokens = 0
    for text in texts:
        ids = torch.tensor([[tok.eos_token_id, *tok.encode(text)]])
        with torch.no_grad():
            nll += float(model(ids, labels=ids).loss) * (ids.shape[1] - 1)
        tokens += ids.shape[1] - 1
    results = evaluate(load_scorer(model_dir, batch_size=4), task, items)
    assert results["tokens"] == tokens and results["n"] == 6
    assert results["loss"] == pytest.approx(nll / tokens, rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    # Shorter windows see less context: every token is still predicted once, with a higher loss.
    windowed = evaluate(load_scorer(model_dir, max_length=8, batch_size=4), task, items)
    assert windowed["tokens"] == tokens and windowed["loss"] != pytest.approx(results["loss"], rel=1e-4)


def test_bad_input_is_one_line_and_exit_2_with_nothing_overwritten(model_dir, tmp_path, capsys):
    from rapidlite.cli.evaluate import main

    output = tmp_path / "results.json"
    output.write_text("keep me")
    fields = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "q", "answers": ["a", "b"], "label": 0}])
    cases = {
        # a file without the fields of any task: its name, the fields it has, the ones needed
        (fields,): ["wrong.jsonl", "question", "answers", "context/endings/label", "text"],
        # the fields of a task it was not asked for
        (write_jsonl(tmp_path / "mc.jsonl", mc_rows(2, 0)), "--task", "perplexity"): ["mc.jsonl", "context", "text"],
        (write_jsonl(tmp_path / "label.jsonl", [{"context": "c", "endings": ["a", "b"], "label": 5}]),): ["label 5"],
        (str(tmp_path / "absent.jsonl"),): ["absent.jsonl", "not found"],
        # a window longer than the model's learned position table (64)
        (write_jsonl(tmp_path / "text.jsonl", [{"text": "a b c"}]), "--seq-length", "128"): ["--seq-length 128", "64"],
    }
    for (data, *extra), words in cases.items():
        code = main(["--model", model_dir, "--data", data, "--output", str(output), "--overwrite", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("rapidlite: error:"), err
        assert all(w in err for w in words), (err, words)
    assert output.read_text() == "keep me"
    # an existing --output without --overwrite is refused before anything runs
    data = write_jsonl(tmp_path / "ok.jsonl", mc_rows(2, 0))
    assert main(["--model", model_dir, "--data", data, "--output", str(output)]) == 2
    assert "--overwrite" in capsys.readouterr().err and output.read_text() == "keep me"
    assert main(["--model", str(tmp_path / "nomodel"), "--data", data]) == 2
    assert "nomodel: no such directory" in capsys.readouterr().err


@pytest.mark.distributed
def test_two_ranks_equal_one(model_dir, tmp_path):
    mc = write_jsonl(tmp_path / "mc.jsonl", mc_rows(10, seed=2))
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in english_corpus(7, seed=4)])
    for data, extra in ((mc, ["--micro-batch-size", "4"]), (text, ["--micro-batch-size", "2", "--seq-length", "16"])):
        one, two = (run_eval("--model", model_dir, "--data", data, *extra, "--nproc-per-node", n) for n in "12")
        assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
        assert "Loading weights" not in one.stderr + two.stderr  # transformers' bars stay off a pipe
        one, two = last_json(one.stdout), last_json(two.stdout)
        assert (one.pop("world_size"), two.pop("world_size")) == (1, 2)
        assert one == two  # exactly: the same batches, gathered in request order


@pytest.mark.distributed
def test_worker_failure_is_one_line(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", [{"context": "a", "endings": ["b " * 40, "c"], "label": 0}])
    result = run_eval("--model", model_dir, "--data", data, "--seq-length", "8", "--nproc-per-node", "2")
    errors = [line for line in result.stderr.splitlines() if "error" in line]  # beside transformers' load bars
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("rapidlite: error: an ending of") and "--seq-length" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["model_dir", "llama_dir"])
def test_acc_and_acc_norm_equal_lm_evals(model, tmp_path, request):
    """The same model directory and items through EleutherAI's lm-eval harness (its HF model, a local task)."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install lm_eval)")
    from lm_eval.tasks import TaskManager

    from rapidlite.cli.evaluate import main

    model_dir = request.getfixturevalue(model)

    rows = mc_rows(16, seed=5)
    data = write_jsonl(tmp_path / "items.jsonl", rows)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        "task: rapidlite_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'datasets'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{endings}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=["rapidlite_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=4,
        device="cpu",
    )["results"]["rapidlite_tiny_mc"]
    output = tmp_path / "ours.json"
    assert main(["--model", model_dir, "--data", data, "--output", str(output)]) == 0
    ours = json.loads(output.read_text())
    assert 0 < ours["acc"] < 1, ours
    if model == "model_dir":
        assert ours["acc"] != ours["acc_norm"], ours  # here the two rules pick differently
    assert (ours["acc"], ours["acc_norm"]) == (theirs["acc,none"], theirs["acc_norm,none"])
    assert ours["acc_stderr"] == pytest.approx(theirs["acc_stderr,none"])
    assert ours["acc_norm_stderr"] == pytest.approx(theirs["acc_norm_stderr,none"])


def test_a_classifier_checkpoint_is_refused_naming_its_head(model_dir, tmp_path, capsys):
    """A GPT-2 saved with a sequence-classification head: one line naming GPT2ForSequenceClassification, not the
    scores of a random LM head put on its body; nothing written."""
    from transformers import AutoTokenizer, GPT2ForSequenceClassification

    from rapidlite.cli.evaluate import main

    classifier = tmp_path / "classifier"
    GPT2ForSequenceClassification.from_pretrained(model_dir, num_labels=2).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(classifier)
    data = write_jsonl(tmp_path / "mc.jsonl", mc_rows(2, 0))
    output = tmp_path / "results.json"
    capsys.readouterr()  # transformers' loading bar
    assert main(["--model", str(classifier), "--data", data, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a GPT2ForSequenceClassification, not a causal LM" in err, err
    assert not output.exists()
