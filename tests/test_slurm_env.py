"""``srun rapidlite ...`` without the sbatch script's exports: Slurm's node list, node count and node index
become MASTER_ADDR, NNODES and NODE_RANK (and MASTER_PORT follows from the job id), explicit values win, and
the launcher hands them to torchrun. No Slurm needed: the variables are the ones a real srun task has
(tests/test_slurm.py checks them under real daemons)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from rapidlite.cli.main import main
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args
from rapidlite.runtime.launcher import needs_launch, torchrun_args
from rapidlite.runtime.slurm import expand_hostlist, rendezvous

HOSTLISTS = [
    pytest.param(hostlist, hosts, id=hostlist)
    for hostlist, hosts in [
        ("node1", ["node1"]),
        ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding when the lower bound has none
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[5]", ["gpu5"]),
        ("login.example.org,x[1-2]", ["login.example.org", "x1", "x2"]),
    ]
]


@pytest.mark.parametrize("hostlist,hosts", HOSTLISTS)
def test_hostlist_expansion(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_an_empty_hostlist_has_no_hosts():
    assert expand_hostlist("") == []


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="Slurm's scontrol is not installed")
def test_hostlist_expansion_agrees_with_scontrol(tmp_path):
    """Slurm's own expansion (``scontrol show hostnames`` needs a slurm.conf, not a running controller)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\n")
    hostlist = ",".join(case.values[0] for case in HOSTLISTS)
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", hostlist],
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": str(conf)},
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert expand_hostlist(hostlist) == proc.stdout.split()


@pytest.mark.parametrize("hostlist", ["node[1-2", "node1-2]", "node[a-b]", "node[3-1]", "n[[1]]"])
def test_bad_hostlist_is_a_config_error(hostlist):
    with pytest.raises(ConfigError, match="Slurm node list"):
        expand_hostlist(hostlist)


# What `srun --nodes=3 --ntasks-per-node=1 rapidlite ...` gives the task on the second node (job 4711).
STEP = {
    "SLURM_JOB_ID": "4711",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_NTASKS": "3",
    "SLURM_JOB_NODELIST": "gpu-[07-09]",
    "SLURM_NODELIST": "gpu-[07-09]",
    "SLURM_STEP_NODELIST": "gpu-[07-09]",
}
DERIVED = {"MASTER_ADDR": "gpu-07", "MASTER_PORT": "24711", "NNODES": "3", "NODE_RANK": "1"}


def test_an_srun_task_derives_the_rendezvous():
    assert rendezvous(STEP) == DERIVED


def test_the_fewest_variables_suffice():
    """Older Slurm or a trimmed environment: the job's node list and counts alone."""
    env = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "3", "SLURM_NODEID": "0", "SLURM_NNODES": "2"}
    assert rendezvous({**env, "SLURM_JOB_NODELIST": "a[1-2]"}) == {
        "MASTER_ADDR": "a1",
        "MASTER_PORT": "20012",
        "NNODES": "2",
        "NODE_RANK": "0",
    }
    assert rendezvous({**env, "SLURM_NODELIST": "b[3,5]"})["MASTER_ADDR"] == "b3"


def test_explicit_values_win_each_on_its_own():
    env = {**STEP, "MASTER_PORT": "29400", "MASTER_ADDR": "10.0.0.7"}
    assert rendezvous(env) == {"NNODES": "3", "NODE_RANK": "1"}
    assert rendezvous({**STEP, **DERIVED}) == {}


@pytest.mark.parametrize(
    "env",
    [
        {},
        # the batch script itself: the job's variables, no step (rapidlite there is one node's launcher)
        {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")},
        # a single-node step: the launcher keeps its private rendezvous on a free port
        {**STEP, "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"},
    ],
    ids=["no-slurm", "batch-script", "one-node"],
)
def test_nothing_is_derived_outside_a_multi_node_step(env):
    assert rendezvous(env) == {}


def test_several_tasks_per_node_are_refused():
    with pytest.raises(ConfigError, match="srun started 24 tasks on 3 nodes.*--ntasks-per-node=1"):
        rendezvous({**STEP, "SLURM_STEP_NUM_TASKS": "24", "SLURM_NTASKS": "24"})


TASK = ["--task", "sequence_classification", "--demo"]


@pytest.fixture
def slurm_env(monkeypatch):
    """The process environment of an srun task (whatever Slurm or launcher variables the test run has, cleared)."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in (*DERIVED, "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(name)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_the_launcher_hands_the_derived_rendezvous_to_torchrun(slurm_env):
    slurm_env(**STEP)
    config = parse_args([*TASK, "--nproc-per-node", "2"])
    assert needs_launch(config)
    assert torchrun_args(config)[1:] == ["--nnodes=3", "--max-restarts=0", "--monitor-interval=0.2"] + [
        "--node-rank=1",
        "--master-addr=gpu-07",
        "--master-port=24711",
    ]


def test_flags_and_exports_win_over_slurm(slurm_env):
    slurm_env(**STEP, MASTER_ADDR="10.0.0.7", NODE_RANK="2")
    config = parse_args([*TASK, "--nproc-per-node", "2", "--master-port", "29400"])
    assert torchrun_args(config)[-3:] == ["--node-rank=2", "--master-addr=10.0.0.7", "--master-port=29400"]


def test_one_process_per_node_still_launches_across_nodes(slurm_env):
    """srun on 3 nodes with one worker each: 3 ranks in all, so the task is a launcher, not a lone process."""
    slurm_env(**STEP)
    config = parse_args([*TASK, "--nproc-per-node", "1"])
    assert needs_launch(config)


def test_a_single_node_step_keeps_the_private_rendezvous(slurm_env):
    slurm_env(**{**STEP, "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1"})
    slurm_env(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1", SLURM_STEP_NODELIST="gpu-07")
    config = parse_args([*TASK, "--nproc-per-node", "2"])
    args = torchrun_args(config)
    assert "--standalone" in args  # a private rendezvous on this host, nothing derived from Slurm's variables
    assert "--nnodes=1" in args and not any(a.startswith(("--master-addr", "--node-rank")) for a in args), args


@pytest.mark.parametrize("tasks", ["3", "6"])
def test_a_worker_joins_whatever_slurm_says(slurm_env, tasks):
    """A task with the torch variables (a torchrun worker, or srun with one task per GPU and WORLD_SIZE/RANK
    exported by the user's script) joins: nothing is derived or refused."""
    slurm_env(**STEP)
    slurm_env(SLURM_STEP_NUM_TASKS=tasks, SLURM_NTASKS=tasks, WORLD_SIZE="6", RANK="3", LOCAL_RANK="1")
    assert not needs_launch(parse_args([*TASK, "--nproc-per-node", "2"]))


def test_a_bad_srun_is_one_line_exit_2(slurm_env, capsys):
    slurm_env(**{**STEP, "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "6"})
    assert main([*TASK, "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rapidlite: error: srun started 6 tasks on 3 nodes"), err
