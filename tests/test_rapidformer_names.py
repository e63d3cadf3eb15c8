"""Rapidformer's and Megatron's names in rapidlite: the engine alias, mpu, the flags' spellings, GPTModel's
Megatron convention, --load of a Hugging Face model, val.* files, and torch.compile on variable lengths."""

from __future__ import annotations

import csv

import pytest
import torch

import rapidlite
from helpers import TokenSumFinetuner, engine, run_cli
from rapidlite.compat import mpu
from rapidlite.data.text_classification import load_raw_datasets
from rapidlite.errors import ConfigError
from rapidlite.models import gpt
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.resolve import parse_args


def test_rapidformer_names_are_exported():
    assert rapidlite.RapidformerEngine is rapidlite.RapidliteEngine
    assert rapidlite.compat.mpu is mpu
    assert callable(rapidlite.build_train_valid_test_datasets_for_huggingface)
    for name in ("RapidformerEngine", "mpu", "build_train_valid_test_datasets_for_huggingface"):
        assert name in rapidlite.__all__


def test_mpu_on_one_process_and_broadcast_data():
    engine("--micro-batch-size", "2")
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()) == (0, 1)
    assert (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()) == (0, 1)
    assert (mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()) == (0, 1)
    assert mpu.is_pipeline_first_stage() and mpu.is_pipeline_last_stage()
    assert mpu.get_tensor_model_parallel_group() is None and mpu.get_tensor_model_parallel_src_rank() == 0
    data = {"text": torch.arange(6, dtype=torch.int32).view(2, 3), "label": [1, 0]}
    out = mpu.broadcast_data(["text", "label"], data, torch.int64)
    assert out["text"].dtype == torch.int64 and out["text"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["label"].tolist() == [1, 0]
    with pytest.raises(KeyError, match="has no mask"):
        mpu.broadcast_data(["mask"], data, torch.int64)
    with pytest.raises(TypeError, match="would truncate"):
        mpu.broadcast_data(["x"], {"x": torch.rand(2)}, torch.int64)


def test_page_spellings_of_flags():
    args = parse_args(["--dataset-path", "glue", "--dataset-name", "mrpc"], require_task=False)
    assert args.data_path == ["glue"] and args.dataset_path == "glue"
    assert args.data_name == "mrpc" and args.dataset_name == "mrpc"
    assert parse_args(["--data-path", "a", "b"], require_task=False).dataset_path == ["a", "b"]


def test_gpt_model_megatron_convention_gives_per_token_losses():
    engine("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "50")  # fmt: skip
    torch.manual_seed(0)
    megatron = rapidlite.GPTModel().eval()  # from the flags, as Megatron builds it (eval: no dropout)
    assert megatron.config.num_layers == 2 and megatron.config.hidden_size == 32 and megatron.per_token_loss
    assert megatron.config.vocab_size == 51  # NullTokenizer: the ids plus EOD
    tokens = torch.randint(0, 50, (2, 9))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = megatron(inputs, None, None, labels=labels)
    assert losses.shape == (2, 8) and losses.dtype == torch.float32
    # The same weights under rapidlite's convention: (sum, count) of the same token losses.
    exact = GPTModel(megatron.config).eval()
    exact.load_state_dict(megatron.state_dict())
    loss_sum, count = exact(inputs, labels=labels)
    assert count == 16 and float(loss_sum) == pytest.approx(float(losses.sum()), rel=1e-6)
    assert not exact.per_token_loss
    with pytest.raises(ConfigError, match="pre_process=True"):
        rapidlite.GPTModel(pre_process=False)
    with pytest.raises(ConfigError, match="from rapidlite import GPTModel"):
        gpt.GPTModel()  # the library's own class is handed its config
    assert GPTModel(GPTConfig(vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2), per_token_loss=True)(
        torch.zeros(1, 3, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long)
    ).shape == (1, 3)


@pytest.fixture
def hf_model_dir(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    model_dir = tmp_path / "bert"
    config = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForSequenceClassification(config).save_pretrained(model_dir)
    return model_dir


def test_load_of_a_hugging_face_model_directory(hf_model_dir, tmp_path):
    args = parse_args(["--user-script", __file__, "--load", str(hf_model_dir)], require_task=False)
    assert args.load_is_pretrained_model
    # The black-box fine-tuning task takes it as the model to start from.
    args = parse_args(["--task", "sequence_classification", "--load", str(hf_model_dir), "--data-path", "x"])
    assert args.pretrained_model_name_or_path == str(hf_model_dir)
    # Pretraining is told what to use instead, in one line.
    proc = run_cli("--task", "pretraining", "--train-iters", "40", "--load", str(hf_model_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--pretrained-model-name-or-path DIR --load-pretrained-weights" in proc.stderr
    # An empty directory is still no checkpoint, and the message names both meanings of --load.
    proc = run_cli("--task", "pretraining", "--train-iters", "40", "--load", str(tmp_path))
    assert proc.returncode == 2 and "Hugging Face model directory" in proc.stderr


def test_val_file_is_the_validation_split_and_every_split_is_logged(tmp_path, log_lines):
    for split, rows in (("train", 32), ("val", 8), ("test", 8)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            writer.writerows([[f"row {i}", i % 2] for i in range(rows)])
    parts = load_raw_datasets(str(tmp_path))
    assert {k: len(v) for k, v in parts.items()} == {"train": 32, "validation": 8, "test": 8}
    assert "data: train = train.csv (32 rows); validation = val.csv (8 rows); test = test.csv (8 rows)" in log_lines
    (tmp_path / "val.csv").unlink()
    load_raw_datasets(str(tmp_path), split="3,1")
    assert "validation = 25% of train.csv (--split; no validation file) (8 rows)" in log_lines[-1]
    load_raw_datasets(str(tmp_path), split="100,0,0")
    assert "no validation split" in log_lines[-1]


class _GPTTokenSum(TokenSumFinetuner):
    """Variable-length batches through the built-in GPT's blocks (which --torch-compile compiles)."""

    def model_optimizer_lr_scheduler_provider(self):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=20, num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16)
        return GPTModel(config), None, None


@pytest.mark.slow
def test_torch_compile_of_variable_length_fine_tuning_compiles_once(log_lines):
    """Finetuner batches vary in length (and the last is smaller): compiled shape-generic, every length runs
    through one graph; specialising on the first shapes would compile again at the next length."""
    from rapidlite.graph import compiled_graphs

    torch._dynamo.reset()
    before = compiled_graphs()
    trainer = _GPTTokenSum(engine("--micro-batch-size", "4", "--epochs", "1", "--torch-compile", "--lr", "1e-2"))
    trainer.train()
    assert len({batch["input_ids"].shape for batch in trainer.train_dataloader}) >= 4  # many shapes...
    assert compiled_graphs() - before == 1  # ...one graph
    assert any("any batch and sequence length" in line for line in log_lines)
    assert not [line for line in log_lines if "more graph" in line]
    trainer.monitor._graphs -= 1  # as if a graph had been built after the first step: said in one line
    trainer.monitor._log_recompiles(trainer.iteration)
    assert "torch.compile: 1 more graph compiled by iteration" in log_lines[-1]
