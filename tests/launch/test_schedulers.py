"""`ndparallel launch` under SLURM and Kubernetes, without processes: SLURM's host lists expanded, each environment
read into the launch's node settings with their sources, flags over them, and what cannot work refused with the fix
before any rank starts (ndparallel.launch.schedulers). The launches themselves: test_multi_node.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ndparallel.launch import schedulers
from ndparallel.launch.cli import build_parser, main
from ndparallel.launch.launcher import plan_launch
from ndparallel.launch.schedulers import Found, expand_nodelist, place, read_environment

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "print_env_launch.py")


# ---- SLURM's host lists ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("node7", ["node7"]),
    ("gpu-a.cluster.org", ["gpu-a.cluster.org"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),  # the padding of the first number, across 9 -> 10
    ("node[9-11]", ["node9", "node10", "node11"]),  # no padding
    ("a[1-2],b[10-11],c", ["a1", "a2", "b10", "b11", "c"]),  # several groups
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # two bracket groups in one name
    ("node[5]", ["node5"]),
    (" x1 ,x2 ", ["x1", "x2"]),
])
def test_nodelist_expansion(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("node[3-1]", "range '3-1' in 'node[3-1]' runs backwards"),
    ("node[1-2", "unbalanced '[' in 'node[1-2'"),
    ("node1-2]", "unbalanced ']'"),
    ("node[a-b]", "'a-b' in 'node[a-b]' is not a number or a range LOW-HIGH"),
    ("a,,b", "empty host name in 'a,,b'"),
    ("", "empty host name"),
    ("n[[1]]", "nested brackets"),
])
def test_nodelist_refusals(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_nodelist(text)


# ---- environments in, settings and sources out ----------------------------------------------------------------------
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
        "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_LOCALID": "0"}


def settings(found) -> dict:
    """The values of an Environment (or Placement) that are set, as {key: (value, source)}."""
    keys = ("nnodes", "node_rank", "host", "port", "endpoint", "rdzv_backend", "rdzv_id", "nproc_per_node",
            "max_restarts")
    return {key: (getattr(found, key).value, getattr(found, key).source) for key in keys
            if getattr(found, key, None) is not None}


@pytest.mark.parametrize("env, kwargs, expected", [
    # an srun step on GPU nodes: the first node of the step, a port from the job id, the GPUs of the node
    ({**STEP, "SLURM_GPUS_ON_NODE": "4"}, dict(gpus=4), {
        "nnodes": (2, "SLURM_STEP_NUM_NODES=2"), "node_rank": (1, "SLURM_NODEID=1"),
        "host": ("gpu07", "the first host of SLURM_STEP_NODELIST=gpu[07-08]"),
        "port": (24242, "20000 + SLURM_JOB_ID mod 10000"), "rdzv_id": ("slurm-4242", "SLURM_JOB_ID=4242"),
        "nproc_per_node": (4, "SLURM_GPUS_ON_NODE=4: the node's GPUs")}),
    # GPUs counted from the device list when SLURM_GPUS_ON_NODE is missing; MASTER_ADDR / MASTER_PORT win
    ({**STEP, "CUDA_VISIBLE_DEVICES": "0,1,2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "31000"}, dict(gpus=3), {
        "nnodes": (2, "SLURM_STEP_NUM_NODES=2"), "node_rank": (1, "SLURM_NODEID=1"),
        "host": ("10.0.0.7", "MASTER_ADDR=10.0.0.7"), "port": (31000, "MASTER_PORT=31000"),
        "rdzv_id": ("slurm-4242", "SLURM_JOB_ID=4242"),
        "nproc_per_node": (3, "CUDA_VISIBLE_DEVICES=0,1,2: the node's GPUs")}),
    # nothing in the allocation about GPUs: the GPUs torch sees
    (STEP, dict(gpus=2), {"nproc_per_node": (2, "the GPUs torch sees on the node")}),
    # CPU nodes: the CPUs asked; the job's nodelist when the step's is missing
    ({**{k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}, "SLURM_JOB_NODELIST": "cpu[1-2]",
      "SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_ON_NODE": "4"}, dict(cpu=True, gpus=0), {
        "host": ("cpu1", "the first host of SLURM_JOB_NODELIST=cpu[1-2]"),
        "nproc_per_node": (8, "SLURM_CPUS_PER_TASK=8: one process per CPU asked, on CPU")}),
    # CPU without --cpus-per-task: nothing said (the launch's default applies)
    (STEP, dict(cpu=True), {"nproc_per_node": None}),
    # the batch script of a one-node job (no srun): one node, no rendezvous
    ({"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1",
      "SLURM_TASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "2"}, dict(cpu=True),
     {"nnodes": (1, "SLURM_NNODES=1"), "nproc_per_node": (2, "SLURM_CPUS_PER_TASK=2: one process per CPU asked, on "
                                                                "CPU"), "host": None, "node_rank": None}),
])
def test_slurm_environments(env, kwargs, expected):
    found = settings(read_environment(env, **kwargs))
    for key, value in expected.items():
        assert found.get(key) == value, (key, found)


POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


@pytest.mark.parametrize("env, kwargs, expected", [
    # the training operator before v1.7: WORLD_SIZE and RANK count pods
    ({**POD, "WORLD_SIZE": "3", "RANK": "2"}, dict(gpus=8), {
        "nnodes": (3, "WORLD_SIZE=3: the PyTorchJob's pods"), "node_rank": (2, "RANK=2: the pod's index"),
        "host": ("job-master-0", "MASTER_ADDR=job-master-0"), "port": (23456, "MASTER_PORT=23456"),
        "nproc_per_node": (8, "the GPUs torch sees on the node")}),
    # v1.7 and later: WORLD_SIZE = pods x nprocPerNode (16 here) is not read; PET_* are
    ({**POD, "WORLD_SIZE": "16", "RANK": "1", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "8",
      "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}, dict(gpus=8), {
        "nnodes": (2, "PET_NNODES=2"), "node_rank": (1, "PET_NODE_RANK=1"),
        "host": ("job-master-0", "PET_MASTER_ADDR=job-master-0"), "port": (23456, "PET_MASTER_PORT=23456"),
        "nproc_per_node": (8, "PET_NPROC_PER_NODE=8")}),
    # Kubeflow Trainer v2 (TrainJob): PET_* only, nprocPerNode "auto" -- GPUs, or on the CPU the CPUs, as torchrun
    ({"KUBERNETES_SERVICE_HOST": "h", "PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "auto",
      "PET_MASTER_ADDR": "t-trainer-node-0-0.t", "PET_MASTER_PORT": "29400"}, dict(gpus=4), {
        "nproc_per_node": (4, "PET_NPROC_PER_NODE=auto: the GPUs torch sees")}),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "auto", "PET_MASTER_ADDR": "h"},
     dict(cpu=True, cpus=6), {"nproc_per_node": (6, "PET_NPROC_PER_NODE=auto: the CPUs this process may use, as "
                                                    "torchrun counts them"),
                              "port": (29500, "torchrun's default, no PET_MASTER_PORT")}),
    # an elastic policy: the c10d rendezvous at its endpoint, N:N nodes, restarts, the operator's older nproc name
    ({"KUBERNETES_SERVICE_HOST": "h", "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
      "PET_NNODES": "2:2", "PET_MAX_RESTARTS": "3", "PET_RDZV_ID": "run7", "PET_N_PROC_PER_NODE": "2"}, {}, {
        "nnodes": (2, "PET_NNODES=2:2"), "rdzv_backend": ("c10d", "PET_RDZV_BACKEND=c10d"),
        "host": ("job-worker-0", "PET_RDZV_ENDPOINT=job-worker-0:23456"), "rdzv_id": ("run7", "PET_RDZV_ID=run7"),
        "max_restarts": (3, "PET_MAX_RESTARTS=3"), "nproc_per_node": (2, "PET_N_PROC_PER_NODE=2")}),
    # anything else that sets MASTER_ADDR / MASTER_PORT / NODE_RANK (and the node count)
    ({"MASTER_ADDR": "head", "MASTER_PORT": "6000", "NODE_RANK": "1", "PET_NNODES": "2"}, dict(cpu=True), {
        "nnodes": (2, "PET_NNODES=2"), "node_rank": (1, "NODE_RANK=1"), "host": ("head", "MASTER_ADDR=head"),
        "port": (6000, "MASTER_PORT=6000"), "nproc_per_node": None}),
])
def test_kubernetes_environments(env, kwargs, expected):
    found = settings(read_environment(env, **kwargs))
    for key, value in expected.items():
        assert found.get(key) == value, (key, found)


@pytest.mark.parametrize("env", [
    {},
    {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},  # a shell's leftovers: no scheduler
    # a torchrun worker inside a pod (it is a rank, not a pod's entry): WORLD_SIZE / RANK are processes
    {**POD, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"},
    {**POD, "WORLD_SIZE": "4", "RANK": "3", "TORCHELASTIC_RUN_ID": "r"},
])
def test_no_scheduler(env):
    assert read_environment(env) is None


def test_scheduler_choice():
    both = {**STEP, "NODE_RANK": "1", "PET_NNODES": "2", "SLURM_CPUS_PER_TASK": "2"}
    assert read_environment(both, cpu=True).name == "SLURM job 4242"  # they agree: SLURM's
    assert read_environment(both, "kubernetes", cpu=True).name == "torchrun's variables"
    assert read_environment(both, "none") is None
    with pytest.raises(ValueError, match=r"SLURM job 4242 and torchrun's variables disagree on the node rank: 1 "
                                         r"\(SLURM_NODEID=1\) vs 0 \(NODE_RANK=0\); choose with --scheduler slurm"):
        read_environment({**both, "NODE_RANK": "0"}, cpu=True)
    with pytest.raises(ValueError, match="--scheduler slurm: no SLURM job here"):
        read_environment({"PET_NNODES": "2"}, "slurm")
    with pytest.raises(ValueError, match="--scheduler kubernetes: none of PET_NNODES"):
        read_environment(STEP, "kubernetes")


# ---- refusals -------------------------------------------------------------------------------------------------------
FIX = r"run one task per node: `srun --ntasks-per-node=1 ndparallel launch \.\.\.`"


@pytest.mark.parametrize("env, kwargs, message", [
    # srun with one task per GPU: every task would start a whole node's ranks
    ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, {},
     r"SLURM job 4242: srun starts 4 tasks on a node \(SLURM_STEP_TASKS_PER_NODE=4\(x2\)\), and every task would "
     r"start a whole node's ranks; " + FIX),
    ({**{k: v for k, v in STEP.items() if k != "SLURM_STEP_TASKS_PER_NODE"}, "SLURM_NTASKS_PER_NODE": "8"}, {},
     r"srun starts 8 tasks on a node \(SLURM_NTASKS_PER_NODE=8\)"),
    ({**{k: v for k, v in STEP.items() if k != "SLURM_STEP_TASKS_PER_NODE"}, "SLURM_NTASKS": "16"}, {},
     r"srun starts 16 tasks \(SLURM_NTASKS\) on 2 node\(s\)"),
    ({**STEP, "SLURM_LOCALID": "3"}, {}, r"this is task 3 on its node \(SLURM_LOCALID=3\): srun started more than one "
                                         "task on a node; " + FIX),
    # the batch script of a multi-node job running the launch itself
    ({k: v for k, v in STEP.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES")}, {},
     r"SLURM job 4242 has 2 nodes \(SLURM_NNODES=2\) but this is not an srun step \(no SLURM_STEP_ID\): started by "
     r"the batch script itself, ndparallel launch runs on the first node only. Start it on every node: `srun "
     r"--ntasks-per-node=1 ndparallel launch \.\.\.`"),
    # missing or invalid variables
    ({k: v for k, v in STEP.items() if k != "SLURM_NODEID"}, {}, "SLURM_NODEID is not set in this srun step: give "
                                                                 "--node-rank"),
    ({**STEP, "SLURM_NODEID": "one"}, {}, "SLURM_NODEID='one' is not an integer"),
    ({**STEP, "SLURM_STEP_NUM_NODES": "0"}, {}, "SLURM_STEP_NUM_NODES='0' must be >= 1"),
    ({**STEP, "SLURM_STEP_NODELIST": "gpu[07-09]"}, {},
     r"SLURM_STEP_NODELIST=gpu\[07-09\] names 3 host\(s\), but the step has 2 node\(s\) \(SLURM_STEP_NUM_NODES=2\); "
     "set MASTER_ADDR to the step's first node, or give --rdzv-endpoint HOST:PORT"),
    ({**STEP, "SLURM_STEP_NODELIST": "gpu[07-"}, {}, r"cannot read SLURM_STEP_NODELIST: unbalanced '\['"),
    ({**STEP, "MASTER_PORT": "70000"}, {}, r"MASTER_PORT='70000' is not a port in 1..65535"),
    ({**STEP, "SLURM_GPUS_ON_NODE": "8"}, dict(gpus=4),
     r"SLURM_GPUS_ON_NODE=8, but torch sees 4 GPU\(s\) on this node \(CUDA_VISIBLE_DEVICES\?\): give "
     "--nproc-per-node"),
    ({**STEP, "SLURM_GPUS_ON_NODE": "0"}, dict(gpus=2),
     r"SLURM_GPUS_ON_NODE=0: this step has no GPUs, but torch sees 2: give --cpu to run on the CPU, or ask for GPUs"),
    ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0"}, {},
     "PET_NNODES=1:4 is an elastic range of nodes; ndparallel needs a fixed node count"),
    ({"PET_NNODES": "2", "PET_RDZV_BACKEND": "etcd", "PET_RDZV_ENDPOINT": "e:2379"}, {},
     "PET_RDZV_BACKEND=etcd: ndparallel launch meets with the static or the c10d rendezvous"),
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "gpu"}, dict(cpu=True), "PET_NPROC_PER_NODE=gpu, but this launch runs "
                                                                       "on the CPU"),
    ({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "many"}, {}, "PET_NPROC_PER_NODE='many' is not a number of processes"),
    ({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "noport"}, {}, "PET_RDZV_ENDPOINT='noport' is not HOST:PORT"),
])
def test_what_cannot_work_is_refused_with_the_fix(env, kwargs, message):
    with pytest.raises(ValueError, match=message):
        read_environment(env, **kwargs)


# ---- flags over the environment -------------------------------------------------------------------------------------
def test_flags_win_and_a_node_count_other_than_the_schedulers_is_refused():
    env = read_environment({**STEP, "SLURM_CPUS_PER_TASK": "4"}, cpu=True)
    placed = place({"node_rank": Found(0, "--node-rank"), "rdzv_endpoint": Found("10.1.1.1:5000", "--rdzv-endpoint"),
                    "nproc_per_node": Found(2, "--nproc-per-node"), "rdzv_id": None}, env)
    assert settings(placed) == {
        "nnodes": (2, "SLURM_STEP_NUM_NODES=2"), "node_rank": (0, "--node-rank"),
        "endpoint": ("10.1.1.1:5000", "--rdzv-endpoint"), "rdzv_backend": ("static", "default"),
        "rdzv_id": ("slurm-4242", "SLURM_JOB_ID=4242"), "nproc_per_node": (2, "--nproc-per-node"),
        "max_restarts": (0, "default")}
    assert place({"nnodes": Found(2, "--nnodes")}, env).nnodes == Found(2, "--nnodes")  # the same count: fine
    with pytest.raises(ValueError, match=re.escape(
            "4 node(s) (--nnodes) disagrees with SLURM job 4242: 2 node(s) (SLURM_STEP_NUM_NODES=2), which starts one "
            "ndparallel launch on each of its nodes, so 4 node(s) would never meet: leave the node count out of "
            "--nnodes, ask the scheduler for 4 node(s), or ignore it with --scheduler none")):
        place({"nnodes": Found(4, "--nnodes")}, env)
    one = read_environment({"PET_NNODES": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert place({}, one).endpoint is None  # one node: a free local port, not the pod's master port


# ---- through the launch: the sources line, and refusals before any rank starts --------------------------------------
@pytest.fixture
def scheduler_env(monkeypatch):
    def set_env(env: dict[str, str]) -> None:
        for name in list(os.environ):
            if schedulers.is_scheduler_variable(name) or name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_the_launch_says_where_each_value_came_from(scheduler_env):
    scheduler_env({**STEP, "SLURM_CPUS_PER_TASK": "2"})
    plan = plan_launch(build_parser().parse_args(["launch", "--cpu", "--dp-replicate-size", "2", "--dp-shard-size",
                                                  "-1", SCRIPT]))
    assert plan.origin == (
        "ndparallel launch: SLURM job 4242: 2 node(s) (SLURM_STEP_NUM_NODES=2), node rank 1 (SLURM_NODEID=1), "
        "rendezvous gpu07:24242 (gpu07: the first host of SLURM_STEP_NODELIST=gpu[07-08]; port 24242: 20000 + "
        "SLURM_JOB_ID mod 10000), rdzv id slurm-4242 (SLURM_JOB_ID=4242), 2 process(es) per node "
        "(SLURM_CPUS_PER_TASK=2: one process per CPU asked, on CPU)")
    assert (plan.nnodes, plan.nproc_per_node, plan.env["NDPARALLEL_DP_SHARD_SIZE"]) == (2, 2, "2")
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=gpu07", "--master-port=24242"} <= set(plan.torchrun_args)
    assert (plan.rendezvous.nnodes, plan.rendezvous.node_rank, plan.rendezvous.run_id) == (2, 1, "slurm-4242")
    # no scheduler: no line, the launch as before
    scheduler_env({})
    assert plan_launch(build_parser().parse_args(["launch", "--nproc-per-node", "2", SCRIPT])).origin is None


def test_a_node_count_that_disagrees_with_the_sizes_is_refused(scheduler_env, capsys, monkeypatch):
    monkeypatch.setattr("ndparallel.launch.launcher.run_plan", lambda plan: pytest.fail("a rank was started"))
    scheduler_env({**STEP, "SLURM_CPUS_PER_TASK": "2"})
    assert main(["launch", "--cpu", "--dp-replicate-size", "2", "--dp-shard-size", "4", SCRIPT]) == 2
    assert ("ndparallel launch: error: dp_replicate(2) * dp_shard(4) = 8 != world size 4 = 2 node(s) "
            "(SLURM_STEP_NUM_NODES=2) x 2 process(es) per node (SLURM_CPUS_PER_TASK=2: one process per CPU asked, on "
            "CPU). Set one size to -1 to give it the ranks that are left, or launch with 8 processes in all. Change "
            "the sizes, or the nodes or GPUs / CPUs the job asks for, or give --nproc-per-node.") \
        in capsys.readouterr().err
    assert main(["launch", "--cpu", "--node-rank", "5", SCRIPT]) == 2
    assert ("error: node rank 5 (--node-rank) must be in 0..1 for 2 node(s) (SLURM_STEP_NUM_NODES=2)"
            in capsys.readouterr().err)
    scheduler_env({**STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    assert main(["launch", "--cpu", SCRIPT]) == 2
    assert "srun starts 2 tasks on a node" in capsys.readouterr().err
    # --scheduler none: the launch as without SLURM (one node, the flags' settings)
    assert plan_launch(build_parser().parse_args(["launch", "--scheduler", "none", "--nproc-per-node", "2",
                                                  SCRIPT])).nnodes == 1


def test_without_nproc_from_the_scheduler_the_sizes_are_spread_over_the_nodes(scheduler_env):
    scheduler_env({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1"})
    plan = plan_launch(build_parser().parse_args(["launch", "--cpu", "--dp-replicate-size", "2", "--dp-shard-size",
                                                  "2", SCRIPT]))
    assert plan.nproc_per_node == 2
    assert plan.origin.endswith("2 process(es) per node (the sizes' product over the nodes)")
    assert "--master-port=29500" in plan.torchrun_args


def test_torchrun_reads_only_the_launchs_flags(monkeypatch):
    """torchrun's parser takes PET_<FLAG> as each flag's default: a pod's PET_STANDALONE ("" under an elastic policy)
    breaks it, PET_MODULE would run the worker as a module; hidden while the launch's flags are parsed."""
    from torch.distributed.run import parse_args

    monkeypatch.setenv("PET_STANDALONE", "")
    monkeypatch.setenv("PET_MODULE", "1")
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=5")
    flags = ["--nnodes=1", "--nproc-per-node=1", "--standalone", "worker.py"]
    with pytest.raises(ValueError):
        parse_args(flags)  # what the launch would meet without hiding them
    with schedulers.torchrun_flags_only():
        parsed = parse_args(flags)
    assert (parsed.module, parsed.rdzv_conf) == (False, "")
    assert os.environ["PET_MODULE"] == "1"  # back afterwards


def test_config_files_under_a_scheduler(scheduler_env, tmp_path):
    """A file serves every node: its node count must be the scheduler's; its node rank (``accelerate config`` always
    writes one) yields to the scheduler's, with a warning."""
    import yaml

    scheduler_env({**STEP, "SLURM_CPUS_PER_TASK": "2"})
    ours = tmp_path / "ndparallel.yaml"
    ours.write_text(yaml.safe_dump({"launch": {"nproc_per_node": 2, "nnodes": 1, "cpu": True}}))  # `config`'s default
    with pytest.raises(ValueError, match=re.escape(f"1 node(s) (--config-file {ours}) disagrees with SLURM job 4242")):
        plan_launch(build_parser().parse_args(["launch", "--config-file", str(ours), SCRIPT]))
    theirs = tmp_path / "accelerate.yaml"
    theirs.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                      "num_machines": 2, "machine_rank": 0, "num_processes": 4, "use_cpu": True}))
    plan = plan_launch(build_parser().parse_args(["launch", "--config-file", str(theirs), SCRIPT]))
    assert (plan.rendezvous.node_rank, plan.nproc_per_node) == (1, 2)  # SLURM_NODEID; 4 processes over 2 nodes
    assert f"node rank 0 of --config-file {theirs} is not used: one file serves every node, SLURM job 4242 gives " \
           "this one 1 (SLURM_NODEID=1)" in plan.warnings
    assert "process(es) per node (--num-processes 4 / 2 node(s))" in plan.origin
    # a flag still wins
    assert plan_launch(build_parser().parse_args(["launch", "--config-file", str(theirs), "--node-rank", "0",
                                                  SCRIPT])).rendezvous.node_rank == 0
