"""Where ``ndparallel launch`` runs: a SLURM job step, a Kubernetes PyTorchJob, or anything that sets torchrun's
``PET_*`` variables (or ``MASTER_ADDR`` / ``MASTER_PORT`` / ``NODE_RANK``). `read_environment` turns such an
environment into the launch's node count, this node's rank, the rendezvous endpoint and id and the processes per node,
each with where it came from; `place` puts the flags (and the config file) over them -- flags win -- and refuses
what cannot work, before any rank starts. The engine stays torchrun's rendezvous: this only fills its flags.

SLURM (``srun ndparallel launch ...``, one task per node, inside an ``sbatch`` / ``salloc`` allocation):

- nodes: ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``); this node: ``SLURM_NODEID``;
- rendezvous: ``MASTER_ADDR``, else the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST`` /
  ``SLURM_NODELIST``; compressed lists expanded by `expand_nodelist`), port ``MASTER_PORT``, else
  20000 + ``SLURM_JOB_ID`` mod 10000 (every node computes the same, two jobs rarely share one); id ``slurm-<job id>``;
- processes per node: the GPUs of the node (``SLURM_GPUS_ON_NODE``, else ``CUDA_VISIBLE_DEVICES`` /
  ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``, else the GPUs torch sees), on CPU (``--cpu``, or no CUDA) the CPUs asked
  (``SLURM_CPUS_PER_TASK``), else none (the launch's default: the sizes' product over the nodes, or 1);
- refused: more than one task on a node (each would start the node's ranks), a batch script of a multi-node job
  running the launch itself instead of ``srun`` (it would run on the first node only), a nodelist that does not name
  the step's nodes, a GPU count above what torch sees (or 0 while torch sees GPUs, without ``--cpu``).

torchrun's variables (the Kubeflow training operator's PyTorchJob sets them; its Trainer v2 too):

- nodes: ``PET_NNODES`` (``N``, or ``N:N``; an elastic range ``MIN:MAX`` is refused: the sizes need a fixed world),
  else, in a PyTorchJob pod of an operator before v1.7 (``KUBERNETES_SERVICE_HOST``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, and none of a torchrun worker's ``LOCAL_RANK`` / ``GROUP_RANK`` /
  ``TORCHELASTIC_RUN_ID``), ``WORLD_SIZE``, which counts
  the pods there. From v1.7 the operator sets ``WORLD_SIZE`` to pods x ``nprocPerNode``: it is never read when
  ``PET_NNODES`` is set;
- this node: ``PET_NODE_RANK``, else ``NODE_RANK``, else the pod's ``RANK`` (PyTorchJob: the pod's index);
- rendezvous: ``PET_RDZV_ENDPOINT`` with ``PET_RDZV_BACKEND`` (elastic policy: c10d), else ``PET_MASTER_ADDR`` /
  ``PET_MASTER_PORT``, else ``MASTER_ADDR`` / ``MASTER_PORT`` (port default 29500, torchrun's); id ``PET_RDZV_ID``;
- processes per node: ``PET_NPROC_PER_NODE`` (a number, or torchrun's ``gpu`` / ``cpu`` / ``auto``; the operator's
  older ``PET_N_PROC_PER_NODE`` too), else the GPUs torch sees, else none (as above);
- restarts: ``PET_MAX_RESTARTS``.

With both a SLURM job and torchrun's variables, SLURM's values are used; the others must agree with them on the node
count and this node's rank.
``--scheduler none`` ignores all of this; ``--scheduler slurm`` / ``kubernetes`` insist on one.

torchrun's own parser reads ``PET_<FLAG>`` as the default of each of its flags; `torchrun_flags_only` hides the ones
the launch decides (and ``PET_STANDALONE``, ``PET_MODULE``, ``PET_NO_PYTHON``, ``PET_RUN_PATH``, which would change
how torchrun runs ndparallel's worker) while it parses the flags the launch passes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

AUTO, SLURM, KUBERNETES, NONE = "auto", "slurm", "kubernetes", "none"
SCHEDULERS = (AUTO, SLURM, KUBERNETES, NONE)
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000  # below Linux's ephemeral ports (32768-60999)
TORCHRUN_PORT = 29500  # torchrun's --master-port default
# What each source reads: the variables that make a scheduler's environment (tests clear them).
SLURM_STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
TORCHRUN_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT", "PET_NPROC_PER_NODE",
                      "PET_N_PROC_PER_NODE", "NODE_RANK")
TORCHRUN_WORKER_VARIABLES = ("LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")  # set in a rank, not in a pod's entry
# torchrun's flags the launch always decides, and those that would change how torchrun runs the worker
TORCHRUN_HIDDEN = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                   "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_RDZV_CONF", "PET_MAX_RESTARTS",
                   "PET_STANDALONE", "PET_MODULE", "PET_NO_PYTHON", "PET_RUN_PATH")
ONE_TASK_PER_NODE = ("run one task per node: `srun --ntasks-per-node=1 ndparallel launch ...` (in the batch script: "
                     "#SBATCH --ntasks-per-node=1 with --gpus-per-node=G or --cpus-per-task=C); ndparallel launch "
                     "starts the node's ranks itself")


def is_scheduler_variable(name: str) -> bool:
    """Whether `name` is a variable `read_environment` may read to find a scheduler (tests run without them)."""
    return name.startswith(("SLURM_", "PET_")) or name in ("NODE_RANK", "KUBERNETES_SERVICE_HOST")


@dataclass(frozen=True)
class Found:
    """A setting and where it came from (``SLURM_NODEID=1``, ``--nnodes``, ...)."""

    value: Any
    source: str


@dataclass
class Environment:
    """What a scheduler's environment says about this launch; None: it says nothing."""

    name: str  # "SLURM job 4242", "Kubernetes (PyTorchJob)", "torchrun's variables"
    nnodes: Found | None = None
    node_rank: Found | None = None
    host: Found | None = None
    port: Found | None = None
    rdzv_backend: Found | None = None
    rdzv_id: Found | None = None
    nproc_per_node: Found | None = None
    max_restarts: Found | None = None
    warnings: list[str] = field(default_factory=list)


# ---- SLURM's compressed host lists ----------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    return [*items, text[start:]]


def _expand_range(group: str, text: str) -> list[str]:
    """``01-04,07`` -> 01, 02, 03, 04, 07 (each range padded to the width of its first number)."""
    out = []
    for piece in group.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", piece)
        if not match:
            raise ValueError(f"{piece!r} in {text!r} is not a number or a range LOW-HIGH")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {piece.strip()!r} in {text!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, in order: ``gpu[01-04,07],cpu3`` -> gpu01, gpu02, gpu03, gpu04, gpu07, cpu3.
    Ranges keep the zero padding of their first number; several bracket groups in one name multiply out
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2). Raise ValueError on anything else."""
    hosts = []
    for item in _split_top(text.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in {text!r}")
        parts = re.split(r"\[([^\[\]]*)\]", item)  # literal, group, literal, group, ..., literal
        choices = [[part] if i % 2 == 0 else _expand_range(part, text) for i, part in enumerate(parts)]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def _tasks_per_node(text: str) -> list[int]:
    """SLURM's ``2(x3),1`` -> [2, 2, 2, 1]."""
    out = []
    for piece in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", piece)
        if not match:
            raise ValueError(f"cannot read {text!r} as tasks per node (as in '2(x3),1')")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return out


# ---- reading variables ----------------------------------------------------------------------------------------------
def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    return next(((name, env[name]) for name in names if env.get(name, "").strip()), None)


def _integer(name: str, text: str, low: int = 0) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < low:
        raise ValueError(f"{name}={text!r} must be >= {low}")
    return value


def _found_int(env: Mapping[str, str], *names: str, low: int = 0) -> Found | None:
    hit = _first(env, *names)
    return None if hit is None else Found(_integer(*hit, low=low), f"{hit[0]}={hit[1]}")


def _count_devices(text: str) -> int:
    """GPUs in a device list such as ``0,1,3`` (``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS``)."""
    return len([d for d in text.split(",") if d.strip() and d.strip() != "NoDevFiles"]) if text.strip() != "-1" else 0


def _port(name: str, text: str) -> int:
    port = _integer(name, text)
    if not 0 < port < 65536:
        raise ValueError(f"{name}={text!r} is not a port in 1..65535")
    return port


# ---- SLURM ----------------------------------------------------------------------------------------------------------
def _slurm_gpus(env: Mapping[str, str], gpus: int) -> Found | None:
    """The GPUs of this node that the step may use; `gpus`: those torch sees."""
    hit = _first(env, "SLURM_GPUS_ON_NODE")
    count = None if hit is None else Found(_integer(*hit), f"{hit[0]}={hit[1]}: the node's GPUs")
    if count is None:
        hit = _first(env, "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
        count = None if hit is None else Found(_count_devices(hit[1]), f"{hit[0]}={hit[1]}: the node's GPUs")
    if count is not None and count.value == 0 and gpus > 0:
        raise ValueError(f"{count.source.split(':')[0]}: this step has no GPUs, but torch sees {gpus}: give --cpu to "
                         "run on the CPU, or ask for GPUs (--gpus-per-node)")
    if count is not None and count.value > gpus:
        raise ValueError(f"{count.source.split(':')[0]}, but torch sees {gpus} GPU(s) on this node "
                         "(CUDA_VISIBLE_DEVICES?): give --nproc-per-node, or ask the step for the GPUs it may use")
    if count is None and gpus > 0:
        count = Found(gpus, "the GPUs torch sees on the node")
    return count if count is not None and count.value > 0 else None


def _slurm(env: Mapping[str, str], cpu: bool, gpus: int) -> Environment:
    job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")[1].strip()
    out = Environment(f"SLURM job {job}")
    nnodes = _found_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", low=1)
    if nnodes is None:
        raise ValueError(f"{out.name}: none of SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES is set: give "
                         "--nnodes, or --scheduler none")
    out.nnodes = nnodes
    in_step = _first(env, *SLURM_STEP_VARIABLES) is not None
    if not in_step and nnodes.value > 1:
        raise ValueError(f"{out.name} has {nnodes.value} nodes ({nnodes.source}) but this is not an srun step (no "
                         "SLURM_STEP_ID): started by the batch script itself, ndparallel launch runs on the first "
                         f"node only. Start it on every node: `srun --ntasks-per-node=1 ndparallel launch ...` (or "
                         "--scheduler none with --nnodes / --node-rank / --rdzv-endpoint of your own)")
    if in_step:
        _check_one_task_per_node(env, nnodes.value, out.name)
        out.node_rank = _found_int(env, "SLURM_NODEID")
        if out.node_rank is None:
            raise ValueError(f"{out.name}: SLURM_NODEID is not set in this srun step: give --node-rank")
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None and nnodes.value > 1:
            raise ValueError(f"{out.name}: no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST to find the first node in: "
                             "set MASTER_ADDR to it, or give --rdzv-endpoint HOST:PORT")
        if nodelist is not None:
            try:
                hosts = expand_nodelist(nodelist[1])
            except ValueError as exc:
                raise ValueError(f"{out.name}: cannot read {nodelist[0]}: {exc}; set MASTER_ADDR to the first node, "
                                 "or give --rdzv-endpoint HOST:PORT") from None
            if len(hosts) != nnodes.value:
                raise ValueError(f"{out.name}: {nodelist[0]}={nodelist[1]} names {len(hosts)} host(s), but the step "
                                 f"has {nnodes.value} node(s) ({nnodes.source}); set MASTER_ADDR to the step's first "
                                 "node, or give --rdzv-endpoint HOST:PORT")
            out.host = Found(hosts[0], f"the first host of {nodelist[0]}={nodelist[1]}")
        master = _first(env, "MASTER_ADDR")
        if master is not None:
            out.host = Found(master[1].strip(), f"MASTER_ADDR={master[1]}")
        master_port = _first(env, "MASTER_PORT")
        if master_port is not None:
            out.port = Found(_port(*master_port), f"MASTER_PORT={master_port[1]}")
        else:
            number = int(job) if job.isdigit() else zlib.crc32(job.encode())
            out.port = Found(SLURM_PORT_BASE + number % SLURM_PORT_SPAN,
                             f"{SLURM_PORT_BASE} + SLURM_JOB_ID mod {SLURM_PORT_SPAN}")
        out.rdzv_id = Found(f"slurm-{job}", f"SLURM_JOB_ID={job}")
    if not cpu:
        out.nproc_per_node = _slurm_gpus(env, gpus)
    elif _first(env, "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS") and gpus == 0:
        out.warnings.append(f"{out.name} has GPUs on this node, but torch has no CUDA here: running on the CPU")
    if out.nproc_per_node is None:
        cpus = _found_int(env, "SLURM_CPUS_PER_TASK", low=1)
        if cpus is not None:
            out.nproc_per_node = Found(cpus.value, f"{cpus.source}: one process per CPU asked, on CPU")
    return out


def _check_one_task_per_node(env: Mapping[str, str], nnodes: int, name: str) -> None:
    """Refuse an srun step with more than one task on a node: each task would start the node's ranks."""
    local = _first(env, "SLURM_LOCALID")
    if local is not None and _integer(*local) > 0:
        raise ValueError(f"{name}: this is task {local[1]} on its node (SLURM_LOCALID={local[1]}): srun started more "
                         f"than one task on a node; {ONE_TASK_PER_NODE}")
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node is not None:
        counts = _tasks_per_node(per_node[1])
        if max(counts) > 1:
            raise ValueError(f"{name}: srun starts {max(counts)} tasks on a node ({per_node[0]}={per_node[1]}), and "
                             f"every task would start a whole node's ranks; {ONE_TASK_PER_NODE}")
        return
    tasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks is not None and _integer(*tasks) > nnodes:
        raise ValueError(f"{name}: srun starts {tasks[1]} tasks ({tasks[0]}) on {nnodes} node(s), and every task would "
                         f"start a whole node's ranks; {ONE_TASK_PER_NODE}")


# ---- torchrun's variables (Kubernetes) ------------------------------------------------------------------------------
def _pytorchjob_pod(env: Mapping[str, str]) -> bool:
    """A PyTorchJob pod's entry (not a torchrun worker): its ``WORLD_SIZE`` / ``RANK`` count pods, not processes."""
    return ("KUBERNETES_SERVICE_HOST" in env and all(name in env for name in ("MASTER_ADDR", "MASTER_PORT",
                                                                                "WORLD_SIZE", "RANK"))
            and not any(name in env for name in TORCHRUN_WORKER_VARIABLES))


def _nproc_word(name: str, text: str, cpu: bool, gpus: int, cpus: int) -> Found:
    """``PET_NPROC_PER_NODE`` as torchrun reads it: a number, or gpu / cpu / auto."""
    word = text.strip()
    if word.isdigit():
        return Found(_integer(name, word, low=1), f"{name}={text}")
    if word == "gpu":
        if cpu or gpus == 0:
            raise ValueError(f"{name}=gpu, but this launch runs on the CPU ({'--cpu' if gpus else 'no CUDA here'}): "
                             "give --nproc-per-node")
        return Found(gpus, f"{name}=gpu: the GPUs torch sees")
    if word == "cpu" or (word == "auto" and (cpu or gpus == 0)):
        return Found(cpus, f"{name}={word}: the CPUs this process may use, as torchrun counts them")
    if word == "auto":
        return Found(gpus, f"{name}=auto: the GPUs torch sees")
    raise ValueError(f"{name}={text!r} is not a number of processes, gpu, cpu or auto")


def _torchrun(env: Mapping[str, str], cpu: bool, gpus: int, cpus: int) -> Environment:
    pod = _pytorchjob_pod(env)
    out = Environment("Kubernetes (PyTorchJob)" if "KUBERNETES_SERVICE_HOST" in env else "torchrun's variables")
    nnodes = _first(env, "PET_NNODES")
    if nnodes is not None:
        low, _, high = nnodes[1].strip().partition(":")
        low_n = _integer(nnodes[0], low, low=1)
        if high and _integer(nnodes[0], high, low=1) != low_n:
            raise ValueError(f"{nnodes[0]}={nnodes[1]} is an elastic range of nodes; ndparallel needs a fixed node "
                             "count (the sizes are checked against the world size): set minReplicas = maxReplicas in "
                             "the elasticPolicy, or leave them out")
        out.nnodes = Found(low_n, f"{nnodes[0]}={nnodes[1]}")
    elif pod:
        out.nnodes = Found(_integer("WORLD_SIZE", env["WORLD_SIZE"], low=1), f"WORLD_SIZE={env['WORLD_SIZE']}: the "
                           "PyTorchJob's pods")
    out.node_rank = _found_int(env, "PET_NODE_RANK", "NODE_RANK")
    if out.node_rank is None and pod:
        out.node_rank = Found(_integer("RANK", env["RANK"]), f"RANK={env['RANK']}: the pod's index")
    backend = _first(env, "PET_RDZV_BACKEND")
    endpoint = _first(env, "PET_RDZV_ENDPOINT")
    if backend is not None:
        if backend[1].strip() not in ("static", "c10d"):
            raise ValueError(f"{backend[0]}={backend[1]}: ndparallel launch meets with the static or the c10d "
                             "rendezvous; set rdzvBackend to c10d")
        out.rdzv_backend = Found(backend[1].strip(), f"{backend[0]}={backend[1]}")
    if endpoint is not None:
        host, _, port = endpoint[1].strip().rpartition(":")
        if not host:
            raise ValueError(f"{endpoint[0]}={endpoint[1]!r} is not HOST:PORT")
        out.host, out.port = Found(host, f"{endpoint[0]}={endpoint[1]}"), Found(_port(endpoint[0], port),
                                                                               f"{endpoint[0]}={endpoint[1]}")
    else:
        for addr_name, port_name in (("PET_MASTER_ADDR", "PET_MASTER_PORT"), ("MASTER_ADDR", "MASTER_PORT")):
            if _first(env, addr_name):
                out.host = Found(env[addr_name].strip(), f"{addr_name}={env[addr_name]}")
                port = _first(env, port_name)
                out.port = (Found(_port(*port), f"{port[0]}={port[1]}") if port
                            else Found(TORCHRUN_PORT, f"torchrun's default, no {port_name}"))
                break
    rdzv_id = _first(env, "PET_RDZV_ID")
    if rdzv_id is not None:
        out.rdzv_id = Found(rdzv_id[1].strip(), f"{rdzv_id[0]}={rdzv_id[1]}")
    words = _first(env, "PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE")
    if words is not None:
        out.nproc_per_node = _nproc_word(*words, cpu=cpu, gpus=gpus, cpus=cpus)
    elif not cpu and gpus > 0:
        out.nproc_per_node = Found(gpus, "the GPUs torch sees on the node")
    out.max_restarts = _found_int(env, "PET_MAX_RESTARTS")
    if _first(env, "PET_RDZV_CONF"):
        out.warnings.append(f"PET_RDZV_CONF={env['PET_RDZV_CONF']} is not used: the nodes wait --rdzv-timeout "
                            "seconds for each other")
    return out


# ---- which ----------------------------------------------------------------------------------------------------------
def _has_torchrun_variables(env: Mapping[str, str]) -> bool:
    return _first(env, *TORCHRUN_VARIABLES) is not None or _pytorchjob_pod(env)


def read_environment(env: Mapping[str, str], scheduler: str = AUTO, cpu: bool = False, gpus: int = 0,
                     cpus: int | None = None) -> Environment | None:
    """What the environment of this launch says about the nodes (None: no scheduler). `cpu`: the launch runs on the
    CPU; `gpus`: the CUDA devices torch sees; `cpus`: the CPUs this process may use (default: counted here)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler must be one of {list(SCHEDULERS)}, got {scheduler!r}")
    if scheduler == NONE:
        return None
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    slurm = _first(env, "SLURM_JOB_ID", "SLURM_JOBID") is not None
    torchrun = _has_torchrun_variables(env)
    if scheduler == SLURM and not slurm:
        raise ValueError("--scheduler slurm: no SLURM job here (SLURM_JOB_ID is not set)")
    if scheduler == KUBERNETES and not torchrun:
        raise ValueError("--scheduler kubernetes: none of " + ", ".join(TORCHRUN_VARIABLES) + " is set, and this "
                         "is not a PyTorchJob pod (KUBERNETES_SERVICE_HOST, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, "
                         "RANK)")
    if scheduler == KUBERNETES or (scheduler == AUTO and torchrun and not slurm):
        return _torchrun(env, cpu, gpus, cpus)
    if not slurm:
        return None
    found = _slurm(env, cpu, gpus)
    if scheduler == AUTO and torchrun:  # both: SLURM's, if the others agree
        other = _torchrun(env, cpu, gpus, cpus)
        for key, what in (("nnodes", "node count"), ("node_rank", "node rank")):
            mine, theirs = getattr(found, key), getattr(other, key)
            if mine is not None and theirs is not None and mine.value != theirs.value:
                raise ValueError(f"{found.name} and {other.name} disagree on the {what}: {mine.value} "
                                 f"({mine.source}) vs {theirs.value} ({theirs.source}); choose with --scheduler "
                                 "slurm or --scheduler kubernetes")
    return found


@contextlib.contextmanager
def torchrun_flags_only() -> Iterator[None]:
    """Hide `TORCHRUN_HIDDEN` from torchrun's parser (it reads ``PET_<FLAG>`` as each flag's default)."""
    saved = {name: os.environ.pop(name) for name in TORCHRUN_HIDDEN if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# ---- flags over the environment -------------------------------------------------------------------------------------
@dataclass
class Placement:
    """The launch's node settings, each with its source: a flag or the config file, else the scheduler's environment,
    else the default. `nproc_per_node` None: neither says (the launch's default applies)."""

    nnodes: Found
    node_rank: Found
    endpoint: Found | None
    rdzv_backend: Found
    rdzv_id: Found
    nproc_per_node: Found | None
    max_restarts: Found
    environment: Environment | None = None

    def describe(self, nproc: Found) -> str | None:
        """One line saying where each value came from (None without a scheduler)."""
        if self.environment is None:
            return None
        parts = [f"{self.nnodes.value} node(s) ({self.nnodes.source})"]
        if self.nnodes.value > 1:
            parts.append(f"node rank {self.node_rank.value} ({self.node_rank.source})")
            if self.endpoint is not None:
                parts.append(f"rendezvous {self.endpoint.value} ({self.endpoint.source})")
            parts.append(f"rdzv id {self.rdzv_id.value} ({self.rdzv_id.source})")
        parts.append(f"{nproc.value} process(es) per node ({nproc.source})")
        return f"ndparallel launch: {self.environment.name}: " + ", ".join(parts)


def place(given: Mapping[str, Found | None], environment: Environment | None) -> Placement:
    """`given` (keys nnodes, node_rank, rdzv_endpoint, rdzv_backend, rdzv_id, nproc_per_node, max_restarts: a flag's
    or the config file's value, or None) over `environment`. A node count other than the scheduler's is refused: the
    scheduler starts one launch on each of its nodes, so any other count would never meet."""
    def pick(key: str, default: Found | None = None, env_key: str | None = None) -> Found | None:
        return given.get(key) or getattr(environment, env_key or key, None) or default

    mine, theirs = given.get("nnodes"), getattr(environment, "nnodes", None)
    if mine is not None and theirs is not None and mine.value != theirs.value:
        raise ValueError(f"{mine.value} node(s) ({mine.source}) disagrees with {environment.name}: {theirs.value} "
                         f"node(s) ({theirs.source}), which starts one ndparallel launch on each of its nodes, so "
                         f"{mine.value} node(s) would never meet: leave the node count out of {mine.source}, ask the "
                         f"scheduler for {mine.value} node(s), or ignore it with --scheduler none")
    nnodes = pick("nnodes", Found(1, "default"))
    endpoint = given.get("rdzv_endpoint")
    if endpoint is None and environment is not None and environment.host is not None and nnodes.value > 1:
        host, port = environment.host, environment.port
        endpoint = Found(f"{host.value}:{port.value}", f"{host.value}: {host.source}; port {port.value}: "
                                                       f"{port.source}")
    return Placement(nnodes, pick("node_rank", Found(0, "default")), endpoint,
                     pick("rdzv_backend", Found("static", "default")), pick("rdzv_id", Found("ndparallel", "default")),
                     pick("nproc_per_node"), pick("max_restarts", Found(0, "default")), environment)
