"""`ndparallel launch`: check the sizes against the world size, then start the ranks with torchrun -- ranks that die
with their launcher, nodes that meet within a bounded time, ranks that stall reported.

Settings come from, in order of precedence: command-line flags > the YAML file of ``--config-file`` > the
scheduler's environment (the nodes of a SLURM step or a Kubernetes PyTorchJob: `ndparallel.launch.schedulers`) >
defaults. The YAML file has two sections (``ndparallel config`` writes it):

    parallelism:   {dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size}  (ParallelismConfig.to_dict)
    launch:        {nproc_per_node, nnodes, mixed_precision, gradient_accumulation_steps, cpu}

The launched ranks receive their settings as environment variables (``ParallelismConfig()`` and the
Accelerator read them): ``NDPARALLEL_<SIZE_FIELD>``, ``NDPARALLEL_MIXED_PRECISION``,
``NDPARALLEL_GRADIENT_ACCUMULATION_STEPS``, ``NDPARALLEL_CPU`` (with ``ACCELERATE_USE_CPU``, as Accelerate's launcher
exports it: transformers' ``TrainingArguments`` read it); and, for the machinery below,
``NDPARALLEL_LAUNCHER_PID`` and (with ``--stall-timeout``) ``NDPARALLEL_HEARTBEAT_DIR``.

Beyond torchrun:
- every rank runs the script through `ndparallel.launch.worker`, which kills it when this launcher dies, even by SIGKILL;
- with ``--nnodes N > 1`` and the static backend, the nodes first meet in a roll call at ``--rdzv-endpoint`` (node 0
  hosts it; torchrun's store then reuses the same server): a node rank claimed twice, a node 0 started on another host,
  a port already taken, and nodes that do not arrive within ``--rdzv-timeout`` seconds end the launch with a message
  naming the endpoint, the node count and the node ranks (`roll_call`);
- with ``--stall-timeout S``, a rank whose library heartbeat (`ndparallel.distributed.runtime.heartbeat`) is older than
S seconds
  is reported -- rank, host, pid, last library call -- and killed, so the job ends non-zero, or restarts under
  ``--max-restarts`` as after a crash (`StallWatch`).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..configuration.environment import ACCUMULATION_ENV, MIXED_PRECISION_ENV, load_yaml, size_env_var
from ..configuration.dtypes import MIXED_PRECISION
from ..configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from . import accelerate_launch, fault_tolerant, schedulers
from .accelerate_launch import Translated
from .supervision import LaunchError, RollCall, StallWatch, note
from .worker import LAUNCHER_PID_ENV
from ..distributed.runtime import CPU_ENV, HEARTBEAT_ENV

RESTART_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
WORKER = str(Path(__file__).resolve().parent / "worker.py")  # what torchrun runs; it runs the script
DEFAULT_RDZV_TIMEOUT = 300.0
LAUNCH_KEYS: tuple[str, ...] = ("nproc_per_node", "nnodes", "mixed_precision", "gradient_accumulation_steps", "cpu")
FILE_SECTIONS: tuple[str, ...] = ("parallelism", "launch")


def positive_int(name: str, value: Any) -> int:
    """Return `value` if it is an int >= 1, else raise naming the setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_launch_settings(data: Any, source: str) -> dict[str, Any]:
    """Validate the ``launch:`` section of a config file; return the settings it gives."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the 'launch' section must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(LAUNCH_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} in 'launch'; valid keys: {list(LAUNCH_KEYS)}")
    out = dict(data)
    for key in ("nproc_per_node", "nnodes", "gradient_accumulation_steps"):
        if key in out:
            out[key] = positive_int(f"{source}: launch.{key}", out[key])
    if out.get("mixed_precision") is False:  # YAML 1.1 reads an unquoted `no` as false
        out["mixed_precision"] = "no"
    if "mixed_precision" in out and out["mixed_precision"] not in MIXED_PRECISION:
        raise ValueError(f"{source}: launch.mixed_precision must be one of {list(MIXED_PRECISION)}, "
                         f"got {out['mixed_precision']!r}")
    if "cpu" in out and not isinstance(out["cpu"], bool):
        raise ValueError(f"{source}: launch.cpu must be true or false, got {out['cpu']!r}")
    return out


def read_config_file(path: str | os.PathLike, flags: dict[str, Any] | None = None) -> Translated:
    """Read a config file of ``ndparallel config`` or of ``accelerate config`` (`ndparallel.launch.accelerate_launch`;
    `flags`, accelerate launch's in the file's shape, are merged over it): the sizes, launch settings, environment
    and warnings it gives."""
    source = f"config file {str(path)!r}"
    data = load_yaml(path)
    if accelerate_launch.is_accelerate_file(data):
        return accelerate_launch.translate(accelerate_launch.merge(data, flags or {}), source)
    unknown = sorted(set(data) - set(FILE_SECTIONS))
    if unknown:
        raise ValueError(f"{source}: unknown section(s) {unknown}; valid sections: {list(FILE_SECTIONS)}")
    section = data.get("parallelism") or {}
    if not isinstance(section, dict):
        raise ValueError(f"{source}: the 'parallelism' section must be a mapping, got {type(section).__name__}")
    # Fill the unset sizes with 1 so that validation never reads NDPARALLEL_* from this process's environment.
    try:
        parsed = ParallelismConfig.from_dict({**{name: 1 for name in SIZE_FIELDS}, **section})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None
    warnings = []
    default = ParallelismConfig(**{name: 1 for name in SIZE_FIELDS})
    for handler in ("tp_handler", "cp_handler", "pp_handler"):
        if handler in section and getattr(parsed, handler) != getattr(default, handler):
            warnings.append(f"{source}: parallelism.{handler} is not passed to the script (only sizes are); "
                            "build it in the script's ParallelismConfig")
    sizes = {name: getattr(parsed, name) for name in SIZE_FIELDS if name in section}
    out = Translated(sizes, check_launch_settings(data.get("launch") or {}, source), warnings=warnings)
    if flags:
        flagged = accelerate_launch.translate(flags, "accelerate launch flags")
        out.sizes.update(flagged.sizes)
        out.launch.update(flagged.launch)
        out.env.update(flagged.env)
        out.warnings.extend(flagged.warnings)
    return out


def config_file_data(pc: ParallelismConfig | None, launch: dict[str, Any], fmt: str = "ndparallel") -> dict[str, Any]:
    """What `ndparallel config` writes (and `plan` prints): the ``parallelism`` sizes (empty without a config) and the
    checked ``launch`` settings; with `fmt` "accelerate", an `accelerate config` file instead."""
    if fmt == "accelerate":
        return accelerate_launch.to_file(pc, launch)
    parallelism = {name: value for name, value in pc.to_dict().items() if name in SIZE_FIELDS} if pc else {}
    return {"parallelism": parallelism, "launch": launch}


def default_nproc(sizes: dict[str, int], nnodes: int) -> int:
    """Processes per node when none is given: the product of the sizes over the nodes when there is no -1 and it
    divides evenly, else 1 (ep_size is carved out of the others: no factor)."""
    axes = [size for name, size in sizes.items() if name != "ep_size"]
    if axes and -1 not in axes and math.prod(axes) % nnodes == 0:
        return math.prod(axes) // nnodes
    return 1


@dataclass
class LaunchPlan:
    """Everything `run_plan` needs: what to start and with which environment (None = remove the variable)."""

    nproc_per_node: int
    nnodes: int
    parallelism: ParallelismConfig | None
    cpu: bool
    target: str
    env: dict[str, str | None] = field(default_factory=dict)
    torchrun_args: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rendezvous: RollCall | None = None  # multi-node static rendezvous: the roll call before torchrun
    endpoint: str | None = None  # --rdzv-endpoint
    stall_timeout: float | None = None  # seconds without a heartbeat before a rank is reported and stopped
    origin: str | None = None  # under a scheduler: where the node count, node rank, rendezvous... came from
    replicas: fault_tolerant.ReplicaLaunch | None = None  # --fault-tolerant: the torchft replica groups to start

    def describe(self) -> str:
        world = self.nproc_per_node * self.nnodes
        sizes = (f"sizes {self.parallelism.formula()} = {world}" if self.parallelism is not None
                 else "no sizes passed (the script's own ParallelismConfig, or plain data parallel)")
        device = "cpu/gloo" if self.cpu else "cuda/nccl"
        return (f"ndparallel launch: {world} process(es) = {self.nnodes} node(s) x {self.nproc_per_node}, "
                f"{sizes}, {device}: {self.target}")


def _rendezvous_args(args: argparse.Namespace, nnodes: int) -> tuple[list[str], RollCall | None]:
    """torchrun's rendezvous flags, and the roll call to hold first (multi-node static rendezvous only)."""
    timeout = args.rdzv_timeout
    if not args.rdzv_endpoint:
        if nnodes > 1:
            raise ValueError(f"--rdzv-endpoint HOST:PORT is required with --nnodes {nnodes}")
        return ["--standalone"], None  # c10d store on a free local port: no port clashes between launches
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {args.rdzv_endpoint!r}")
    if args.rdzv_backend == "static":
        flags = ["--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}",
                 f"--node-rank={args.node_rank}", f"--rdzv-conf=timeout={math.ceil(timeout)}"]
        call = RollCall(host, int(port), nnodes, args.node_rank, timeout, args.rdzv_id) if nnodes > 1 else None
        return flags, call
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}",
            f"--rdzv-conf=join_timeout={math.ceil(timeout)}"], None


def _source(args: argparse.Namespace, key: str, flag: str, file_label: str | None = None) -> str:
    """Where a launch setting given by the user came from: its flag, else the config file / accelerate's flags."""
    if getattr(args, key, None) is not None:
        return flag
    return file_label or (f"--config-file {args.config_file}" if args.config_file else "accelerate launch's flags")


def _given_node_settings(args: argparse.Namespace, given: Translated, flags: dict[str, Any],
                         environment: schedulers.Environment | None,
                         warnings: list[str]) -> dict[str, schedulers.Found | None]:
    """The node settings the flags and the config file give, each with its source (for `schedulers.place`). A
    config file's node rank yields to the scheduler's: one file serves every node (``accelerate config`` always
    writes a ``machine_rank``), so only the scheduler can give each node its own."""
    out: dict[str, schedulers.Found | None] = {}
    for key, flag in (("nnodes", "--nnodes"), ("node_rank", "--node-rank"), ("rdzv_endpoint", "--rdzv-endpoint"),
                      ("rdzv_backend", "--rdzv-backend"), ("rdzv_id", "--rdzv-id"), ("max_restarts", "--max-restarts")):
        value = getattr(args, key, None)
        value = given.launch.get(key) if value is None else value
        label = "--main-process-ip" if key == "rdzv_endpoint" and "main_process_ip" in flags else None
        out[key] = None if value is None else schedulers.Found(value, _source(args, key, flag, label))
    mine, theirs = out["node_rank"], getattr(environment, "node_rank", None)
    if mine is not None and args.node_rank is None and theirs is not None:
        if mine.value != theirs.value:
            warnings.append(f"node rank {mine.value} of {mine.source} is not used: one file serves every node, "
                            f"{environment.name} gives this one {theirs.value} ({theirs.source})")
        out["node_rank"] = None
    return out


def plan_launch(args: argparse.Namespace) -> LaunchPlan:
    """Merge flags, config file and defaults; validate everything before any process starts."""
    # Precedence: flags > config file (Accelerate's flags are merged into an Accelerate file first) > defaults.
    flags = accelerate_launch.from_flags(args)
    if args.config_file:
        given = read_config_file(args.config_file, flags)
    else:
        given = accelerate_launch.translate(flags, "accelerate launch flags") if flags else Translated()
    warnings = list(given.warnings)
    sizes = dict(given.sizes)
    sizes.update({name: getattr(args, name) for name in SIZE_FIELDS if getattr(args, name) is not None})
    settings = {key: getattr(args, key) if getattr(args, key) is not None else given.launch.get(key)
                for key in (*LAUNCH_KEYS, "node_rank", "rdzv_endpoint", "rdzv_backend")}
    cpu = bool(settings["cpu"]) or not torch.cuda.is_available()
    # Flags and the config file over the scheduler's environment (SLURM, Kubernetes), over the defaults.
    environment = schedulers.read_environment(os.environ, args.scheduler, cpu=cpu,
                                              gpus=0 if cpu else torch.cuda.device_count())
    if environment is not None:
        warnings.extend(environment.warnings)
    placed = schedulers.place(_given_node_settings(args, given, flags, environment, warnings), environment)
    nnodes = positive_int(placed.nnodes.source, placed.nnodes.value)
    nproc = settings["nproc_per_node"]
    nproc_source = _source(args, "nproc_per_node", "--nproc-per-node")
    total = given.launch.get("num_processes")  # accelerate launch's count: over all nodes
    if total is not None:
        total = positive_int("--num-processes", total)
        if nproc is None and total % nnodes:
            raise ValueError(f"--num-processes {total} (over all nodes) is not divisible by --nnodes {nnodes}")
        if nproc is not None and nproc * nnodes != total:
            raise ValueError(f"--num-processes {total} (over all nodes) disagrees with --nproc-per-node {nproc} x "
                             f"--nnodes {nnodes}; give one of them")
        nproc, nproc_source = total // nnodes, f"--num-processes {total} / {nnodes} node(s)"
    if nproc is None and placed.nproc_per_node is not None:
        nproc, nproc_source = placed.nproc_per_node.value, placed.nproc_per_node.source
    if nproc is None:
        nproc = default_nproc(sizes, nnodes)
        nproc_source = "the sizes' product over the nodes" if nproc > 1 else "default"
    nproc = positive_int(nproc_source, nproc)
    node_rank = placed.node_rank.value
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        if environment is None:
            raise ValueError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
        raise ValueError(f"node rank {node_rank} ({placed.node_rank.source}) must be in 0..{nnodes - 1} for "
                         f"{nnodes} node(s) ({placed.nnodes.source})")
    if args.rdzv_endpoint is not None and ("main_process_ip" in flags or "main_process_port" in flags):
        raise ValueError("give --rdzv-endpoint HOST:PORT or --main-process-ip / --main-process-port, not both")
    endpoint = None if placed.endpoint is None else placed.endpoint.value
    max_restarts = placed.max_restarts.value
    rendezvous = argparse.Namespace(rdzv_endpoint=endpoint, rdzv_backend=placed.rdzv_backend.value,
                                    node_rank=node_rank, rdzv_timeout=args.rdzv_timeout, rdzv_id=placed.rdzv_id.value)
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not args.rdzv_timeout > 0:
        raise ValueError(f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout:g}")
    if args.stall_timeout is not None and not args.stall_timeout > 0:
        raise ValueError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    # Every size explicit: a stale NDPARALLEL_* variable of this shell must not change what is checked.
    # With no sizes at all, the script brings its own config (or runs plain data parallel): nothing to check.
    explicit = ParallelismConfig(**{name: sizes.get(name, 1) for name in SIZE_FIELDS})
    try:
        resolved = explicit.resolve(nproc * nnodes) if sizes else None
    except ValueError as exc:
        if environment is None:
            raise
        world = (f"world size {nproc * nnodes} = {nnodes} node(s) ({placed.nnodes.source}) x {nproc} process(es) "
                 f"per node ({nproc_source})")
        raise ValueError(f"{str(exc).replace(f'world size {nproc * nnodes}', world, 1)} Change the sizes, or the "
                         "nodes or GPUs / CPUs the job asks for, or give --nproc-per-node.") from None
    replicas = fault_tolerant.plan_replicas(args, 1 if resolved is None else resolved.dp_replicate_size, nproc,
                                            nnodes, args.max_restarts)
    if not args.module and not Path(args.script).is_file():
        raise FileNotFoundError(f"script {args.script!r} does not exist (use -m to run a module)")

    env: dict[str, str | None] = dict(given.env)
    if resolved is not None:
        env.update(resolved.to_env())
    else:
        stale = [size_env_var(name) for name in SIZE_FIELDS if size_env_var(name) in os.environ]
        if stale:
            warnings.append(f"ignoring {', '.join(stale)} from the environment: give sizes as flags or in "
                            "--config-file")
        env.update({var: None for var in stale})
    if cpu:
        env[CPU_ENV] = "1"
        # What Accelerate's launcher exports for a CPU run, and what transformers' TrainingArguments read to build a
        # distributed CPU state: without it a Trainer script (no --use_cpu) takes every rank for a process of its own.
        env["ACCELERATE_USE_CPU"] = "true"
    if settings["mixed_precision"] is not None:
        env[MIXED_PRECISION_ENV] = settings["mixed_precision"]
    if settings["gradient_accumulation_steps"] is not None:
        steps = positive_int("--gradient-accumulation-steps", settings["gradient_accumulation_steps"])
        env[ACCUMULATION_ENV] = str(steps)
    if max_restarts > 0 and RESTART_STORE_ENV not in os.environ:
        # Restarted workers must not share torchrun's rendezvous store with the workers they replace: they would
        # read their dead peers' addresses from it and fail to connect (pytorch/pytorch#135712). With this set,
        # every attempt gets a fresh store on a fresh port.
        env[RESTART_STORE_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env and nproc > 1:
        # As torchrun does (without its warning): one thread per rank, so ranks don't oversubscribe the cores.
        # Set OMP_NUM_THREADS yourself to give each rank more.
        env["OMP_NUM_THREADS"] = "1"

    rendezvous_flags, roll = _rendezvous_args(rendezvous, nnodes)
    torchrun_args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}",
                     *rendezvous_flags]
    # torchrun runs ndparallel's worker (by path, as a script), which ties the rank to this launcher and then runs
    # the script as `python [-m] SCRIPT ARGS` would.
    torchrun_args += [WORKER, *(["-m"] if args.module else []), args.script, *args.script_args]
    target = ("-m " if args.module else "") + " ".join([args.script, *args.script_args])
    return LaunchPlan(nproc, nnodes, resolved, cpu, target, env, torchrun_args, warnings, roll, endpoint,
                      args.stall_timeout, placed.describe(schedulers.Found(nproc, nproc_source)), replicas)


def run_plan(plan: LaunchPlan) -> int:
    """Start the ranks through torchrun in this process; return 0 or the first failed rank's exit code."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    env = {**plan.env, LAUNCHER_PID_ENV: str(os.getpid())}  # the ranks' parent: this process (torchrun runs in it)
    if plan.replicas is not None:  # one torchrun per replica group, each in a process of its own
        return fault_tolerant.run(plan.replicas, env, plan.torchrun_args[plan.torchrun_args.index(WORKER):])
    watch = None
    if plan.stall_timeout is not None:
        watch = StallWatch(Path(tempfile.mkdtemp(prefix="ndparallel-heartbeat-")), plan.stall_timeout)
        env[HEARTBEAT_ENV] = str(watch.directory)
    saved = dict(os.environ)
    for key, value in env.items():  # the workers inherit this process's environment
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        if plan.rendezvous is not None:
            plan.rendezvous.hold()
        if watch is not None:
            watch.start()
        with schedulers.torchrun_flags_only():  # torchrun reads PET_* as its flags' defaults: the launch's flags only
            config = parse_args(plan.torchrun_args)
        run(config)
        return 0
    except LaunchError as exc:
        note(f"error: {exc}")
        return 1
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        note(f"rank {rank} failed with exit code {failure.exitcode}")
        if watch is not None and watch.stopped_ranks:
            note(f"rank(s) {sorted(set(watch.stopped_ranks))} were stopped for making no progress (--stall-timeout)")
        return code or 1
    except SignalException as exc:
        note(f"stopped by signal {exc.sigval.name}")
        return 128 + int(exc.sigval)
    except (RendezvousError, DistError) as exc:  # torchrun's own rendezvous (c10d backend, or after the roll call)
        where = plan.endpoint or "the rendezvous endpoint"
        note(f"error: the nodes did not meet at {where} with --nnodes {plan.nnodes} within --rdzv-timeout: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    finally:
        if watch is not None:
            watch.stop()
        if plan.rendezvous is not None:
            plan.rendezvous.store = None
        os.environ.clear()
        os.environ.update(saved)
