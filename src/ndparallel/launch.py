"""`ndparallel launch`: check the sizes against the world size, then start the ranks with torchrun.

Settings come from, in order of precedence: command-line flags > the YAML file of ``--config-file`` >
defaults. The YAML file has two sections (``ndparallel config`` writes it):

    parallelism:   {dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size}  (ParallelismConfig.to_dict)
    launch:        {nproc_per_node, nnodes, mixed_precision, gradient_accumulation_steps, cpu}

The launched ranks receive their settings as environment variables (``ParallelismConfig()`` and the
Accelerator read them): ``NDPARALLEL_<SIZE_FIELD>``, ``NDPARALLEL_MIXED_PRECISION``,
``NDPARALLEL_GRADIENT_ACCUMULATION_STEPS``, ``NDPARALLEL_CPU``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ndparallel.config import (
    ACCUMULATION_ENV,
    MIXED_PRECISION,
    MIXED_PRECISION_ENV,
    SIZE_FIELDS,
    ParallelismConfig,
    load_yaml,
    size_env_var,
)
from ndparallel.runtime import CPU_ENV

RESTART_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
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


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, int], dict[str, Any], list[str]]:
    """Read a config file: (sizes it gives, launch settings it gives, warnings)."""
    source = f"config file {str(path)!r}"
    data = load_yaml(path)
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
    for handler in ("tp_handler", "cp_handler"):
        if handler in section and getattr(parsed, handler) != getattr(default, handler):
            warnings.append(f"{source}: parallelism.{handler} is not passed to the script (only sizes are); "
                            "build it in the script's ParallelismConfig")
    sizes = {name: getattr(parsed, name) for name in SIZE_FIELDS if name in section}
    return sizes, check_launch_settings(data.get("launch") or {}, source), warnings


def default_nproc(sizes: dict[str, int], nnodes: int) -> int:
    """Processes per node when none is given: the product of the sizes on one node without -1, else 1."""
    if sizes and nnodes == 1 and -1 not in sizes.values():
        return math.prod(sizes.values())
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

    def describe(self) -> str:
        world = self.nproc_per_node * self.nnodes
        sizes = (f"sizes {self.parallelism.formula()} = {world}" if self.parallelism is not None
                 else "no sizes passed (the script's own ParallelismConfig, or plain data parallel)")
        device = "cpu/gloo" if self.cpu else "cuda/nccl"
        return (f"ndparallel launch: {world} process(es) = {self.nnodes} node(s) x {self.nproc_per_node}, "
                f"{sizes}, {device}: {self.target}")


def _rendezvous_args(args: argparse.Namespace, nnodes: int) -> list[str]:
    if not args.rdzv_endpoint:
        if nnodes > 1:
            raise ValueError(f"--rdzv-endpoint HOST:PORT is required with --nnodes {nnodes}")
        return ["--standalone"]  # c10d store on a free local port: no port clashes between launches
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {args.rdzv_endpoint!r}")
    if args.rdzv_backend == "static":
        return ["--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}",
                f"--node-rank={args.node_rank}"]
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}"]


def plan_launch(args: argparse.Namespace) -> LaunchPlan:
    """Merge flags, config file and defaults; validate everything before any process starts."""
    file_sizes, file_launch, warnings = read_config_file(args.config_file) if args.config_file else ({}, {}, [])
    sizes = dict(file_sizes)
    sizes.update({name: getattr(args, name) for name in SIZE_FIELDS if getattr(args, name) is not None})
    settings = {key: getattr(args, key) if getattr(args, key) is not None else file_launch.get(key)
                for key in LAUNCH_KEYS}
    nnodes = positive_int("--nnodes", 1 if settings["nnodes"] is None else settings["nnodes"])
    nproc = settings["nproc_per_node"]
    nproc = positive_int("--nproc-per-node", default_nproc(sizes, nnodes) if nproc is None else nproc)
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {args.node_rank}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    # Every size explicit: a stale NDPARALLEL_* variable of this shell must not change what is checked.
    # With no sizes at all, the script brings its own config (or runs plain data parallel): nothing to check.
    explicit = ParallelismConfig(**{name: sizes.get(name, 1) for name in SIZE_FIELDS})
    resolved = explicit.resolve(nproc * nnodes) if sizes else None
    if not args.module and not Path(args.script).is_file():
        raise FileNotFoundError(f"script {args.script!r} does not exist (use -m to run a module)")

    env: dict[str, str | None] = {}
    if resolved is not None:
        env.update(resolved.to_env())
    else:
        stale = [size_env_var(name) for name in SIZE_FIELDS if size_env_var(name) in os.environ]
        if stale:
            warnings.append(f"ignoring {', '.join(stale)} from the environment: give sizes as flags or in "
                            "--config-file")
        env.update({var: None for var in stale})
    cpu = bool(settings["cpu"]) or not torch.cuda.is_available()
    if cpu:
        env[CPU_ENV] = "1"
    if settings["mixed_precision"] is not None:
        env[MIXED_PRECISION_ENV] = settings["mixed_precision"]
    if settings["gradient_accumulation_steps"] is not None:
        env[ACCUMULATION_ENV] = str(positive_int("--gradient-accumulation-steps", settings["gradient_accumulation_steps"]))
    if args.max_restarts > 0 and RESTART_STORE_ENV not in os.environ:
        # Restarted workers must not share torchrun's rendezvous store with the workers they replace: they would
        # read their dead peers' addresses from it and fail to connect (pytorch/pytorch#135712). With this set,
        # every attempt gets a fresh store on a fresh port.
        env[RESTART_STORE_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        # As torchrun does (without its warning): one thread per rank, so ranks don't oversubscribe the cores.
        # Set OMP_NUM_THREADS yourself to give each rank more.
        env["OMP_NUM_THREADS"] = "1"

    torchrun_args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={args.max_restarts}",
                     *_rendezvous_args(args, nnodes)]
    if args.module:
        torchrun_args.append("--module")
    torchrun_args += [args.script, *args.script_args]
    target = ("-m " if args.module else "") + " ".join([args.script, *args.script_args])
    return LaunchPlan(nproc, nnodes, resolved, cpu, target, env, torchrun_args, warnings)


def run_plan(plan: LaunchPlan) -> int:
    """Start the ranks through torchrun in this process; return 0 or the first failed rank's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    saved = dict(os.environ)
    for key, value in plan.env.items():  # the workers inherit this process's environment
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        run(parse_args(plan.torchrun_args))
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        print(f"ndparallel launch: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return code or 1
    except SignalException as exc:
        print(f"ndparallel launch: stopped by signal {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        os.environ.clear()
        os.environ.update(saved)
