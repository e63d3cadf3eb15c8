"""Data parallelism and ZeRO on 2 processes (gloo, CPU), launched the way a user launches them:
``rapidlite --user-script ... --nproc-per-node 2``. Every layout is compared with one process."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import DP_COMMON as COMMON
from helpers import DP_ONE as ONE
from helpers import DP_TWO as TWO
from helpers import PRETRAIN, REPO, assert_close_lists, rapidlite, read_metrics, stopped_copy, train_losses
from rapidlite.checkpoint.dcp import read_model_tensors
from rapidlite.data.samplers import EpochSampler, EvalBatchSampler

pytestmark = pytest.mark.distributed

SCRIPTS = REPO / "tests" / "scripts"
LAYOUTS = {
    "ddp": [],
    "zero1": ["--zero-1-memory-optimization"],
    "zero2": ["--zero-2-memory-optimization"],
    "zero3": ["--zero-3-memory-optimization"],
    "fsdp": ["--fsdp-memory-optimization"],
    "zero3_offload": ["--zero-3-memory-optimization", "--cpu-offload"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout trained once for 6 iterations (a checkpoint at 3 and at 6); results shared by the tests. Every
    launch also ends cleanly: workers end with barrier, destroy_process_group and os._exit, and no gloo abort
    comes at interpreter exit (it came in 1 run of 3 before; ``-m soak`` launches 10 times more)."""
    root = tmp_path_factory.mktemp("layouts")
    done = {}

    def get(name):
        if name not in done:
            save = root / name
            argv = ONE if name == "single" else TWO + LAYOUTS[name]
            proc = rapidlite(
                "--user-script",
                PRETRAIN,
                *COMMON,
                *argv,
                "--train-iters",
                "6",
                "--save-interval",
                "3",
                "--save",
                str(save),
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "terminate called" not in proc.stderr
            done[name] = save
        return done[name]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_train_like_one_process(runs, layout):
    reference, run = runs("single"), runs(layout)
    assert len(train_losses(run)) == 6
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    # Adam is blind to the scale of the gradients; their norm is not, so a wrong average shows here.
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)
    expected = read_model_tensors(reference / "iter_0000006")
    actual = read_model_tensors(run / "iter_0000006")  # sharded checkpoints read back whole
    assert actual.keys() == expected.keys()
    # Where a gradient is almost zero, Adam's g / sqrt(v) turns reduction-order rounding into updates of up
    # to ~1% of the lr (3e-3) on a few entries: 1e-4 absolute is far below what a real error moves.
    for k, v in expected.items():
        diff = (actual[k] - v).abs().max().item()
        assert diff < 1e-4, (k, diff)


def state_bytes(save_dir):
    (record,) = [r for r in read_metrics(save_dir) if r.get("split") == "model_state"]
    return record


# Fraction of DDP's per-rank bytes expected on 2 ranks, for (parameters, gradients, optimizer state).
SHARE = {
    "zero1": (1, 1, 0.5),
    "zero2": (0.5, 0.5, 0.5),
    "zero3": (0.5, 0.5, 0.5),
    "fsdp": (0.5, 0.5, 0.5),
    "zero3_offload": (0.5, 0.5, 0.5),
}


@pytest.mark.parametrize("layout", list(SHARE))
def test_per_rank_model_state_is_sharded(runs, layout):
    ddp, sharded = state_bytes(runs("ddp")), state_bytes(runs(layout))
    assert ddp["optimizer_bytes"] >= 2 * ddp["param_bytes"]  # AdamW: two moments per parameter
    for key, share in zip(("param_bytes", "grad_bytes", "optimizer_bytes"), SHARE[layout], strict=True):
        assert sharded[key] == pytest.approx(share * ddp[key], rel=0.10), (key, sharded, ddp)


def resume(runs, first, then, tmp_path):
    """Layout ``first``'s checkpoint of iteration 3 (its run stopped there: nothing later, its first 3 metrics
    records), then 3 more iterations in layout ``then``."""
    save = stopped_copy(runs(first), tmp_path / "resumed", 3)
    layout = lambda name: ONE if name == "single" else TWO + LAYOUTS[name]
    proc = rapidlite(
        "--user-script",
        PRETRAIN,
        *COMMON,
        *layout(then),
        "--train-iters",
        "6",
        "--load",
        str(save),
        "--save",
        str(save),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    return save


def test_resume_two_ranks_zero3_on_one_process(runs, tmp_path):
    save = resume(runs, "zero3", "single", tmp_path)
    assert_close_lists(train_losses(save), train_losses(runs("single")), rtol=1e-5)


def test_resume_one_process_on_two_ranks_zero1(runs, tmp_path):
    save = resume(runs, "single", "zero1", tmp_path)
    assert_close_lists(train_losses(save), train_losses(runs("single")), rtol=1e-5)


def test_resume_same_layout_is_bit_exact(runs, tmp_path):
    save = resume(runs, "zero3", "zero3", tmp_path)
    assert train_losses(save) == train_losses(runs("zero3"))
    for k, v in read_model_tensors(runs("zero3") / "iter_0000006").items():
        assert torch.equal(v, read_model_tensors(save / "iter_0000006")[k]), k


def test_gathered_metrics_equal_one_process(tmp_path):
    """Validation set of 21 on 2 ranks: the last batches are padded, the metrics count every sample once."""
    argv = [
        "--user-script",
        str(SCRIPTS / "classify.py"),
        "--epochs",
        "2",
        "--global-batch-size",
        "8",
        "--lr",
        "0.05",
        "--log-interval",
        "1",
    ]
    evals = {}
    for name, layout in (
        ("one", ["--micro-batch-size", "8"]),
        ("two", ["--micro-batch-size", "4", "--nproc-per-node", "2"]),
    ):
        proc = rapidlite(*argv, *layout, "--save", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        evals[name] = [r for r in read_metrics(tmp_path / name) if r.get("split") == "validation"]
    assert len(evals["one"]) == len(evals["two"]) == 2
    for one, two in zip(evals["one"], evals["two"], strict=True):
        assert two["count"] == one["count"] == 21
        assert two["label_sum"] == one["label_sum"]
        assert two["accuracy"] == one["accuracy"]
        for key in ("loss", "default_loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), key
        assert two["default_loss"] == pytest.approx(two["loss"], rel=1e-5)


def test_samplers_cover_every_index():
    for n, micro, world in ((21, 4, 2), (20, 4, 2), (7, 2, 3), (1, 4, 2), (33, 5, 4)):
        shards = [EvalBatchSampler(n, micro, rank=r, world_size=world) for r in range(world)]
        assert len({len(s) for s in shards}) == 1  # the same number of batches on every rank
        real = []
        for i in range(len(shards[0])):
            for s in shards:
                batch = list(s)[i]
                rows, padding = s.rows(i)
                assert rows == len(batch)
                real += batch[: rows - padding]
        assert real == list(range(n))  # every sample once, in order, padding excluded
        train = [list(EpochSampler(n, shuffle=True, seed=3, rank=r, world_size=world)) for r in range(world)]
        assert len({len(t) for t in train}) == 1 and set(sum(train, [])) == set(range(n))


@pytest.mark.parametrize("kind,code", [("user", 2), ("bug", 1)])
def test_worker_failure_is_one_report_and_no_hang(tmp_path, kind, code):
    start = time.monotonic()
    proc = rapidlite(
        "--user-script",
        str(SCRIPTS / "fail_on_rank.py"),
        *COMMON,
        *TWO,
        "--train-iters",
        "4",
        env={"FAIL": kind},
        timeout=120,
    )
    assert time.monotonic() - start < 60  # rank 0 waits in a collective: it is stopped, not left hanging
    assert proc.returncode == code, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rapidlite: error:")]
    assert len(errors) == 1, proc.stderr
    if kind == "user":
        assert "truncated file" in errors[0] and "Traceback" not in proc.stderr
    else:
        assert "rank 1 failed: ValueError: boom" in errors[0]
        assert proc.stderr.count("Traceback") == 1 and "run_forward_step" in proc.stderr


@pytest.mark.soak
def test_launch_exits_cleanly_every_time(tmp_path):
    """Workers end with barrier, destroy_process_group and os._exit: no gloo abort at interpreter exit (which
    came in 1 run of 3 before). The default suite checks every launch of the ``runs`` fixture; this launches 10
    times more."""
    for _ in range(10):
        proc = rapidlite(
            "--user-script",
            PRETRAIN,
            *COMMON,
            *TWO,
            "--zero-3-memory-optimization",
            "--train-iters",
            "1",
            "--eval-iters",
            "1",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr


def test_black_box_hugging_face_model_on_two_ranks_exports_whole(tmp_path):
    """BERT sharded per layer under ZeRO-2; the export is gathered on rank 0 and equals the checkpoint."""
    from transformers import AutoModelForSequenceClassification

    from rapidlite.tasks.demo import write_demo_assets

    model_dir, data_dir = write_demo_assets(tmp_path / "assets", seed=3, num_train=320, num_validation=41, num_test=8)
    save = tmp_path / "run"
    proc = rapidlite(
        "--task",
        "sequence_classification",
        "--pretrained-model-name-or-path",
        str(model_dir),
        "--data-path",
        str(data_dir),
        "--micro-batch-size",
        "8",
        "--epochs",
        "1",
        "--lr",
        "2e-3",
        "--seq-length",
        "48",
        *TWO[2:],
        "--zero-2-memory-optimization",
        "--save",
        str(save),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (final,) = [r for r in read_metrics(save) if r.get("split") == "validation"]
    assert 0 <= final["accuracy"] <= 1 and final["iteration"] == 20
    exported = AutoModelForSequenceClassification.from_pretrained(save / "hf")
    saved = read_model_tensors(save / "iter_0000020")
    for name, tensor in exported.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert "bert.encoder.layer.0.attention.self.query.weight" in saved


def test_two_nodes_on_one_machine(runs, tmp_path):
    """Two "nodes" run the same command; node 0 is told its place by flags, node 1 by the variables of
    Megatron-style scripts (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT). A static rendezvous joins them."""
    import subprocess
    import sys

    from rapidlite.runtime.distributed import free_port

    port = str(free_port())
    argv = [
        sys.executable,
        "-m",
        "rapidlite",
        "--user-script",
        PRETRAIN,
        *COMMON,
        "--micro-batch-size",
        "2",
        "--nproc-per-node",
        "1",
        "--zero-2-memory-optimization",
        "--train-iters",
        "6",
        "--save",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    node0 = [*argv, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port]
    node1_env = {**env, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    nodes = [
        subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd, e in ((node0, env), (argv, node1_env))
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert_close_lists(train_losses(tmp_path), train_losses(runs("single")), rtol=1e-5)


def test_zero3_with_bf16_and_activation_checkpointing(runs, tmp_path):
    """Composed: FSDP's bf16 policy (fp32 gradient reduction) and recomputation, against fp32 on one process."""
    proc = rapidlite(
        "--user-script",
        PRETRAIN,
        *COMMON,
        *TWO,
        "--zero-3-memory-optimization",
        "--bf16",
        "--checkpoint-activations",
        "--train-iters",
        "6",
        "--save",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision: bf16" in proc.stdout
    assert_close_lists(train_losses(tmp_path), train_losses(runs("single")), rtol=2e-2)  # bf16 has 8 bits


def test_script_run_with_python_launches_itself(runs, tmp_path):
    """``python my_trainer.py --nproc-per-node 2``: the engine re-runs the script under torchrun."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, PRETRAIN, *COMMON, *TWO, "--train-iters", "6", "--per-rank-logs", "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-parallel 2" in proc.stdout
    assert_close_lists(train_losses(tmp_path), train_losses(runs("single")), rtol=1e-5)
    for rank in (0, 1):  # --per-rank-logs: every rank's own log, while the console has rank 0's only
        assert "iteration: 6 |" in (tmp_path / "logs" / f"rank{rank}.log").read_text()


@pytest.mark.parametrize("layout", ["zero1", "zero3"])
def test_zero_flags_on_one_process(runs, tmp_path, layout):
    """A one-process group runs the same sharding code on 1 rank; nothing to shard, the same numbers."""
    proc = rapidlite(
        "--user-script", PRETRAIN, *COMMON, *ONE, *LAYOUTS[layout], "--train-iters", "6", "--save", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-parallel 1" in proc.stdout and "ZeRO-" in proc.stdout
    assert train_losses(tmp_path) == train_losses(runs("single"))


def test_max_restarts_restarts_the_worker_group(tmp_path):
    """Rank 1 fails on the first attempt only: with --max-restarts 1 torchrun restarts the group and it
    finishes; without it the run fails."""
    argv = ["--user-script", str(SCRIPTS / "fail_on_rank.py"), *COMMON, *TWO, "--train-iters", "3"]
    assert rapidlite(*argv, env={"FAIL": "first_attempt"}, timeout=120).returncode == 1
    proc = rapidlite(*argv, "--max-restarts", "1", "--save", str(tmp_path), env={"FAIL": "first_attempt"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(train_losses(tmp_path)) == 3


def test_one_node_launch_does_not_need_a_resolvable_hostname(tmp_path):
    """One node rendezvouses on loopback: a host (or a container without network) whose name resolves to
    nothing still launches, instead of its workers retrying that name until the timeout."""
    argv = ["--user-script", PRETRAIN, *COMMON, *TWO, "--train-iters", "1", "--eval-iters", "1"]
    code = (
        "import socket, sys\n"
        "socket.getfqdn = lambda *args: 'no-such-host.invalid'  # the name torchrun's agent would publish\n"
        "from rapidlite.cli.main import main\n"
        f"sys.exit(main({[*argv, '--distributed-timeout-minutes', '1']!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_start_as_the_start_method_says(tmp_path, method):
    """``--start-method fork`` forks the workers from the launcher (named by rank in ``ps``), ``spawn`` starts
    new interpreters; either way a worker has its share of the cores (OMP_NUM_THREADS unset: cores / ranks,
    not the launcher's count, which a forked worker's OpenMP would otherwise keep) and a pid of its own."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), OUT=str(tmp_path))
    argv = ["--user-script", str(SCRIPTS / "worker_identity.py"), "--nproc-per-node", "2", "--start-method", method]
    proc = subprocess.run(
        [sys.executable, "-m", "rapidlite", *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["threads"] for r in records] == [max((os.cpu_count() or 1) // 2, 1)] * 2
    assert records[0]["pid"] != records[1]["pid"]
    if method == "fork":
        assert [r["name"] for r in records] == ["rapidlite-r0", "rapidlite-r1"]
    else:
        assert all(r["name"].startswith("python") for r in records), records


def test_spawned_workers_train_as_the_forked_ones(runs, tmp_path):
    """The two ways of starting workers (the default here forks them) give the same run, number for number."""
    argv = ["--user-script", PRETRAIN, *COMMON, *TWO, "--train-iters", "6", "--start-method", "spawn"]
    proc = rapidlite(*argv, "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("loss", "grad_norm"):
        assert train_losses(tmp_path, key) == train_losses(runs("ddp"), key)
