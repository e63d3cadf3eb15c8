"""``--streaming``: rows read, encoded in loader workers and packed as training consumes them. Ranks read disjoint
shares whose samples do not depend on the worker count; a checkpoint keeps every rank's position and a resumed run
gives the uninterrupted run's losses exactly, on one process and on two ranks; wrong combinations are one line."""

import json
import shutil

import pytest
import torch

from helpers import english_corpus, rapidlite_captured, read_metrics, run_cli
from rapidlite.data.gpt_dataset import SampleCutter
from rapidlite.data.instruction import CausalLMCollator
from rapidlite.data.packing import Encoded, Packer, pack
from rapidlite.data.streaming import (
    TokenStream,
    Unpacked,
    restore_state,
    stack_samples,
    stream_source,
    validation_rows,
)
from rapidlite.errors import DataError
from rapidlite.tasks.causal_lm_demo import write_demo_assets


def numbered_rows(row):
    """A row's tokens: its number, as many times as its length says (the row a sample came from is readable)."""
    n, length = row["n"], row["length"]
    return [Encoded([n] * length, [n] * length, truncated=False)] if length else []  # length 0: a skipped row


def write_numbered(path, count=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (count,), generator=g).tolist()
    path.write_text("".join(json.dumps({"n": n + 1, "length": k}) + "\n" for n, k in enumerate(lengths)))
    return lengths


def stream(path, packer, rank=0, world=1, workers=0, micro=3):
    return TokenStream(
        str(path), numbered_rows, packer, micro, CausalLMCollator(0), rank=rank, world_size=world, num_workers=workers
    )


def take(iterable, n):
    out = []
    for batch in iterable:
        out.append(batch)
        if len(out) == n:
            break
    return out


def rows_of(batches):
    return [sorted(set(b["input_ids"][i].tolist()) - {0}) for b in batches for i in range(len(b["input_ids"]))]


def test_ranks_read_disjoint_shares_that_are_the_same_at_any_worker_count(tmp_path):
    path = tmp_path / "rows.jsonl"
    lengths = write_numbered(path, count=200)  # more rows than 5 batches take: no second pass
    kept = [n + 1 for n, k in enumerate(lengths) if k]
    seen = {}
    for rank in (0, 1):
        runs = [take(stream(path, Packer(16), rank, 2, workers), 5) for workers in (0, 1, 2)]
        for other in runs[1:]:  # 0, 1 and 2 workers: the same packed samples, bit for bit
            assert len(other) == 5
            for a, b in zip(runs[0], other, strict=True):
                assert all(torch.equal(a[k], b[k]) for k in a)
        seen[rank] = [n for sample in rows_of(runs[0]) for n in sample]
        # This rank's rows are every other row (its round-robin share), in file order, none skipped or repeated.
        assert seen[rank] == [n for n in kept if (n - 1) % 2 == rank][: len(seen[rank])]
        assert len(seen[rank]) > 15
    assert not set(seen[0]) & set(seen[1])
    # One process packs the file in order exactly as the map-style path's pack() does.
    one = take(stream(path, Packer(16)), 4)
    rows = [Encoded([n] * k, [n] * k, False) for n, k in zip(range(1, 201), lengths, strict=True) if k]
    expected = pack(rows, 16)[:12]
    for key in ("input_ids", "labels", "position_ids"):
        got = [
            b[key][i, : len(e[key])].tolist()
            for b, es in zip(one, _chunks(expected, 3), strict=True)
            for i, e in enumerate(es)
        ]
        assert got == [e[key] for e in expected]


def _chunks(items, n):
    return [items[i : i + n] for i in range(0, len(items), n)]


@pytest.mark.parametrize("packer", [lambda: Packer(16), Unpacked], ids=["packed", "unpacked"])
def test_a_resumed_stream_continues_with_the_next_unseen_row(tmp_path, packer):
    path = tmp_path / "rows.jsonl"
    write_numbered(path, count=40)
    whole = take(stream(path, packer(), workers=2), 14)  # more than a pass: the stream reads the file again
    first = stream(path, packer(), workers=2)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # plain data, as a checkpoint keeps it
    resumed = stream(path, packer(), workers=0)
    resumed.load_state_dict(state)
    rest = take(resumed, 9)
    for a, b in zip(whole, head + rest, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_parquet_and_saved_datasets_stream_as_json_lines_do(tmp_path):
    import datasets

    path = tmp_path / "rows.jsonl"
    write_numbered(path, count=50)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    splits = datasets.DatasetDict({"train": table, "validation": table.select(range(5))})
    splits.save_to_disk(str(tmp_path / "saved_dict"))
    source = stream_source(str(tmp_path / "saved_dict"))
    assert (source.train, source.validation) == (
        str(tmp_path / "saved_dict/train"),
        str(tmp_path / "saved_dict/validation"),
    )
    assert validation_rows(source)["validation"].num_rows == 5
    expected = take(stream(path, Packer(16), workers=1), 6)
    for other in (tmp_path / "rows.parquet", tmp_path / "saved", source.train):
        got = take(stream(stream_source(str(other)).train, Packer(16), workers=1), 6)
        for a, b in zip(expected, got, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_position_saved_by_two_ranks_does_not_load_into_one():
    with pytest.raises(DataError, match=r"row g of a pass went to rank g % 2\) .* resume a streaming run with the"):
        restore_state(stream("unused.jsonl", Unpacked()), [{"row": 3, "pending": [], "packer": {}}] * 2)


def test_gpt_samples_are_cut_from_the_documents_in_order():
    cutter = SampleCutter(4)
    samples = cutter.add([1, 2, 3]) + cutter.add([4, 5, 6, 7, 8, 9, 10]) + cutter.add([11])
    # seq_length + 1 tokens each, consecutive samples sharing one boundary token (Megatron's sample index).
    assert samples == [{"text": [1, 2, 3, 4, 5]}, {"text": [5, 6, 7, 8, 9]}]
    assert cutter.state_dict() == {"tokens": [9, 10, 11]}
    assert stack_samples(samples)["text"].shape == (2, 5)


def test_a_rank_without_rows_and_a_missing_source_are_one_line(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"n": 1, "length": 3}) + "\n")
    with pytest.raises(DataError, match="no row for data-parallel rank 1 of 2"):
        take(stream(path, Unpacked(), rank=1, world=2), 1)
    useless = tmp_path / "useless.jsonl"
    useless.write_text(json.dumps({"n": 1, "length": 0}) + "\n" + json.dumps({"n": 2, "length": 0}) + "\n")
    with pytest.raises(DataError, match="gives a training sample"):  # not an endless loop over the file
        take(stream(useless, Unpacked(), workers=2), 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no train.jsonl"):
        stream_source(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The causal-LM demo's tiny LLaMA and instruction rows, and a text corpus for pretraining."""
    root = tmp_path_factory.mktemp("stream")
    model_dir, data_dir = write_demo_assets(root / "demo", seed=5, num_train=240, num_validation=40)
    docs = english_corpus(400, seed=1)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:360]))
    (corpus / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[360:]))
    return model_dir, data_dir, corpus


def causal_args(assets, *extra):
    model_dir, data_dir, _ = assets
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--streaming", "--packing", "--seq-length", "96", "--global-batch-size", "8", "--lr", "2e-3",
        "--train-iters", "6", "--log-interval", "1", "--eval-interval", "3", *extra,
    ]  # fmt: skip


def pretraining_args(assets, *extra):
    model_dir, _, corpus = assets
    return [
        "--task", "pretraining", "--data-path", str(corpus), "--streaming", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(model_dir), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "6", "--log-interval", "1",
        "--eval-interval", "3", "--eval-iters", "2", *extra,
    ]  # fmt: skip


def losses(save):
    return [(r.get("split", "train"), r["loss"]) for r in read_metrics(save) if "loss" in r]


def run_ok(*argv):
    proc = run_cli(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def uninterrupted_and_resumed(args, tmp_path, first, then):
    """Losses of a 6-iteration run (``first``: its extra flags) and of the run resumed from its iteration-4
    checkpoint (``then``: e.g. another worker count), which must read on from the checkpoint's stream position."""
    full, part = tmp_path / "full", tmp_path / "part"
    run_ok(*args, *first, "--save", str(full), "--save-interval", "4")
    part.mkdir()
    shutil.copytree(full / "iter_0000004", part / "iter_0000004")
    (part / "latest").write_text("4")
    proc = run_ok(*args, *then, "--save", str(part), "--load", str(part))
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["iteration"] for r in read_metrics(part) if r.get("split") is None and "loss" in r] == [5, 6]
    return losses(full), losses(part)


@pytest.mark.parametrize("task", ["causal_lm", "pretraining"])
def test_a_resumed_streaming_run_repeats_the_uninterrupted_losses_exactly(assets, tmp_path, task):
    args = causal_args(assets) if task == "causal_lm" else pretraining_args(assets)
    args += ["--micro-batch-size", "4"]
    # The whole run with 2 loader workers, the resumed half with none: the same samples, the same curve, bit for bit.
    full, resumed = uninterrupted_and_resumed(args, tmp_path, ["--num-workers", "2"], ["--num-workers", "0"])
    assert [split for split, _ in full] == ["train"] * 3 + ["validation"] + ["train"] * 3 + ["validation"]
    assert resumed == full[5:]
    assert full[-1][1] < full[0][1]  # it learns


@pytest.mark.distributed
@pytest.mark.parametrize("task", ["causal_lm", "pretraining"])
def test_two_ranks_resume_their_streams_exactly(assets, tmp_path, task):
    """Two ranks (gloo), each its own share of the rows and its own position: resumed from iteration 4, the
    curve of the uninterrupted 2-rank run, bit for bit."""
    args = causal_args(assets) if task == "causal_lm" else pretraining_args(assets)
    args += ["--micro-batch-size", "2", "--nproc-per-node", "2", "--num-workers", "1"]
    full, resumed = uninterrupted_and_resumed(args, tmp_path, [], [])
    assert len(full) == 8 and resumed == full[5:]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--task", "sequence_classification"], "--streaming serves --task causal_lm and pretraining"),
        (["--task", "causal_lm", "--epochs", "2"], "--epochs cannot size the run; give --train-iters N"),
        (["--task", "causal_lm", "--eval-only"], "--eval-only needs the whole data set up front"),
        (["--task", "causal_lm", "--split", "98,2"], "hold validation rows out in a validation.jsonl"),
        (["--task", "pretraining", "--data-path", "corpus_text_document.bin"], "Megatron .bin/.idx data"),
    ],
)
def test_streaming_combinations_that_cannot_work_are_one_line(extra, message):
    argv = ["--streaming", "--data-path", "rows.jsonl", "--pretrained-model-name-or-path", "m", "--train-iters", "2"]
    if "pretraining" in extra:
        argv = [a for a in argv if a not in ("--pretrained-model-name-or-path", "m")]
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "9"]
    proc = rapidlite_captured(*argv, *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
