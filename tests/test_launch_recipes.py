"""launch/kubernetes-pytorchjob.yaml, checked without a cluster: valid against the Kubeflow training operator's
PyTorchJob v1 fields and webhook rules (launch/schemas/pytorchjob-v1.schema.json), and its command, run with the
variables the operator gives each pod, starts rapidlite as that pod's launcher with the right rendezvous.
(The torchrun recipe's two-"node" run is tests/test_distributed.py::test_two_nodes_on_one_machine; the Slurm
recipe runs under a real Slurm in tests/test_slurm.py.)"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from helpers import REPO
from rapidlite.resolve import parse_args
from rapidlite.runtime.launcher import needs_launch, torchrun_args

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema comes with the [test] extra")

MANIFEST = REPO / "launch" / "kubernetes-pytorchjob.yaml"
SCHEMA = REPO / "launch" / "schemas" / "pytorchjob-v1.schema.json"
OPERATOR_PORT = 23456  # the operator's default for the port named pytorchjob-port


@pytest.fixture(scope="module")
def job() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(validator, document) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_manifest_is_a_valid_pytorchjob(job, validator):
    assert errors(validator, job) == []


def _edit(job, change):
    edited = copy.deepcopy(job)
    change(edited)
    return edited


def _replicas(job):
    return job["spec"]["pytorchReplicaSpecs"]


def _container(job, role="Worker"):
    return _replicas(job)[role]["template"]["spec"]["containers"][0]


MISTAKES = {
    "container not named pytorch": lambda j: _container(j).update(name="trainer"),
    "no image": lambda j: _container(j).pop("image"),
    "two masters": lambda j: _replicas(j)["Master"].update(replicas=2),
    "a replica type the operator lacks": lambda j: _replicas(j).update(Launcher=_replicas(j)["Worker"]),
    "a misspelt spec field": lambda j: j["spec"].update(nprocsPerNode="8"),
    "an unknown restart policy": lambda j: _replicas(j)["Worker"].update(restartPolicy="OnExitCode"),
    "a name that is no DNS-1035 label": lambda j: j["metadata"].update(name="Rapidlite_Pretrain"),
    "a bad nprocPerNode": lambda j: j["spec"].update(nprocPerNode="eight"),
    "nprocPerNode given twice": lambda j: j["spec"].update(elasticPolicy={"nProcPerNode": 8}),
    "elasticPolicy without workers": lambda j: (j["spec"].update(elasticPolicy={}), _replicas(j).pop("Worker")),
    "a bad cleanPodPolicy": lambda j: j["spec"].update(runPolicy={"cleanPodPolicy": "Always"}),
    "the wrong apiVersion": lambda j: j.update(apiVersion="kubeflow.org/v1beta1"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_schema_refuses_what_the_operator_refuses(job, validator, mistake):
    assert errors(validator, _edit(job, MISTAKES[mistake])), mistake


def test_the_operators_own_rules(job):
    """The training operator's webhook rules, stated again in plain code (the schema's are easy to misread)."""
    replicas = _replicas(job)
    assert set(replicas) <= {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1  # the operator refuses any other number of masters
    for role, spec in replicas.items():
        containers = spec["template"]["spec"]["containers"]
        assert "pytorch" in [c["name"] for c in containers], role  # the operator's container is found by name
        assert all(c.get("image") for c in containers), role


def operator_env(job: dict, role: str, index: int) -> dict[str, str]:
    """The variables the training operator (v1.7 and later) sets in a pod's containers: its master's address and
    port, PET_NNODES/PET_NODE_RANK/PET_NPROC_PER_NODE, WORLD_SIZE = pods x nprocPerNode and RANK = the pod's
    index counted from the Master."""
    pods = sum(spec.get("replicas", 1) for spec in _replicas(job).values())
    nproc = job["spec"].get("nprocPerNode", "auto")
    rank = index + (1 if role == "Worker" else 0)
    master = f"{job['metadata']['name']}-master-0"
    return {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(OPERATOR_PORT),
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": str(OPERATOR_PORT),
        "WORLD_SIZE": str(pods * (int(nproc) if nproc.isdigit() else 1)),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NNODES": str(pods),
        "PYTHONUNBUFFERED": "1",
    }


def run_pod_command(job: dict, role: str, index: int, tmp_path) -> tuple[dict[str, str], list[str]]:
    """The container's command and args, run by bash with the operator's variables and a stand-in rapidlite
    that records the environment and arguments it was started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / f"{role}-{index}.json"
    stand_in = bin_dir / "rapidlite"
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'env': dict(os.environ), 'argv': sys.argv[1:]}}, open({str(record)!r}, 'w'))\n"
    )
    stand_in.chmod(0o755)
    container = _container(job, role)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **operator_env(job, role, index)}
    proc = subprocess.run([*container["command"], *container["args"]], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(record.read_text())
    return seen["env"], seen["argv"]


@pytest.mark.parametrize("role", ["Master", "Worker"])
def test_each_pod_runs_rapidlite_as_its_nodes_launcher(job, role, tmp_path, monkeypatch):
    env, argv = run_pod_command(job, role, 0, tmp_path)
    rank = 0 if role == "Master" else 1
    assert (env["NNODES"], env["NODE_RANK"]) == ("2", str(rank))
    assert "WORLD_SIZE" not in env and "RANK" not in env  # else rapidlite would join as one worker
    nproc = job["spec"]["nprocPerNode"]
    assert argv[:2] == ["--nproc-per-node", nproc]
    assert str(_container(job, role)["resources"]["limits"]["nvidia.com/gpu"]) == nproc  # one worker per GPU
    save = argv[argv.index("--save") + 1]
    assert argv[argv.index("--load") + 1] == save  # a replacement pod resumes with the same command
    mounts = [m["mountPath"] for m in _container(job, role)["volumeMounts"]]
    assert any(save.startswith(m.rstrip("/") + "/") for m in mounts), (save, mounts)

    # What rapidlite's launcher makes of that pod: torchrun's agent for 8 local workers of a 2-node job.
    script = tmp_path / "my_trainer.py"
    script.write_text("")
    argv[argv.index("--user-script") + 1] = str(script)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "PET_"))] + ["WORLD_SIZE", "RANK", "LOCAL_RANK"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(name, value)
    config = parse_args(argv, require_task=False)
    assert needs_launch(config)
    assert torchrun_args(config) == [
        f"--nproc-per-node={nproc}",
        "--nnodes=2",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        f"--node-rank={rank}",
        "--master-addr=rapidlite-pretrain-master-0",
        f"--master-port={OPERATOR_PORT}",
    ]


def test_the_command_is_one_shell_line(job):
    """``bash -c`` gets one string; a YAML block that split it into several would run only the first."""
    for role in ("Master", "Worker"):
        container = _container(job, role)
        assert container["command"] == ["bash", "-c"] and len(container["args"]) == 1
        assert shlex.split(container["args"][0])  # balanced quotes
