"""``--task grpo`` and ``--task rloo`` whole runs: every layout samples the completions one process samples and
trains as it does (losses, metrics, the exported weights); a rollout trained on twice (``--num-iterations 2``)
resumes mid-rollout as the uninterrupted run; bad input is one line, exit 2, nothing written. The losses,
advantages and metrics themselves are tested equal to TRL's in ``test_rl_losses.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_wandb import read_offline_run

from helpers import (
    REPO,
    assert_same_metrics,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    run_cli,
    stopped_copy,
    write_jsonl,
)
from rapidlite.tasks.causal_lm_demo import write_demo_assets

REWARDS = '''
def letters(prompts, completions, completion_ids, **kwargs):
    """The share of letters in the completion: spread enough to give every group advantages."""
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def overlap(prompts, completions, completion_ids, answer, **kwargs):
    """The answer's words the completion has; None (no reward) for an empty completion."""
    return [None if not c else sum(w in a.split() for w in c.split()) / len(a.split())
            for c, a in zip(completions, answer)]


def no_kwargs(prompts, completions, completion_ids):
    return [0.0 for _ in completions]


def broken(prompts, completions, completion_ids, **kwargs):
    return [1 / 0 for _ in completions]


def short(prompts, completions, completion_ids, **kwargs):
    return [0.0]
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The causal demo's tiny LLaMA and tokenizer, its word-reversal prompts with their answers, and rewards."""
    root = tmp_path_factory.mktemp("grpo")
    model_dir, data_dir = write_demo_assets(root, seed=5, num_train=24, num_validation=4)
    prompts = root / "prompts"
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(data_dir / f"{split}.jsonl")]
        write_jsonl(prompts, split, [{"prompt": r["prompt"], "answer": r["completion"]} for r in rows])
    (root / "rewards.py").write_text(REWARDS)
    return model_dir, prompts, root / "rewards.py"


def grpo_args(assets, *extra, task="grpo"):
    model_dir, prompts, rewards = assets
    return [
        "--task", task, "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(prompts),
        "--reward-funcs", f"{rewards}:letters,{rewards}:overlap",
        "--num-generations", "4", "--global-batch-size", "8", "--max-completion-length", "8",
        "--temperature", "0.9", "--optimizer", "sgd", "--lr", "0.2", "--log-interval", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", *extra,
    ]  # fmt: skip


TWO = ["--micro-batch-size", "2", "--nproc-per-node", "2"]
LAYOUTS = {
    "one": ["--micro-batch-size", "8"],
    "accumulation": ["--micro-batch-size", "2"],
    "ddp": TWO,
    "zero3_offload": [*TWO, "--zero-3-memory-optimization", "--cpu-offload"],
    "deepspeed_zero3": [*TWO, "--deepspeed", "--zero-3-memory-optimization"],
    "tensor_parallel": ["--micro-batch-size", "8", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
    "lora_one": ["--micro-batch-size", "8", "--lora-rank", "4", "--lr", "1.0"],
    "lora_zero3": [*TWO, "--zero-3-memory-optimization", "--lora-rank", "4", "--lr", "1.0"],
    "lora_deepspeed_zero3": [*TWO, "--deepspeed", "--zero-3-memory-optimization", "--lora-rank", "4", "--lr", "1.0"],
    "mu2_one": ["--micro-batch-size", "4", "--num-iterations", "2", "--beta", "0.1"],
    "mu2_ddp": [*TWO, "--num-iterations", "2", "--beta", "0.1"],
    # Each sequence split over the 2 ranks (ring attention), each rank sampling the whole batch.
    "mu2_cp2": ["--micro-batch-size", "4", "--nproc-per-node", "2", "--context-parallel-size", "2",
                "--num-iterations", "2", "--beta", "0.1"],
    "rloo_one": ["--micro-batch-size", "8"],
    "rloo_ddp": TWO,
}  # fmt: skip
# Metrics that equal exactly when the completions do (they are read from the completions and rewards alone).
ROLLOUT_METRICS = ("reward", "reward_std", "rewards/letters/mean", "rewards/overlap/mean", "completions/mean_length")
METRICS = ("loss", "entropy", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """``get(name)``: the --save directory of layout ``name`` (4 SGD steps, a checkpoint at the end, then the
    validation prompts' rewards), run once (a one-process layout in this process)."""
    root = tmp_path_factory.mktemp("grpo-layouts")
    done = {}

    def get(name):
        if name not in done:
            task = "rloo" if name.startswith("rloo") else "grpo"
            common = ["--train-iters", "4", "--reward-weights", "1.0,0.5"]
            common += ["--save-interval", "1"] if name == "mu2_one" else []  # the resume test starts from iteration 1
            common += ["--save", str(root / name)]
            run = rapidlite if "--nproc-per-node" in LAYOUTS[name] else rapidlite_captured
            proc = run(*grpo_args(assets, *common, *LAYOUTS[name], task=task))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = root / name
        return done[name]

    return get


def completions(run):
    return [(r["iteration"], r["completion"], r["tokens"]) for r in map(json.loads, open(run / "completions.jsonl"))]


def assert_same_run(run, reference, rel=1e-5):
    """The same completions (the logged ones token for token, every one through its rewards and lengths), and
    the same losses and metrics."""
    assert completions(run) == completions(reference)
    assert_same_metrics(run, reference, ROLLOUT_METRICS, rel=0, at_least=4)
    assert_same_metrics(run, reference, METRICS, rel=rel, at_least=4)


def test_one_process_trains_samples_and_logs(runs):
    """The run's records: TRL's metric names at every step, rewards that vary within groups (the loss has
    advantages to follow), the validation prompts' rewards at the end, and a sample of completions each step."""
    run = runs("one")
    steps = [r for r in read_metrics(run) if "split" not in r and "loss" in r]
    assert len(steps) == 4
    for name in (
        *ROLLOUT_METRICS,
        "frac_reward_zero_std",
        "entropy",
        "clip_ratio/low_mean",
        "completions/clipped_ratio",
    ):
        assert all(name in r for r in steps), name
    assert any(r["frac_reward_zero_std"] < 1 for r in steps)
    (final,) = [r for r in read_metrics(run) if r.get("split") == "validation"]
    assert final["iteration"] == 4 and 0 < final["reward"] < 2
    logged = completions(run)
    assert [i for i, _, _ in logged] == [i for i in range(1, 5) for _ in range(8)]
    assert all(0 < tokens <= 8 for _, _, tokens in logged)


@pytest.mark.parametrize("layout", ["accumulation"])
def test_accumulation_trains_as_one_micro_batch(runs, layout):
    assert_same_run(runs(layout), runs("one"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "zero3_offload", "deepspeed_zero3", "tensor_parallel"])
def test_two_ranks_sample_and_train_as_one_process(runs, layout):
    """Each rank samples its share of the global batch (the ZeRO-3 layouts with their parameters gathered for the
    rollout, tensor parallelism sharded): the same completions, losses and metrics as one process, and the same
    exported weights."""
    assert_same_run(runs(layout), runs("one"))
    _assert_same_weights(runs(layout), runs("one"))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["lora_zero3", "lora_deepspeed_zero3"])
def test_lora_on_two_ranks_trains_the_adapters_of_one_process(runs, layout):
    """Sampling with the adapters applied; the adapters train as one process's."""
    assert_same_run(runs(layout), runs("lora_one"))
    _assert_same_weights(runs(layout), runs("lora_one"), "adapter/adapter_model.safetensors")


@pytest.mark.distributed
def test_two_iterations_a_rollout_with_a_reference_train_as_one_process(runs):
    """``--num-iterations 2``: the rollout policy's log-probabilities kept for the second step; ``--beta 0.1``: a
    frozen reference copy and the KL term."""
    assert_same_run(runs("mu2_ddp"), runs("mu2_one"))
    steps = [r for r in read_metrics(runs("mu2_one")) if "split" not in r and "loss" in r]
    assert all("kl" in r for r in steps) and steps[-1]["kl"] > 0


@pytest.mark.distributed
def test_context_parallelism_samples_whole_sequences_and_trains_their_shards_as_one_process(runs):
    """CP2: both ranks sample the whole rollout with full attention (the same keys: the same completions), then
    score and train each sequence split over them, the rollout policy's and the reference's log-probabilities
    included; the losses, the KL and every metric are one process's."""
    assert_same_run(runs("mu2_cp2"), runs("mu2_one"))
    assert_same_metrics(runs("mu2_cp2"), runs("mu2_one"), ("kl", "grad_norm"), rel=1e-5, at_least=4)


@pytest.mark.distributed
def test_rloo_on_two_ranks_trains_as_one_process(runs):
    assert_same_run(runs("rloo_ddp"), runs("rloo_one"))


def test_resumed_mid_rollout_equals_the_uninterrupted_run(runs, assets, tmp_path):
    """Stopped after the first step of a rollout trained on twice: the checkpoint holds the rollout, so the
    resumed run trains its second step on the completions the stopped run sampled, and on from there."""
    whole = runs("mu2_one")
    resumed = stopped_copy(whole, tmp_path / "run", iteration=1)
    (resumed / "completions.jsonl").write_text("".join(open(whole / "completions.jsonl").readlines()[:8]))
    argv = grpo_args(assets, "--train-iters", "4", "--save-interval", "1", "--reward-weights", "1.0,0.5")
    argv += LAYOUTS["mu2_one"]
    proc = rapidlite_captured(*argv, "--save", str(resumed), "--load", str(resumed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(resumed, whole, rel=1e-6)


def _assert_same_weights(run, reference, name="model.safetensors"):
    from safetensors.torch import load_file

    ours, expected = load_file(str(run / "hf" / name)), load_file(str(reference / "hf" / name))
    assert set(expected) <= set(ours) and set(ours) - set(expected) <= {"lm_head.weight"}  # tied: one export has it
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5, msg=key)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--num-generations", "1"], "--num-generations 1: --task grpo compares the completions of one prompt"),
        (["--num-generations", "3"], "--global-batch-size 8 is not a multiple of --num-generations 3"),
        (["--reward-funcs", "{rewards}:missing"], "has no function 'missing'"),
        (["--reward-funcs", "{root}/nowhere.py:f"], "no file {root}/nowhere.py"),
        (["--reward-funcs", "no_such_module_here:f"], "no_such_module_here"),
        (["--reward-funcs", "{rewards}:no_kwargs"], "the function takes no **kwargs"),
        (["--reward-funcs", "{rewards}:broken"], "reward function broken ({rewards}:broken) raised ZeroDivisionError"),
        (["--reward-funcs", "{rewards}:short"], "returned 1 rewards for 8 completions"),
        (["--loss-type", "sigmoid"], "--loss-type sigmoid: --task grpo takes grpo, dapo, dr_grpo, bnpo"),
        (["--use-vllm"], "--use-vllm: "),
        (["--reward-weights", "1,2,3"], "--reward-weights: 3 weights for 2 reward functions"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(assets, tmp_path, flags, expected):
    model_dir, prompts, rewards = assets
    fill = {"rewards": str(rewards), "root": str(rewards.parent)}
    flags = [f.format(**fill) for f in flags]
    proc = rapidlite_captured(*grpo_args(assets, *flags, "--train-iters", "1", "--save", str(tmp_path / "run")))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rapidlite: error:")]
    assert len(errors) == 1 and expected.format(**fill) in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_white_box_script_brings_its_prompts_and_rewards(assets, tmp_path):
    """``examples/grpo_own_rewards.py`` under ``--user-script``: rows built in the script, Python reward functions,
    the --task grpo flags read as that task reads them."""
    model_dir, _, _ = assets
    argv = ["--user-script", str(REPO / "examples" / "grpo_own_rewards.py"), "--pretrained-model-name-or-path"]
    argv += [str(model_dir), "--num-generations", "4", "--global-batch-size", "8", "--max-completion-length", "6"]
    argv += ["--train-iters", "2", "--log-interval", "1", "--loss-type", "grpo", "--save", str(tmp_path / "run")]
    proc = rapidlite_captured(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path / "run") if "split" not in r and "loss" in r]
    assert len(steps) == 2 and all("rewards/correct_sum/mean" in r and r["rewards/short/mean"] > 0 for r in steps)
    assert [r["prompt"] for r in map(json.loads, open(tmp_path / "run" / "completions.jsonl"))][0].endswith(" is")
    bad = rapidlite_captured(*argv[:-2], "--num-generations", "1", "--save", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "--num-generations 1: --task grpo compares" in bad.stderr


@pytest.mark.slow
def test_demo_raises_the_reward_above_0_8_and_the_accuracy_with_it(tmp_path, monkeypatch):
    """``--task grpo --demo`` as the README runs it: the validation prompts' mean reward, scored before training
    and after each epoch with the same random streams, rises from the SFT model's to 0.8 or more, and their exact
    answers (``rewards/exact/mean``) rise with it."""
    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "grpo", "--demo", "--save", str(tmp_path / "run"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["reward"] < 0.7
    assert evals[-1]["reward"] >= 0.8
    assert evals[-1]["rewards/exact/mean"] >= evals[0]["rewards/exact/mean"] + 0.15


class StandInLLM:
    """``vllm.LLM`` as ``rapidlite.generation.vllm`` calls it: ``generate`` answers each request with tokens made
    from its seed (up to its max_tokens, then EOS), and ``load_weights``/``reset_prefix_cache`` are recorded."""

    def __init__(self, eos: int) -> None:
        self.eos, self.loaded, self.resets, self.seeds = eos, [], 0, []
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))

    def generate(self, requests, sampling_params, use_tqdm):
        out = []
        for request, params in zip(requests, sampling_params, strict=True):
            assert request["prompt_token_ids"] and params.max_tokens == 6
            self.seeds.append(params.seed)
            ids = [20 + (params.seed + j) % 40 for j in range(params.seed % 6)] + [self.eos]
            ids = ids[: params.max_tokens]
            reason = "stop" if ids[-1] == self.eos else "length"
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason)]))
        return out

    def load_weights(self, weights):
        self.loaded.append({name: tensor.clone() for name, tensor in weights})

    def reset_prefix_cache(self):
        self.resets += 1


def test_use_vllm_dispatches_to_the_engine_and_syncs_the_weights_before_each_rollout(assets, tmp_path, monkeypatch):
    """``--use-vllm`` through a stand-in engine (no GPU here): the rollouts are the engine's completions (each
    request seeded by its completion's key), and before every rollout and the evaluation the engine is given the
    policy's weights by their Hugging Face names (the last copy is the exported model) and a fresh prefix cache."""
    from transformers import AutoTokenizer

    from rapidlite.generation import vllm
    from rapidlite.tasks import grpo_spec

    model_dir, _, _ = assets
    engine = StandInLLM(AutoTokenizer.from_pretrained(model_dir).eos_token_id)
    monkeypatch.setattr(grpo_spec, "check_vllm", lambda: None)
    monkeypatch.setattr(vllm, "make_llm", lambda *args: engine)
    monkeypatch.setattr(
        vllm,
        "sampling_params",
        lambda s, key: SimpleNamespace(seed=key % vllm.SEED_RANGE, max_tokens=s.max_completion_length),
    )
    save = tmp_path / "run"
    argv = grpo_args(assets, "--use-vllm", "--max-completion-length", "6", "--micro-batch-size", "8")
    proc = rapidlite_captured(*argv, "--train-iters", "3", "--optimizer", "sgd", "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(engine.loaded) == 4 and engine.resets == 4  # rollouts 0, 1, 2 and the final evaluation
    from safetensors.torch import load_file

    exported = load_file(str(save / "hf" / "model.safetensors"))
    assert set(exported) <= set(engine.loaded[-1])
    for name, value in exported.items():
        torch.testing.assert_close(engine.loaded[-1][name], value, msg=name)
    assert any(not torch.equal(engine.loaded[0][n], engine.loaded[-1][n]) for n in exported)  # the policy moved
    logged = list(map(json.loads, open(save / "completions.jsonl")))
    assert [row["tokens"] for row in logged[:8]] == [min(seed % 6 + 1, 6) for seed in engine.seeds[:8]]


def test_completions_reach_a_wandb_table(assets, tmp_path, wandb_dir):
    """With --wandb-project, the rows completions.jsonl gets each log interval are also a W&B table at that
    iteration: the same columns and values (nested ones as JSON text), read back from the offline run's files."""
    save = tmp_path / "run"
    argv = ["--train-iters", "2", "--micro-batch-size", "8", "--save", str(save), "--wandb-project", "grpo-test"]
    proc = rapidlite_captured(*grpo_args(assets, *argv))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    tables = [row for row in read_offline_run(run_dir)["history"] if "completions/path" in row]
    assert [row["iteration"] for row in tables] == [1, 2]
    written = [json.loads(line) for line in open(save / "completions.jsonl")]
    for row in tables:
        table = json.loads((run_dir / "files" / row["completions/path"]).read_text())
        expected = [r for r in written if r["iteration"] == row["iteration"]]
        assert table["columns"] == list(expected[0]) and len(table["data"]) == len(expected) == 8
        for got, want in zip(table["data"], expected, strict=True):
            assert got == [v if isinstance(v, int | float | str) else json.dumps(v) for v in want.values()]
