"""Every script in examples/ runs as the README shows it."""

import pytest

from helpers import REPO, rapidlite_captured


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rapidlite.tasks.demo import write_demo_assets

    return write_demo_assets(tmp_path_factory.mktemp("assets"), seed=5, num_train=256, num_validation=64, num_test=16)


def test_pretrain_custom_model(tmp_path):
    proc = rapidlite_captured(
        "--user-script",
        str(REPO / "examples" / "pretrain_custom_model.py"),
        "--train-iters",
        "40",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "16",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "4",
        "--lr-decay-style",
        "cosine",
        "--log-interval",
        "10",
        "--save",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "iteration: 40" in proc.stdout and "evaluation (validation)" in proc.stdout
    assert (tmp_path / "latest").read_text().strip() == "40"


def test_finetune_huggingface_bert(assets, tmp_path):
    model_dir, data_dir = assets
    proc = rapidlite_captured(
        "--user-script",
        str(REPO / "examples" / "finetune_huggingface_bert.py"),
        "--pretrained-model-name-or-path",
        str(model_dir),
        "--data-path",
        str(data_dir),
        "--epochs",
        "2",
        "--micro-batch-size",
        "16",
        "--global-batch-size",
        "32",
        "--lr",
        "1e-3",
        "--seq-length",
        "48",
        "--save",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "accuracy" in proc.stdout
    assert (tmp_path / "hf" / "config.json").is_file()


def test_compose_own_loop(assets):
    model_dir, data_dir = assets
    proc = rapidlite_captured(
        "--user-script",
        str(REPO / "examples" / "compose_own_loop.py"),
        "--pretrained-model-name-or-path",
        str(model_dir),
        "--data-path",
        str(data_dir),
        "--epochs",
        "2",
        "--micro-batch-size",
        "16",
        "--lr",
        "1e-3",
        "--lr-warmup-iters",
        "2",
        "--seq-length",
        "48",
        "--bf16",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2


def test_pretrain_megatron_gpt(tmp_path):
    """The Rapidformer-style white box on mmap data written by the builder (NullTokenizer ids)."""
    import numpy as np

    from rapidlite.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "counting_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = int(rng.integers(0, 60))
        builder.add_item(np.append(np.arange(start, start + int(rng.integers(8, 30))) % 60, 60))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    proc = rapidlite_captured(
        "--user-script", str(REPO / "examples" / "pretrain_megatron_gpt.py"), "--data-path", str(prefix),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "30", "--lr", "3e-3", "--log-interval", "10", "--split", "90,10,0", "--eod-mask-loss",
        "--reset-position-ids", "--reset-attention-mask", "--mmap-warmup", "--save", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[rapidlite] iteration:")]
    losses = [float(line.split("| loss: ")[1].split()[0]) for line in lines]
    assert len(losses) == 3 and losses[-1] < 0.85 * losses[0], losses
