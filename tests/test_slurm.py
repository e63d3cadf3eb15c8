"""``launch/slurm.sbatch`` under a real Slurm: a private one-node cluster (munged, slurmctld, slurmd) is started
in a temporary directory, the recipe is submitted with sbatch and trains two ranks; a job signalled with USR1
(what ``--signal=B:USR1@120`` sends before the time limit) saves, requeues itself and its second attempt
resumes from the checkpoint and completes. Marked ``slurm``; skipped with the reason when Slurm and munge are
not installed or the daemons cannot start (they run as root here: SlurmUser=root). Nothing is installed and
nothing outside the temporary directory is touched; the daemons are stopped at the end, also on failure.

Debian: ``apt-get install slurm-wlm munge``, then ``python -m pytest -m slurm tests/test_slurm.py``."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, write_tiny_corpus
from rapidlite.runtime.distributed import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # slow too: the fast set stays fast where Slurm is installed

PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
# The brief's tiny GPT on a tiny corpus (2 ranks x micro 2 x accumulation 2 = global 8).
TINY = ["--task", "pretraining", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "2"]
TINY += ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"]
TINY += ["--global-batch-size", "8", "--log-interval", "1"]

CONF = """\
ClusterName=rapidlite-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# A private munged; cred_expire also sets how long a requeued job waits before it may start again (120 s).
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=3600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """The private cluster: its clients' environment, and the jobs submitted to it (cancelled at the end)."""

    def __init__(self, root: Path, host: str, cpus: int) -> None:
        self.root, self.host, self.cpus = root, host, cpus
        self.jobs: list[str] = []
        bin_dir = root / "bin"
        bin_dir.mkdir()
        # `rapidlite` in the job is this checkout's, run by this interpreter.
        (bin_dir / "rapidlite").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rapidlite "$@"\n')
        (bin_dir / "rapidlite").chmod(0o755)
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env = {
            **inherited,
            "SLURM_CONF": str(root / "slurm.conf"),
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",  # the job's log is read while it runs
            "OMP_NUM_THREADS": "1",
        }

    def command(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stdout}{proc.stderr}"
        return proc

    def submit(self, log: Path, *argv: str, env: dict[str, str] | None = None) -> str:
        """sbatch ARGV with the job's output in ``log``; the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={log}", f"--chdir={log.parent}", *argv],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str, check: bool = True) -> dict[str, str]:
        """``scontrol show job`` as a dict (the controller keeps finished jobs for MinJobAge; no accounting)."""
        out = self.command("scontrol", "--oneliner", "show", "job", job, check=check).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def cancel_all(self) -> None:
        """A failed test's jobs, stopped before the daemons (their processes would outlive slurmd)."""
        if not self.jobs:
            return
        self.command("scancel", *self.jobs, check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(self.job(j, check=False).get("JobState", "COMPLETED") in FINISHED for j in self.jobs):
                return
            time.sleep(1)

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (state := self.job(job))["JobState"] not in FINISHED:
            assert time.monotonic() < deadline, f"job {job} still {state['JobState']} after {timeout} s"
            time.sleep(1)
        return state

    def recipe(self, log: Path, *argv: str) -> str:
        """launch/slurm.sbatch on this CPU node: its GPUs and CPUs overridden on sbatch's command line, two
        workers from NPROC_PER_NODE."""
        resources = ["--gpus-per-node=0", f"--cpus-per-task={self.cpus}"]
        return self.submit(log, *resources, str(REPO / "launch" / "slurm.sbatch"), *argv, env={"NPROC_PER_NODE": "2"})


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no output)"


def _start(argv: list[str], out: Path) -> subprocess.Popen:
    with out.open("w") as sink:
        return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm and munge are not installed ({', '.join(missing)} not on PATH)")
    if os.geteuid() != 0:
        pytest.skip("the private Slurm runs its daemons as root (SlurmUser=root): run the test as root")
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    ctld_port = free_port()
    slurmd_port = free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(
        CONF.format(root=root, host=host, cpus=cpus, ctld_port=ctld_port, slurmd_port=slurmd_port)
    )
    cluster = Cluster(root, host, cpus)
    munge = root / "munge"
    daemons = {}
    try:
        daemons["munged"] = _start(
            ["munged", "--foreground", "--force", f"--socket={munge}/munge.socket", f"--key-file={key}"]
            + [f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed", f"--log-file={munge}/log"],
            root / "munged.out",
        )
        _wait_until(lambda: cluster.command("munge", "-n", "-S", f"{munge}/munge.socket", check=False).returncode == 0)
        conf = str(root / "slurm.conf")
        daemons["slurmctld"] = _start(["slurmctld", "-D", "-f", conf], root / "slurmctld.out")
        daemons["slurmd"] = _start(["slurmd", "-D", "-f", conf, "-N", host], root / "slurmd.out")
        _wait_until(lambda: "State=IDLE" in cluster.command("scontrol", "show", "node", host, check=False).stdout)
    except _NotStarted:
        dead = {name: proc.poll() for name, proc in daemons.items() if proc.poll() is not None}
        logs = "; ".join(f"{name}: {_tail(root / f'{name}.out', 3)}" for name in daemons)
        for proc in daemons.values():
            _stop(proc)
        pytest.skip(f"the private Slurm did not start (exited: {dead or 'none'}) {logs}")
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            _stop(daemons[name])


class _NotStarted(Exception):
    pass


def _wait_until(ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise _NotStarted
        time.sleep(0.5)


def _corpus(tmp_path: Path) -> list[str]:
    prefix = tmp_path / "tiny_text_document"
    write_tiny_corpus(prefix)
    return ["--data-path", str(prefix)]


def test_the_recipe_trains_two_ranks(cluster, tmp_path):
    save, log = tmp_path / "run", tmp_path / "job.out"
    job = cluster.recipe(log, *TINY, *_corpus(tmp_path), "--train-iters", "6", "--save", str(save), "--load", str(save))
    state = cluster.wait(job, timeout=600)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "0"), _tail(log, 40)
    assert f"rapidlite: job {job} attempt 1" in text
    assert "data-parallel 2 = global batch 8" in text  # NPROC_PER_NODE=2 reached rapidlite through sbatch and srun
    assert re.search(r"^\[rapidlite\] iteration: 6 \|", text, re.M), text
    assert (save / "latest").read_text().strip() == "6"
    assert state["TresPerNode"] == "gres:gpu:0" and state["NumCPUs"] == str(cluster.cpus)  # the overrides


def test_a_signalled_job_saves_and_its_requeued_run_resumes(cluster, tmp_path):
    """USR1 to the batch script (``scancel --batch --signal=USR1``, as ``--signal=B:USR1@120`` sends it): the
    recipe passes it on, rapidlite saves and exits 143, the recipe requeues the job, and the second attempt of
    the same command resumes from that checkpoint and finishes."""
    save, log = tmp_path / "run", tmp_path / "job.out"
    iters = 300
    job = cluster.recipe(
        log, *TINY, *_corpus(tmp_path), "--train-iters", str(iters), "--save", str(save), "--load", str(save)
    )
    deadline = time.monotonic() + 600
    while not (log.exists() and re.search(r"^\[rapidlite\] iteration: 5 \|", log.read_text(), re.M)):
        assert cluster.job(job)["JobState"] not in FINISHED, _tail(log, 40)
        assert time.monotonic() < deadline, _tail(log, 40)
        time.sleep(0.1)
    cluster.command("scancel", "--batch", "--signal=USR1", job)
    state = cluster.wait(job, timeout=900)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), _tail(log, 40)
    stopped = re.search(rf"SIGUSR1: stopped after iteration (\d+) of {iters} and saved a checkpoint", text)
    assert stopped, text
    saved = int(stopped.group(1))
    assert 5 <= saved < iters
    first, second = text.split(f"rapidlite: job {job} attempt 2\n")
    assert f"rapidlite: job {job} attempt 1" in first and f"requeueing job {job}" in first
    assert f"saved checkpoint {save}/iter_{saved:07d}" in first
    assert f"resumed from {save} at iteration {saved}" in second
    resumed = [int(n) for n in re.findall(r"^\[rapidlite\] iteration: (\d+) \|", second, re.M)]
    assert resumed == list(range(saved + 1, iters + 1))
    assert (save / "latest").read_text().strip() == str(iters)


def test_srun_tasks_carry_what_rapidlite_reads(cluster, tmp_path):
    """The batch script has the job's variables but no step (rapidlite derives nothing there); an srun task has
    the step's: the names rapidlite.runtime.slurm reads, with this node as the first host of the step's list."""
    probe = (
        f'"{sys.executable}" -c "import json, os; from rapidlite.runtime.slurm import rendezvous; '
        "print(json.dumps({'env': {k: v for k, v in os.environ.items() if k.startswith('SLURM_')}, "
        "'derived': rendezvous(os.environ)}))\""
    )
    log = tmp_path / "probe.out"
    job = cluster.submit(log, f"--wrap={probe}; srun {probe}")
    state = cluster.wait(job, timeout=120)
    assert state["JobState"] == "COMPLETED", _tail(log)
    batch, task = (json.loads(line) for line in log.read_text().splitlines())
    assert "SLURM_STEP_ID" not in batch["env"] and batch["derived"] == {}
    env = task["env"]
    assert env["SLURM_STEP_ID"] == "0" and env["SLURM_JOB_ID"] == job
    assert (env["SLURM_NODEID"], env["SLURM_STEP_NUM_NODES"], env["SLURM_STEP_NUM_TASKS"]) == ("0", "1", "1")
    assert env["SLURM_STEP_NODELIST"] == cluster.host
    assert task["derived"] == {}  # one node: the launcher's private rendezvous
