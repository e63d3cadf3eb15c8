"""Weights whose saved shapes disagree with the model the config builds: one line for a body tensor on every task;
a task's head taken from another task's checkpoint (a sequence classifier's for multiple choice) is replaced with
a one-line notice when training, refused under ``--eval-only``."""

import json
import logging

import pytest
import torch

from helpers import rapidlite
from rapidlite.errors import ConfigError
from rapidlite.observe.logging import LOGGER_NAME
from rapidlite.tasks import causal_lm_demo
from rapidlite.tasks.causal_lm import load_causal_lm
from rapidlite.tasks.multiple_choice import load_multiple_choice_model
from rapidlite.tasks.multiple_choice_demo import write_demo_assets


@pytest.fixture(scope="module")
def llama_with_wrong_config(tmp_path_factory):
    """A tiny LLaMA (with the causal-LM demo's tokenizer) whose config.json asks for a wider MLP than its weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("resized")
    tokenizer = AutoTokenizer.from_pretrained(causal_lm_demo.write_demo_assets(root / "demo", seed=1)[0])
    path = root / "llama"
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=len(tokenizer))  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "intermediate_size": 96}))
    return path


def test_a_causal_lm_body_tensor_of_another_shape_is_one_line(llama_with_wrong_config, tmp_path, caplog):
    with pytest.raises(ConfigError) as refused:
        load_causal_lm(str(llama_with_wrong_config))
    message = str(refused.value)
    assert "tensor model.layers.0.mlp.down_proj.weight has shape (32, 64) in the weights but (32, 96)" in message
    assert "make the config match the weights" in message and "\n" not in message
    assert "LOAD REPORT" not in caplog.text  # transformers' table of the refused load is dropped

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)))
    save = tmp_path / "run"
    model = ["--pretrained-model-name-or-path", str(llama_with_wrong_config)]
    proc = rapidlite("--task", "causal_lm", *model, "--data-path", str(data), "--micro-batch-size", "2",
                     "--train-iters", "1", "--save", str(save))  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "down_proj" in line or "Traceback" in line]
    assert len(lines) == 1 and "has shape (32, 64) in the weights" in lines[0], proc.stderr[-2000:]
    assert "LOAD REPORT" not in proc.stdout + proc.stderr and not save.exists()


@pytest.fixture(scope="module")
def classifier_checkpoint(tmp_path_factory):
    """The multiple-choice demo's tiny BERT saved as a 3-label sequence classifier."""
    from transformers import AutoModelForSequenceClassification

    model_dir, _ = write_demo_assets(tmp_path_factory.mktemp("mc"), seed=5, num_train=16, num_validation=8)
    path = model_dir.parent / "classifier"
    classifier = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=3,
                                                                    ignore_mismatched_sizes=True)  # fmt: skip
    classifier.save_pretrained(path)
    classifier.bert.save_pretrained(model_dir.parent / "base")  # the body alone: no head at all
    return path


def test_a_classifier_checkpoint_gets_a_new_multiple_choice_head_with_one_line(
    classifier_checkpoint, log_lines, caplog
):
    from transformers import AutoModelForSequenceClassification

    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    model = load_multiple_choice_model(str(classifier_checkpoint))
    saved = AutoModelForSequenceClassification.from_pretrained(classifier_checkpoint)
    assert model.classifier.weight.shape == (1, saved.config.hidden_size)  # one score a choice
    for name, tensor in saved.bert.state_dict().items():  # the body is the checkpoint's
        assert torch.equal(model.bert.state_dict()[name], tensor), name
    notices = [line for line in log_lines if "saved head" in line]
    assert (
        len(notices) == 1
        and "(classifier.weight and 1 more: shape (3, 64), this task's (1, 64)); training a new multiple-choice head"
        in notices[0]
    ), notices
    assert "LOAD REPORT" not in caplog.text

    with pytest.raises(ConfigError, match="--eval-only: .* holds no trained multiple-choice head "
                                          r"\(classifier.bias has another shape in its weights\)"):  # fmt: skip
        load_multiple_choice_model(str(classifier_checkpoint), evaluating=True)
    base = classifier_checkpoint.parent / "base"
    with pytest.raises(ConfigError, match="holds no trained multiple-choice head .*is not in its weights"):
        load_multiple_choice_model(str(base), evaluating=True)
