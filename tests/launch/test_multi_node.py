"""Two "nodes" on one host: two `ndparallel launch` processes given the environment SLURM (an srun step, one task per
node) or Kubernetes (a PyTorchJob's two pods) would give them, and no node flags, train the README's example
(examples/nd_parallel.py, HSDP: replicas across the nodes, shards within) to the same losses as one node with the
same world size, exactly; a checkpoint written by such a run resumes on one node exactly.

Every launch has a deadline (its process group is killed past it), and the rendezvous port is one that is free
here: for SLURM, a job id whose port (20000 + id mod 10000) is free; for Kubernetes, MASTER_PORT."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port, run_ranks
from ndparallel.launch.schedulers import SLURM_PORT_BASE, SLURM_PORT_SPAN, is_scheduler_variable

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import nd_parallel  # noqa: E402

_spec = importlib.util.spec_from_file_location("resume_example", EXAMPLES / "resume.py")
resume_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resume_example)

SIZES = {"dp_replicate": 2, "dp_shard": 2}  # the README's example: 4 ranks, 2 nodes x 2
SIZE_FLAGS = ["--dp-replicate-size", "2", "--dp-shard-size", "2"]
# One node with the same world size: 4 ranks forked here with the environment `ndparallel launch` gives them.
ONE_NODE_ENV = {"NDPARALLEL_DP_REPLICATE_SIZE": "2", "NDPARALLEL_DP_SHARD_SIZE": "2", "NDPARALLEL_CPU": "1"}
TRAIN = ["--steps", "3", "--seq-len", "64", "--log-every", "3"]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and signals as on Linux")


def this_host() -> str:
    """This machine's name when it resolves to an address of this machine (as a node's name does), else localhost."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
        with socket.socket() as probe:
            probe.bind((address, 0))
        return name
    except OSError:
        return "localhost"


def slurm_job_id() -> int:
    """A job id whose rendezvous port is free on this machine."""
    for _ in range(200):
        job = random.randrange(10_000, 10_000_000)
        with socket.socket() as probe:
            try:
                probe.bind(("", SLURM_PORT_BASE + job % SLURM_PORT_SPAN))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in the range of SLURM rendezvous ports")


def slurm_node(node: int, job: int, cpus: int) -> dict[str, str]:
    """What srun gives the task of node `node` of a 2-node step with --ntasks-per-node=1 --cpus-per-task=`cpus`."""
    host = this_host()
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": f"{host},{host}",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_CPUS_PER_TASK": str(cpus)}


def pytorchjob_pod(node: int, port: int) -> dict[str, str]:
    """What the Kubeflow training operator (v1.9) gives pod `node` of a PyTorchJob with a Master and one Worker and
    nprocPerNode "2": WORLD_SIZE counts processes there (4), not pods."""
    host = this_host()
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": "4",
            "RANK": str(node), "PET_NNODES": "2", "PET_NODE_RANK": str(node), "PET_NPROC_PER_NODE": "2",
            "PET_MASTER_ADDR": host, "PET_MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}


def launch(node_envs: list[dict[str, str]], args: list[str], logs: Path, timeout: float = 400) -> list[str]:
    """Run one `ndparallel launch` per environment, all at once; return their outputs (asserting they succeeded)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NDPARALLEL_") and not is_scheduler_variable(k)
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"node{i}.log", "w+") for i in range(len(node_envs))]  # noqa: SIM115 - closed below
    procs = [subprocess.Popen([sys.executable, "-m", "ndparallel.cli", "launch", *args], env={**base, **env},
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
             for env, out in zip(node_envs, files)]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:  # hung: the launcher and its ranks are one process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = []
    for proc, out in zip(procs, files):
        out.seek(0)
        outputs.append(out.read())
        out.close()
        assert proc.returncode == 0, f"exit code {proc.returncode}:\n{outputs[-1][-4000:]}"
    return outputs


@pytest.fixture(scope="module")
def one_node_losses() -> list[float]:
    """The example on one node with the same world size (4 ranks, forked here as torchrun would start them)."""
    results = run_ranks(nd_parallel.main, 4, TRAIN, env=ONE_NODE_ENV, timeout=400)
    assert results[0]["world_size"] == 4 and results[0]["layout"] == {**dict.fromkeys(("pp", "tp", "cp", "sp"), 1),
                                                                       **SIZES}
    return results[0]["losses"]


@pytest.mark.slow
def test_two_slurm_nodes_train_as_one_node(tmp_path, one_node_losses):
    job, out = slurm_job_id(), tmp_path / "summary.json"
    args = ["--cpu", "--rdzv-timeout", "120", *SIZE_FLAGS, str(EXAMPLES / "nd_parallel.py"), *TRAIN,
            "--json-out", str(out)]
    logs = launch([slurm_node(0, job, cpus=2), slurm_node(1, job, cpus=2)], args, tmp_path / "logs")
    host = this_host()
    for node, log in enumerate(logs):
        assert (f"ndparallel launch: SLURM job {job}: 2 node(s) (SLURM_NNODES=2), node rank {node} (SLURM_NODEID="
                f"{node}), rendezvous {host}:{SLURM_PORT_BASE + job % SLURM_PORT_SPAN} ({host}: the first host of "
                f"SLURM_JOB_NODELIST={host},{host}; port {SLURM_PORT_BASE + job % SLURM_PORT_SPAN}: 20000 + "
                f"SLURM_JOB_ID mod 10000), rdzv id slurm-{job} (SLURM_JOB_ID={job}), 2 process(es) per node "
                "(SLURM_CPUS_PER_TASK=2: one process per CPU asked, on CPU)") in log, log[-3000:]
        assert "ndparallel launch: 4 process(es) = 2 node(s) x 2, sizes dp_replicate(2) * dp_shard(2) = 4" in log
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 4 and summary["layout"]["dp_replicate"] == 2
    # The same ranks doing the same arithmetic in the same order (gloo's all-reduce over 2 and 4 ranks does not
    # depend on which process started them): equal bit for bit.
    assert summary["losses"] == one_node_losses


@pytest.mark.slow
def test_two_kubernetes_pods_train_as_one_node(tmp_path, one_node_losses):
    port, out = free_port(), tmp_path / "summary.json"
    args = ["--cpu", "--rdzv-timeout", "120", *SIZE_FLAGS, str(EXAMPLES / "nd_parallel.py"), *TRAIN,
            "--json-out", str(out)]
    logs = launch([pytorchjob_pod(0, port), pytorchjob_pod(1, port)], args, tmp_path / "logs")
    for node, log in enumerate(logs):
        assert (f"ndparallel launch: Kubernetes (PyTorchJob): 2 node(s) (PET_NNODES=2), node rank {node} "
                f"(PET_NODE_RANK={node}), rendezvous {this_host()}:{port}") in log, log[-3000:]
        assert "2 process(es) per node (PET_NPROC_PER_NODE=2)" in log
        assert "ndparallel launch: 4 process(es) = 2 node(s) x 2, sizes dp_replicate(2) * dp_shard(2) = 4" in log
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 4 and summary["losses"] == one_node_losses


@pytest.mark.slow
def test_a_two_node_checkpoint_resumes_exactly_on_one_node(tmp_path):
    """examples/resume.py on 2 SLURM nodes saves after steps 2 and 4; the step-4 checkpoint is removed, and one node
    (4 ranks, the same layout, forked here) resumes from step 2: its steps 3 and 4 are the 2-node run's, bit for
    bit."""
    project, job = tmp_path / "run", slurm_job_id()
    train = ["--project-dir", str(project), "--steps", "4", "--checkpoint-every", "2", "--seq-len", "64"]
    resume = str(EXAMPLES / "resume.py")
    logs = launch([slurm_node(node, job, cpus=2) for node in (0, 1)],
                  ["--cpu", "--rdzv-timeout", "120", *SIZE_FLAGS, resume, *train, "--json-out",
                   str(tmp_path / "a.json")], tmp_path / "two_nodes")
    assert all("ndparallel launch: 4 process(es) = 2 node(s) x 2, " in log for log in logs), logs[0][-3000:]
    two_nodes = json.loads((tmp_path / "a.json").read_text())
    assert two_nodes["world_size"] == 4 and sorted(two_nodes["losses"]) == ["1", "2", "3", "4"]
    checkpoints = project / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    shutil.rmtree(checkpoints / "checkpoint_1")
    one_node = run_ranks(resume_example.main, 4, train, env=ONE_NODE_ENV, timeout=400)[0]
    assert one_node["resumed_from"] == str(checkpoints / "checkpoint_0")
    assert one_node["losses"] == {step: two_nodes["losses"][str(step)] for step in (3, 4)}
