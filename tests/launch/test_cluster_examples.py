"""The cluster examples (examples/slurm/*.sbatch, examples/kubernetes/*.yaml) checked offline: the scripts parse, the
launch's flags are ones `ndparallel launch` accepts, the script they start exists, srun runs one task per node, and
under the environment the allocation would give, the launch's node settings fit the sizes."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ndparallel.configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from ndparallel.launch.cli import build_parser
from ndparallel.launch.schedulers import place, read_environment

ROOT = Path(__file__).resolve().parents[2]
SBATCH = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
MANIFESTS = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))


def launch_args(command: list[str]):
    """``ndparallel launch ARGS`` within a command: ARGS parsed by the CLI's own parser."""
    start = command.index("ndparallel")
    assert command[start + 1] == "launch", command
    args = build_parser().parse_args(command[start:][1:])
    assert (ROOT / args.script).is_file(), f"{args.script} does not exist"
    return args


def resolved_sizes(args, env: dict[str, str], gpus: int) -> tuple[ParallelismConfig, int, int]:
    """The layout the launch would run under `env`: sizes resolved against nodes x processes per node."""
    placed = place({}, read_environment(env, cpu=bool(args.cpu), gpus=0 if args.cpu else gpus))
    nnodes, nproc = placed.nnodes.value, placed.nproc_per_node.value
    sizes = {name: getattr(args, name) for name in SIZE_FIELDS if getattr(args, name) is not None}
    return ParallelismConfig(**{name: sizes.get(name, 1) for name in SIZE_FIELDS}).resolve(nnodes * nproc), nnodes, \
        nproc


@pytest.mark.parametrize("path", SBATCH, ids=[p.name for p in SBATCH])
def test_sbatch_scripts(path):
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    directives = dict(line.split(None, 1)[1].lstrip("-").split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH "))
    assert directives["ntasks-per-node"] == "1"  # one launch per node: it starts the node's ranks
    srun = [shlex.split(line) for line in text.replace("\\\n", " ").splitlines() if line.startswith("srun ")]
    assert len(srun) == 1, srun
    assert "--ntasks-per-node=1" in srun[0][:srun[0].index("ndparallel")]
    args = launch_args(srun[0])
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc_per_node) == (None,) * 4  # all from SLURM
    nodes, gpus = int(directives["nodes"]), int(directives.get("gpus-per-node", 0))
    assert bool(args.cpu) == (gpus == 0)
    env = {"SLURM_JOB_ID": "900", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": f"node[1-{nodes}]", "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})",
           "SLURM_CPUS_PER_TASK": directives["cpus-per-task"], **({"SLURM_GPUS_ON_NODE": str(gpus)} if gpus else {})}
    pc, nnodes, nproc = resolved_sizes(args, env, gpus)
    assert (nnodes, nproc) == (nodes, gpus or int(directives["cpus-per-task"]))
    assert pc.dp_replicate_size == nodes and pc.dp_shard_size == nproc  # a replica per node, sharded within it


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_pytorchjob_manifests(path):
    job = yaml.safe_load(path.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    pods = sum(spec["replicas"] for spec in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    commands = set()
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # where the operator finds the port and sets the variables
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == nproc
        commands.add(tuple(container["command"]))
    assert len(commands) == 1  # every pod runs the same launch
    args = launch_args(list(commands.pop()))
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc_per_node) == (None,) * 4
    for rank in range(pods):  # what the operator (v1.9) gives each pod
        env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "ndparallel-example-master-0",
               "MASTER_PORT": "23456", "WORLD_SIZE": str(pods * nproc), "RANK": str(rank), "PET_NNODES": str(pods),
               "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": str(nproc)}
        pc, nnodes, found_nproc = resolved_sizes(args, env, nproc)
        assert (nnodes, found_nproc, pc.dp_replicate_size, pc.dp_shard_size) == (pods, nproc, pods, nproc)
