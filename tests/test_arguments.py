import os
import subprocess
import sys

import pytest

from helpers import REPO, run_cli
from rapidlite.cli.main import main
from rapidlite.config.parser import build_parser
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args

# Every flag rapidlite accepts. Adding or renaming one is a deliberate change: update this list with it.
FLAGS = """
--adam-beta1 --adam-beta2 --adam-eps --attention-dropout --bf16 --binary-head --checkpoint-activations --clip-grad
--compile-mode --cpu-offload --data-dir --data-impl --data-name --data-path --dataset-name --dataset-path
--deepspeed --deepspeed-config --demo
--distributed-backend --distributed-timeout-minutes --eod-mask-loss --epochs --eval-interval --eval-iters
--ffn-hidden-size --finetune --fp16 --fsdp-memory-optimization --global-batch-size --help --hidden-dropout
--hidden-size --hysteresis --init-method-std --initial-loss-scale --label-key --load --load-pretrained-weights
--log-interval --loss-scale --loss-scale-window --lr --lr-decay-iters --lr-decay-style --lr-warmup-fraction
--lr-warmup-iters --make-vocab-size-divisible-by --mask-prob --master-addr --master-port --max-position-embeddings
--max-restarts --start-method --merge-file --micro-batch-size --min-loss-scale --min-lr --mixed-precision
--mmap-warmup --nnodes
--no-binary-head --no-curves --no-load-optim --no-load-rng --no-progress --no-save-optim --node-rank --normalization
--nproc-per-node
--num-attention-heads --num-layers --num-layers-per-virtual-pipeline-stage --num-workers --onnx-runtime-training
--optimizer --peak-flops --per-rank-logs --pipeline-model-parallel-size --pipeline-schedule --pipeline-split
--position-embedding-type --pretrained-model-name-or-path --recompute-granularity --recompute-num-layers
--reset-attention-mask --reset-position-ids --save --save-interval --seed --seq-length --sequence-parallel
--sgd-momentum --short-seq-prob --split --swiglu --task --tensor-model-parallel-size --tensorboard-dir --text-keys
--tf32 --no-tf32 --time-budget --tokenizer-model --tokenizer-type --torch-compile --train-iters
--untie-embeddings-and-output-weights --user-script
--vocab-file --vocab-size --weight-decay --zero-1-memory-optimization --zero-2-memory-optimization
--zero-3-memory-optimization
--prompt-key --response-key --prompt-template --chat-template --train-on-prompt --packing --eval-generate
--lora-rank --lora-alpha --lora-dropout --lora-target-modules --lora-modules-to-save --merge-lora --load-in-4bit
--bnb-4bit-quant-type --bnb-4bit-use-double-quant --load-in-8bit
--moe-aux-loss-coeff --moe-z-loss-coeff --freeze-router --num-experts --moe-router-topk --moe-ffn-hidden-size
--moe-shared-expert-intermediate-size --moe-router-load-balancing-type --moe-router-enable-expert-bias
--moe-router-bias-update-rate --moe-grouped-gemm --moe-token-dispatcher-type --expert-model-parallel-size
--context-parallel-size --cp-comm-type
--image-max-pixels --image-min-pixels --skip-bad-images --freeze-vision-tower --no-freeze-vision-tower
--freeze-projector
--eval-only --overwrite --max-skipped-steps
--keep-last --streaming
--dry-run --memory-budget
--mlm-probability --whole-word-masking --line-by-line
--choices-key
--config --wandb-project --wandb-entity --wandb-run-name --wandb-mode
--report-to --mlflow-experiment
--doc-stride --max-answer-length --n-best-size --version-2-with-negative --null-score-diff-threshold
--label-all-tokens
--group-by-length --padding-free
--source-lang --target-lang --source-prefix --max-target-length --num-beams
--use-distributed-optimizer --train-samples --train-tokens --lr-decay-samples --lr-warmup-samples --exit-interval
--exit-duration-in-mins --use-rotary-position-embeddings --no-position-embedding --rotary-base --rotary-percent
--disable-bias-linear --group-query-attention --num-query-groups --kv-channels --rampup-batch-size
--train-data-path --valid-data-path --test-data-path
--use-flash-attn --attention-backend --use-mcore-models --use-legacy-models --transformer-impl
--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
--no-gradient-accumulation-fusion --no-async-tensor-model-parallel-allreduce --overlap-grad-reduce
--overlap-param-gather --DDP-impl --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--apply-query-key-layer-scaling --empty-unused-memory-level --use-cpu-initialization --distribute-saved-activations
--log-throughput --timing-log-level --log-timers-to-tensorboard --log-memory-to-tensorboard
--log-validation-ppl-to-tensorboard --tensorboard-log-interval --ckpt-format --dataloader-type --no-save-rng
--data-cache-path --moe-permute-fusion --moe-router-dtype --moe-shared-expert-overlap --moe-expert-capacity-factor
--bert-no-binary-head --moe-token-drop-policy
--max-length --loss-type --beta --label-smoothing --simpo-gamma --orpo-alpha --rpo-alpha --max-prompt-length
--precompute-ref-logprobs --desirable-weight --undesirable-weight --center-rewards-coefficient
--chunked-loss --no-chunked-loss
--offload-activations
--device-profile --search
--use-dora --use-rslora --loraplus-lr-ratio --lora-init
--eval-harness
--reward-funcs --reward-weights --num-generations --max-completion-length --temperature --top-p --top-k --min-p
--repetition-penalty --generation-batch-size --num-iterations --epsilon --epsilon-high --mask-truncated-completions
--use-vllm --importance-sampling-level --scale-rewards --delta --use-bias-correction-kl --no-use-bias-correction-kl
--normalize-advantages --reward-clip-range --vllm-gpu-memory-utilization
""".split()


def test_flag_set_is_frozen():
    parser = build_parser()
    flags = sorted(opt for action in parser._actions for opt in action.option_strings if opt.startswith("--"))
    assert flags == sorted(FLAGS)


def test_batch_arithmetic():
    args = parse_args(
        ["--task", "sequence_classification", "--demo", "--micro-batch-size", "4", "--global-batch-size", "32"]
    )
    assert args.gradient_accumulation_steps == 8
    args = parse_args(["--task", "sequence_classification", "--demo", "--micro-batch-size", "4"])
    assert args.global_batch_size == 4 and args.gradient_accumulation_steps == 1


def test_precision_resolution():
    base = ["--task", "sequence_classification", "--demo"]
    assert parse_args(base).precision == "fp32"
    assert parse_args(base + ["--mixed-precision"]).precision == "auto"
    assert parse_args(base + ["--fp16"]).precision == "fp16"
    assert parse_args(base + ["--bf16"]).precision == "bf16"


def test_extra_args_provider():
    def extra(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    args = parse_args(["--my-flag", "5"], extra_args_provider=extra, require_task=False)
    assert args.my_flag == 5


BAD_INPUTS = [
    (
        ["--task", "sequence_classification", "--demo", "--micro-batch-size", "3", "--global-batch-size", "10"],
        "--global-batch-size 10 is not divisible",
    ),
    (["--task", "sequence_classification", "--demo", "--fp16", "--bf16"], "--fp16 and --bf16 are exclusive"),
    (
        ["--task", "sequence_classification", "--demo", "--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"],
        "exclusive",
    ),
    (["--task", "sequence_classification", "--demo", "--micro-batch-size", "0"], "--micro-batch-size 0"),
    (["--task", "sequence_classification", "--demo", "--lr", "-1"], "--lr -1.0: must be positive"),
    (["--task", "translation"], "--task translation: unknown task"),
    (["--user-script", "/nonexistent/train.py"], "--user-script /nonexistent/train.py: file not found"),
    (
        ["--task", "sequence_classification", "--demo", "--tensorboard-dir", str(REPO / "setup.py" / "tb")],
        "setup.py is a file, so no directory can be made under it",
    ),
    (
        ["--task", "sequence_classification", "--demo", "--tensorboard-dir", str(REPO / "setup.py")],
        "is a file, not a directory; pass a directory for the TensorBoard event files",
    ),
    (
        ["--task", "sequence_classification", "--demo", "--save", str(REPO / "setup.py" / "run")],
        "setup.py is a file, so no directory can be made under it",
    ),
    (["--user-script", str(REPO / "examples")], "examples: is a directory; pass the script's .py file"),
    (["--user-script", str(REPO / "README.md")], "a .md file is not a Python script; give the trainer script (.py)"),
    (
        ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(REPO / "setup.py")],
        f"setup.py: is a file; pass the directory that holds the model's config.json and weights "
        f"(--pretrained-model-name-or-path {REPO})",
    ),
    (
        ["--task", "sequence_classification", "--demo", "--lr-decay-style", "exponential"],
        "--lr-decay-style exponential: unknown",
    ),
    (["--task", "sequence_classification", "--demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--task", "sequence_classification"], "needs --pretrained-model-name-or-path and --data-path"),
    (["--task", "pretraining", "--compile-mode", "fast"], "--compile-mode: invalid choice"),
    (
        ["--task", "sequence_classification", "--demo", "--zero-1-memory-optimization", "--zero-3-memory-optimization"],
        "are exclusive: give one ZeRO stage",
    ),
    (["--task", "sequence_classification", "--demo", "--cpu-offload"], "--cpu-offload keeps sharded state"),
    (["--task", "sequence_classification", "--demo", "--nproc-per-node", "0"], "--nproc-per-node 0: must be"),
    (
        ["--task", "sequence_classification", "--demo", "--nproc-per-node", "3", "--global-batch-size", "64"],
        "not divisible by --micro-batch-size 32 x data-parallel size 3",
    ),
    (["--task", "sequence_classification", "--demo", "--nnodes", "2", "--nproc-per-node", "1"], "--master-addr"),
    (["--task", "sequence_classification", "--demo", "--pipeline-model-parallel-size", "2"], "runs pretraining"),
    (
        [
            "--task",
            "pretraining",
            "--pipeline-model-parallel-size",
            "2",
            "--nproc-per-node",
            "2",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "4",
        ],
        "1f1b needs at least as many micro-batches per global batch (1) as pipeline stages (2)",
    ),
    (
        [
            "--task",
            "pretraining",
            "--pipeline-model-parallel-size",
            "2",
            "--nproc-per-node",
            "2",
            "--pipeline-schedule",
            "interleaved-1f1b",
        ],
        "add --num-layers-per-virtual-pipeline-stage",
    ),
    (
        [
            "--task",
            "pretraining",
            "--pipeline-model-parallel-size",
            "2",
            "--nproc-per-node",
            "2",
            "--num-layers",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "3",
        ],
        "--num-layers 4 is not divisible by --num-layers-per-virtual-pipeline-stage 3",
    ),
    (
        ["--task", "pretraining", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2", "--num-layers", "1"],
        "--num-layers 1 is fewer than the 2 pipeline stages",
    ),
    (["--task", "pretraining", "--pipeline-split", "2,2"], "add --pipeline-model-parallel-size"),
    (["--task", "pretraining", "--pipeline-split", "2,x"], "expected comma-separated integers"),
    (
        ["--task", "pretraining", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2", "--deepspeed"],
        "--deepspeed does not combine with --pipeline-model-parallel-size 2",
    ),
    (["--task", "sequence_classification", "--demo", "--tensor-model-parallel-size", "2"], "world of 1 process"),
    (["--task", "sequence_classification", "--demo", "--sequence-parallel"], "--sequence-parallel splits"),
    (["--task", "sequence_classification", "--demo", "--finetune"], "--finetune needs --load"),
    (["--task", "sequence_classification", "--demo", "--load", "/nonexistent/ck"], "--load /nonexistent/ck: directory"),
    ([], "no task given"),
    # argparse takes "-1e-3" for a flag ("expected one argument"): read as a value, it meets the check
    (["--task", "pretraining", "--lr", "-1e-3"], "--lr -0.001: must be positive"),
    (["--task", "pretraining", "--min-lr", "-2E-5"], "--min-lr -2e-05: must be >= 0"),
    (["--task", "pretraining", "--demo", "--eval-only"], "--eval-only evaluates fine-tuning tasks"),
    (
        ["--task", "causal_lm", "--demo", "--eval-only", "--save", "/tmp/x", "--save-interval", "5"],
        "--save-interval: --eval-only trains nothing",
    ),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAPIDLITE_CACHE", str(cache))
    assert main(argv) == 2
    assert not cache.exists()  # refused before anything was built or written (the --demo assets)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("rapidlite: error: ") and message in err, err
    assert "Traceback" not in err


def test_bad_input_in_a_real_process(tmp_path):
    proc = run_cli("--task", "sequence_classification", "--demo", "--fp16", "--bf16", cwd=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "exclusive" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_flag_in_user_script_run_directly(tmp_path):
    """``python my_script.py <bad flags>``: the engine's hook prints one line and exits 2."""
    script = tmp_path / "s.py"
    script.write_text("from rapidlite import RapidliteEngine\nRapidliteEngine()\n")
    proc = subprocess.run(
        [sys.executable, str(script), "--global-batch-size", "3", "--micro-batch-size", "2"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "not divisible" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_launcher_starts_its_ranks_without_loading_checkpointing(tmp_path):
    """The launcher of a 2-rank run imports no torch before it hands over to torchrun, and with ``--load`` no
    PyTorch distributed checkpointing (``rapidlite.checkpoint.dcp``): about 0.9 s of CPU that every launch paid."""
    code = (
        "import sys\n"
        "import rapidlite.runtime.launcher as launcher\n"
        "def launch(cfg, entry, argv, module, warm=None):\n"
        "    print(sorted(m for m in ('torch', 'torch.distributed.checkpoint', 'rapidlite.checkpoint.dcp')\n"
        "                 if m in sys.modules))\n"
        "    return 0\n"
        "launcher.launch = launch\n"
        "from rapidlite.cli.main import main\n"
        "assert main(sys.argv[1:]) == 0\n"
    )
    tiny = ["--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2"]
    tiny += ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2"]
    tiny += ["--global-batch-size", "8", "--train-iters", "2", "--data-path", str(tmp_path / "corpus")]
    tiny += ["--nproc-per-node", "2", "--save", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    for load, expected in (([], "[]"), (["--load", str(tmp_path / "run")], "['torch']")):
        proc = subprocess.run([sys.executable, "-c", code, *tiny, *load], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == expected, (load, proc.stdout)


def test_config_error_type():
    with pytest.raises(ConfigError):
        parse_args(["--task", "sequence_classification", "--demo", "--min-lr", "1", "--lr", "0.1"])


def test_help_and_flag_errors_do_not_import_torch():
    """``--help`` and flag mistakes answer before torch, transformers and the task modules are imported."""
    code = (
        "import sys\n"
        "from rapidlite.cli.main import main\n"
        "assert main(['--task', 'sequence_classification', '--demo', '--fp16', '--bf16']) == 2\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
