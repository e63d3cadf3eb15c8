"""A user's own loop over ``engine.compose``: both ways of calling backward give the same updates in every
precision, what compose applies is said in one line, and ``build_data_loader`` pads tokenized rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import MLP, ToyRegressionData, engine
from rapidlite import Finetuner
from rapidlite.data.collate import PadCollator


def _own_loop(precision: list[str], backward: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """The page's loop (SGD, so any error in the gradients' scale shows in the update one for one)."""
    eng = engine("--micro-batch-size", "16", "--lr", "0.1", "--clip-grad", "0", "--seed", "3", *precision)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = eng.compose(model_obj=model, optimizer=optimizer, lr_scheduler_fn=lambda opt: None)
    data = ToyRegressionData(48)
    for i in range(steps):
        batch = data[slice(16 * i, 16 * (i + 1))]
        loss = F.mse_loss(model(batch["x"]).float(), batch["y"])
        if backward == "engine":
            eng.backward(loss)
        else:
            loss.backward()
        assert optimizer.step(), "no step may be skipped here"
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]):
    """Largest difference of the two runs' parameter *updates*, relative to the reference update's size."""
    return max(float((a[k] - b[k]).norm() / (b[k] - start[k]).norm()) for k in a)


@pytest.mark.parametrize(
    "precision,tolerance",
    [([], 1e-6), (["--bf16"], 0.05), (["--fp16", "--initial-loss-scale", "1024"], 0.01)],
    ids=["fp32", "bf16", "fp16"],
)
def test_loss_backward_and_engine_backward_give_the_same_updates(precision, tolerance, log_lines):
    torch.manual_seed(0)
    start = {k: v.detach().clone() for k, v in MLP().state_dict().items()}
    reference = _own_loop([], "engine")  # fp32
    via_engine = _own_loop(precision, "engine")
    via_tensor = _own_loop(precision, "tensor")
    assert _max_relative_error(via_engine, reference, start) < tolerance
    assert _max_relative_error(via_tensor, reference, start) < tolerance
    warned = [line for line in log_lines if "came from loss.backward()" in line]
    # Only fp16 has a loss scale to miss; the warning comes once per optimizer, not per step.
    assert len(warned) == (1 if "--fp16" in precision else 0)


def test_compose_says_what_it_applies_to_a_users_optimizer(log_lines):
    eng = engine("--fp16", "--initial-loss-scale", "1024", "--micro-batch-size", "4")
    model = MLP()
    eng.compose(model_obj=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), lr_scheduler_fn=lambda o: None)
    (line,) = [line for line in log_lines if line.startswith("compose: ")]
    for part in (
        "single process",
        "precision fp16",
        "loss scale 1024",
        "optimizer yours: SGD",
        "clipping at norm 1",
        "--clip-grad",
        "LR schedule yours",
        "global batch 4",
    ):
        assert part in line, (part, line)

    eng = engine("--clip-grad", "0", "--lr-decay-style", "cosine", "--train-iters", "5")
    eng.compose(model_obj=MLP())
    line = [line for line in log_lines if line.startswith("compose: ")][-1]
    assert "no gradient clipping" in line and "AdamW" in line and "from the flags" in line
    assert "LR schedule cosine from the flags" in line and "precision fp32" in line


def test_build_data_loader_pads_tokenized_rows_without_a_collate_fn():
    eng = engine("--micro-batch-size", "3")
    rows = [
        {"input_ids": [101, 7, 8, 102], "token_type_ids": [0, 0, 0, 0], "attention_mask": [1, 1, 1, 1], "labels": 1},
        {"input_ids": [101, 9, 102], "token_type_ids": [0, 0, 0], "attention_mask": [1, 1, 1], "labels": 0},
        {"input_ids": [101, 102], "token_type_ids": [0, 0], "attention_mask": [1, 1], "labels": 1},
    ]
    loader = Finetuner(engine=eng).build_data_loader(rows, shuffle=False)
    (batch,) = list(loader)
    assert batch["input_ids"].tolist() == [[101, 7, 8, 102], [101, 9, 102, 0], [101, 102, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["token_type_ids"].shape == (3, 4) and batch["labels"].tolist() == [1, 0, 1]
    assert batch["input_ids"].dtype == torch.int64
    # A tokenized dataset's "label" column reaches the model as "labels", as Hugging Face's collators pass it.
    renamed = PadCollator()([{"input_ids": [1, 2], "label": 1}, {"input_ids": [3], "label": 0}])
    assert renamed["labels"].tolist() == [1, 0] and "label" not in renamed
    assert "label" in PadCollator()([{"x": [1.0], "label": 1}, {"x": [2.0], "label": 0}])  # not tokenized: kept


def test_pad_collator_masks_what_it_pads_and_ignores_padded_labels():
    collate = PadCollator(pad_token_id=5, padding_side="left")
    batch = collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 5, 4]]
    assert batch["labels"].tolist() == [[1, 2, 3], [-100, -100, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]  # added: padding is never attended
    # Equal-length lists are stacked, not transposed into per-position tensors as default_collate would.
    same = collate([{"input_ids": [1, 2], "multi_hot": [0.0, 1.0]}, {"input_ids": [3, 4], "multi_hot": [1.0, 1.0]}])
    assert same["input_ids"].tolist() == [[1, 2], [3, 4]] and same["multi_hot"].dtype == torch.float32
    # Anything else is torch's default collation.
    tensors = collate([(torch.ones(2), 1), (torch.zeros(2), 0)])
    assert tensors[0].shape == (2, 2) and tensors[1].tolist() == [1, 0]


def test_deepspeed_step_without_its_backward_is_one_clear_error():
    """Under --deepspeed only engine.backward(loss) reaches DeepSpeed's scaling, accumulation and update: a step
    after a plain loss.backward() would report an update that never happened."""
    from rapidlite.errors import ConfigError
    from rapidlite.parallel.deepspeed_backend import DeepSpeedOptimizer

    class FakeDeepSpeedEngine:  # the calls DeepSpeedOptimizer makes, nothing more
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        micro_steps = 0
        skipped_steps = 0

        def gradient_clipping(self):
            return 1.0

        def fp16_enabled(self):
            return False

        def gradient_accumulation_steps(self):
            return 1

        def backward(self, loss):
            self.micro_steps += 1

        def step(self):
            pass

        def was_step_applied(self):
            return True

        def get_global_grad_norm(self):
            return 0.5

    optimizer = DeepSpeedOptimizer(FakeDeepSpeedEngine())
    with pytest.raises(ConfigError, match=r"engine.backward\(loss\)"):
        optimizer.step()
    optimizer.backward(torch.ones(()))
    assert optimizer.step() and float(optimizer.last_grad_norm) == 0.5
