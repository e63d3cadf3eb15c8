"""``--group-by-length``: the Hugging Face Trainer's length-grouped shuffle over rapidlite's data-parallel sampler:
megabatches of global batches sorted longest first, each rank its share of every global batch, and a resumed
run continuing the same order."""

import datasets
import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from helpers import ToyFinetuner, engine, rapidlite_here, train_losses
from rapidlite.cli.main import main
from rapidlite.data.samplers import EpochSampler, padded_share, sample_lengths
from rapidlite.errors import DataError
from rapidlite.tasks.demo import write_demo_assets


def lognormal_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.rint(rng.lognormal(np.log(20), 0.7, n)), 2, 256)]


def test_grouped_order_is_the_trainers_megabatches_sorted_longest_first():
    lengths = lognormal_lengths(1000)
    group = 4  # global batch: megabatches of min(1000 // 16, 50) = 50 global batches = 200 samples
    sampler = EpochSampler(len(lengths), seed=7, lengths=lengths, group_size=group)
    sampler.set_epoch(2)
    order = list(sampler)
    assert order == get_length_grouped_indices(lengths, group, generator=torch.Generator().manual_seed(9))
    assert sorted(order) == list(range(1000))
    assert lengths[order[0]] == max(lengths)  # the longest sample of all comes first (an OOM shows at once)
    for start in range(0, 1000, 200):
        mega = [lengths[i] for i in order[start : start + 200]][1:]  # the first may be the swapped-in longest
        assert mega == sorted(mega, reverse=True)
    sampler.set_epoch(3)
    assert list(sampler) != order  # reshuffled every epoch


@pytest.mark.parametrize("num_samples", [96, 101])
def test_every_rank_gets_its_share_of_each_global_batch_and_resumes_exactly(num_samples):
    lengths = lognormal_lengths(num_samples, seed=1)
    micro, world, accumulation = 3, 2, 2
    group = micro * world * accumulation
    one = EpochSampler(num_samples, seed=0, lengths=lengths, group_size=group, world_size=1, pad=False)
    ranks = [
        EpochSampler(num_samples, seed=0, rank=r, world_size=world, lengths=lengths, group_size=group)
        for r in range(world)
    ]
    order = list(one)
    shares = [list(s) for s in ranks]
    assert len(shares[0]) == len(shares[1]) == -(-num_samples // world)  # padded by wrapping: ranks stay in step
    for step in range(num_samples // group):
        per_rank = [share[step * micro * accumulation : (step + 1) * micro * accumulation] for share in shares]
        assert sorted(per_rank[0] + per_rank[1]) == sorted(order[step * group : (step + 1) * group])
        for micro_batch in range(accumulation):  # the ranks' micro-batches of one micro-step are alike in length
            rows = [lengths[i] for share in per_rank for i in share[micro_batch * micro : (micro_batch + 1) * micro]]
            assert max(rows) - min(rows) <= max(lengths) - min(lengths)
    for sampler, share in zip(ranks, shares, strict=True):  # resuming mid-epoch continues the same order
        sampler.set_epoch(0, start=5)
        assert list(sampler) == share[5:] and len(sampler) == len(share) - 5


def test_grouping_cuts_the_padding():
    lengths = lognormal_lengths(2000, seed=2)
    plain, grouped = padded_share(lengths, 16, 32, grouped=False), padded_share(lengths, 16, 32, grouped=True)
    assert plain > 0.5 and grouped < plain / 3  # measured: 66% of the slots padding, 15% grouped


def test_sample_lengths_of_datasets_and_lists():
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 9, 4, 7)], "labels": [0, 1, 0, 1]})
    assert sample_lengths(ds) == [3, 9, 4, 7]
    assert sample_lengths(ds.select([3, 0])) == [7, 3]  # a selection's rows, not the table underneath
    assert sample_lengths([{"input_ids": [1, 2]}, {"input_ids": torch.ones(5)}]) == [2, 5]
    choices = datasets.Dataset.from_dict({"input_ids": [[[1] * 3, [1] * 5], [[1] * 2, [1] * 2]]})
    assert sample_lengths(choices) == [8, 4]  # multiple choice: the tokens of all its rows
    assert sample_lengths([{"input_ids": [[1, 2], [3]]}]) == [3]
    assert sample_lengths(ds.remove_columns("input_ids")) is None
    assert sample_lengths([{"x": 1}]) is None


def test_samples_without_input_ids_are_refused_in_one_line():
    with pytest.raises(DataError, match=r"--group-by-length: the training samples have no input_ids"):
        ToyFinetuner(engine("--micro-batch-size", "4", "--epochs", "1", "--group-by-length")).train()


def test_pretraining_refuses_it(capsys):
    assert main(["--task", "pretraining", "--train-iters", "2", "--group-by-length"]) == 2
    assert "--group-by-length batches fine-tuning data" in capsys.readouterr().err


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_demo_assets(tmp_path_factory.mktemp("assets"), seed=3, num_train=192, num_validation=32, num_test=16)


def test_black_box_run_groups_and_resumes_the_same_curve(assets, tmp_path, capsys):
    model_dir, data_dir = assets
    argv = ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model_dir)]
    argv += ["--data-path", str(data_dir), "--micro-batch-size", "4", "--global-batch-size", "8", "--epochs", "1"]
    argv += ["--lr", "1e-3", "--log-interval", "1", "--hidden-dropout", "0", "--no-progress", "--group-by-length"]
    argv += ["--lr-decay-style", "constant", "--train-iters", "6"]
    assert rapidlite_here(*argv, "--save", str(tmp_path / "full")) == 0
    assert "--group-by-length: 192 samples of" in capsys.readouterr().out
    assert rapidlite_here(*argv[:-1], "3", "--save", str(tmp_path / "half")) == 0
    assert rapidlite_here(*argv, "--load", str(tmp_path / "half"), "--save", str(tmp_path / "half")) == 0
    full = train_losses(tmp_path / "full")
    assert len(full) == 6 and train_losses(tmp_path / "half") == full  # resumed mid-epoch: bit-exact
