"""Every script in examples/ runs as the README shows it."""

import pytest

from helpers import REPO, run_cli


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rapidlite.tasks.demo import write_demo_assets

    return write_demo_assets(tmp_path_factory.mktemp("assets"), seed=5, num_train=256, num_validation=64, num_test=16)


def test_pretrain_custom_model(tmp_path):
    proc = run_cli(
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
    proc = run_cli(
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
    proc = run_cli(
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
