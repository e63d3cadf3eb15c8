"""What a user's forward step may return, and the one line that answers anything else."""

import pytest
import torch
from transformers.modeling_outputs import SequenceClassifierOutput

from rapidlite.errors import RapidliteError
from rapidlite.models.losses import unpack_loss


def test_accepted_forms():
    loss = torch.tensor(0.5)
    assert unpack_loss(loss) == (loss, None)
    assert unpack_loss({"loss": loss}) == (loss, None)
    assert unpack_loss(SequenceClassifierOutput(loss=loss, logits=torch.zeros(2, 2))) == (loss, None)
    assert unpack_loss((loss, 12)) == (loss, 12)
    assert unpack_loss((loss, torch.tensor(7))) == (loss, 7)
    assert unpack_loss((loss, torch.tensor([3.0]))) == (loss, 3)
    assert unpack_loss((loss, {"lm loss": loss.detach()})) == (loss, None)  # Megatron's (loss, stats)


@pytest.mark.parametrize(
    "output, says",
    [
        ((torch.tensor(0.5), torch.zeros(8, 2)), "tensor of shape [8, 2], not a count"),
        ((torch.tensor(0.5), torch.zeros(8, 2), torch.zeros(8, 2)), "tuple of 3 elements"),
        ((torch.tensor(0.5), "x"), "second element is a str"),
        ((torch.tensor(0.5), 2.5), "num_items=2.5"),
        ((0.5, 3), "is a float, not a tensor"),
        (SequenceClassifierOutput(loss=None, logits=torch.zeros(2, 2)), "were labels passed"),
        ({"logits": torch.zeros(2)}, "dict without a loss"),
        (0.5, "got float"),
    ],
)
def test_refused_in_one_line(output, says):
    with pytest.raises(RapidliteError) as caught:
        unpack_loss(output)
    assert says in str(caught.value) and "\n" not in str(caught.value)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ({"input_ids": [1, 2], "labels": 0} for _ in range(4))


class _SizedStream(_Stream):
    def __len__(self):
        return 4


def _provider_datasets(*provided):
    from rapidlite.trainer.providers import split_datasets

    return split_datasets(provided)


@pytest.mark.parametrize("stream", [_Stream(), _SizedStream(), (x for x in range(3))])
def test_iterable_datasets_refused_in_one_line(stream):
    with pytest.raises(RapidliteError, match="train dataset is a .*materialise it first") as caught:
        _provider_datasets(stream, None, None)
    assert "\n" not in str(caught.value)
    from rapidlite.data.loader import build_data_loader

    with pytest.raises(RapidliteError, match="given to build_data_loader"):
        build_data_loader(stream, 2, torch.device("cpu"))


def test_provider_shapes():
    assert _provider_datasets([1, 2], None, None) == ([1, 2], None, None, None)
    with pytest.raises(RapidliteError, match="got 2 values"):
        _provider_datasets([1, 2], None)


def test_metric_values_are_plain_numbers():
    import numpy as np

    from rapidlite.trainer.monitor import metric_values

    values = metric_values(
        {"acc": torch.tensor(0.5), "n": torch.tensor(40), "f1": np.float32(0.25), "per_class": torch.tensor([0.5, 1.0])}
        | {"np_vec": np.array([1, 2]), "note": "ok"}
    )
    assert values == {
        "acc": 0.5, "n": 40.0, "f1": 0.25, "per_class_0": 0.5, "per_class_1": 1.0, "np_vec_0": 1, "np_vec_1": 2,
        "note": "ok",
    }  # fmt: skip
    assert all(type(v) in (float, int, str) for v in values.values())  # JSON and the trackers take them
    with pytest.raises(RapidliteError, match="must return a dict of metrics .* got float"):
        metric_values(0.5)


@pytest.mark.parametrize("flag, dest", [("--lr", "lr"), ("--data-dir", "data_dir")])
def test_a_script_flag_rapidlite_already_has_is_one_line(flag, dest):
    from rapidlite.config.parser import build_parser

    def extra(parser):
        parser.add_argument_group(title="mine").add_argument(flag, default=None)
        return parser

    with pytest.raises(RapidliteError) as caught:
        build_parser(extra)
    assert str(caught.value) == (
        f"extra_args_provider adds {flag}, which rapidlite already has: read it as get_args().{dest} instead of "
        "adding it, or give the script's flag another name"
    )
    assert build_parser(lambda parser: parser.add_argument("--my-flag")).parse_args(["--my-flag", "x"]).my_flag == "x"


@pytest.mark.parametrize(
    "provided, says",
    [
        ((lambda x: x, None, None), "model_optimizer_lr_scheduler_provider returned a function as the model"),
        (("model.pt", None, None), "returned a str as the model, not a torch.nn.Module"),
        ((torch.nn.Linear(8, 1), None), "must return (model, optimizer, lr_scheduler)"),
    ],
)
def test_a_model_provider_that_returns_no_module_is_one_line(tmp_path, capsys, provided, says):
    """It was an AttributeError traceback from the FLOPs count (or an unpacking error)."""
    from helpers import ToyFinetuner, engine

    class Provider(ToyFinetuner):
        def model_optimizer_lr_scheduler_provider(self):
            return provided

    trainer = Provider(engine("--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "4"))
    with pytest.raises(RapidliteError) as caught:
        trainer.train()
    assert says in str(caught.value) and "\n" not in str(caught.value)
