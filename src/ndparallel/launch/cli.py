"""The ``ndparallel`` command: ``launch`` (torchrun with checked sizes), ``config`` (write the YAML file
that ``launch --config-file`` reads), ``env`` (versions, devices, backends, for bug reports), ``merge-weights``
(a sharded checkpoint of ``save_state`` into a Hugging Face directory, offline), ``plan`` (rank the layouts for a
model and a cluster) and ``estimate-memory`` (one layout's memory per GPU), the last two in `plan_commands`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

from ..configuration.environment import ENV_PREFIX
from ..configuration.dtypes import MIXED_PRECISION
from ..configuration.parallelism import SIZE_FIELDS, ParallelismConfig
from . import accelerate_launch, fault_tolerant, plan_commands, schedulers
from .arguments import PROG, error, spellings

DEFAULT_CONFIG_FILE = "ndparallel_config.yaml"


def _version() -> str:
    version = getattr(sys.modules.get("ndparallel"), "__version__", None)
    if version:
        return version
    try:
        return importlib.metadata.version("ndparallel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- arguments ------------------------------------------------------------------------------------------
def _add_settings_arguments(parser: argparse.ArgumentParser, accelerate_names: bool = False) -> None:
    """Sizes and launch settings shared by ``launch`` and ``config``; None means 'not given'. With
    `accelerate_names`, also ``accelerate launch``'s names for the same settings."""
    sizes = parser.add_argument_group("parallelism sizes (-1: the ranks that are left; unset: 1)")
    for name in SIZE_FIELDS:
        extra = (f"parallelism_config_{name}",) if accelerate_names else ()
        sizes.add_argument(*spellings(name, *extra), dest=name, type=int, default=None, metavar="N")
    parser.add_argument(*spellings("nproc-per-node"), type=int, default=None, metavar="N",
                        help="processes per node (default: the scheduler's GPUs / CPUs per node, else the product of "
                             "the sizes over the nodes, or 1)")
    parser.add_argument(*spellings("nnodes", *(("num_machines",) if accelerate_names else ())), dest="nnodes",
                        type=int, default=None, metavar="N", help="number of nodes (default: the scheduler's, else 1)")
    parser.add_argument(*spellings("mixed-precision"), choices=MIXED_PRECISION, default=None,
                        help="sets NDPARALLEL_MIXED_PRECISION for the script")
    parser.add_argument(*spellings("gradient-accumulation-steps"), type=int, default=None, metavar="N",
                        help="sets NDPARALLEL_GRADIENT_ACCUMULATION_STEPS for the script")
    parser.add_argument("--cpu", action="store_true", default=None,
                        help="run on the CPU with gloo (the default when CUDA is not available)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="N-dimensional parallel training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{launch,config,env,merge-weights,plan,estimate-memory}")

    # allow_abbrev=False: a script argument such as the Trainer's --fsdp, a prefix of launcher flags (--fsdp_version...),
    # would otherwise be refused as an ambiguous abbreviation although it comes after SCRIPT.
    launch = sub.add_parser("launch", help="start a training script on N processes (wraps torchrun)",
                            allow_abbrev=False,
                            description="Check the parallelism sizes, then start SCRIPT on every rank with "
                                        "torchrun. Precedence: flag > --config-file > default. accelerate launch's "
                                        "flags and config files are accepted too (ndparallel.launch.accelerate_launch).")
    launch.add_argument(*spellings("config-file"), dest="config_file", default=None, metavar="PATH",
                        help="YAML written by `ndparallel config` or by `accelerate config`")
    _add_settings_arguments(launch, accelerate_names=True)
    launch.add_argument(*spellings("node-rank", "machine_rank"), dest="node_rank", type=int, default=None,
                        metavar="K", help="this node's rank (default: the scheduler's, else 0)")
    launch.add_argument(*spellings("rdzv-endpoint"), default=None, metavar="HOST:PORT",
                        help="rendezvous address; default: the scheduler's (SLURM's first node, MASTER_ADDR...), "
                             "else a free local port (one node only)")
    launch.add_argument(*spellings("rdzv-backend"), choices=("static", "c10d"), default=None,
                        help="with --rdzv-endpoint: static (uses --node-rank) or c10d (default static)")
    launch.add_argument(*spellings("rdzv-id"), default=None,
                        help="job id for the c10d rendezvous (default: the scheduler's job id, else ndparallel)")
    launch.add_argument(*spellings("rdzv-timeout"), type=float, default=300.0, metavar="SECONDS",
                        help="with --nnodes > 1: how long the nodes may take to meet at --rdzv-endpoint before the "
                             "launch ends with a message naming the missing or duplicate node ranks (default 300)")
    launch.add_argument(*spellings("stall-timeout"), type=float, default=None, metavar="SECONDS",
                        help="report and stop a rank that makes no library call for this long (rank, host, last "
                             "call); the job then exits non-zero, or restarts under --max-restarts (default: off)")
    launch.add_argument(*spellings("max-restarts"), type=int, default=None, metavar="N",
                        help="restart all ranks up to N times when one fails (default: PET_MAX_RESTARTS, else 0); a "
                             "script that calls load_state() on start resumes from its newest checkpoint "
                             "(examples/resume.py)")
    launch.add_argument("--scheduler", choices=schedulers.SCHEDULERS, default=schedulers.AUTO,
                        help="where the node count, this node's rank, the rendezvous and the processes per node come "
                             "from when no flag gives them: a SLURM srun step, Kubernetes (a PyTorchJob, torchrun's "
                             "PET_* variables), or none; default auto (flags always win; docs/multi_node.md)")
    launch.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    accelerate_launch.add_flags(launch)
    fault_tolerant.add_flags(launch)
    launch.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments of the script")

    config = sub.add_parser("config", help="write a config file for `ndparallel launch --config-file`",
                            description="Write the YAML config file. With no flags on a terminal, ask for "
                                        "each value; otherwise write the flags given and defaults.")
    config.add_argument("--config-file", default=DEFAULT_CONFIG_FILE, metavar="PATH",
                        help=f"file to write (default ./{DEFAULT_CONFIG_FILE})")
    config.add_argument("--format", choices=("ndparallel", "accelerate"), default="ndparallel",
                        help="ndparallel's sections (default), or an `accelerate config` file (both are read by "
                             "`ndparallel launch --config-file`)")
    _add_settings_arguments(config)

    env = sub.add_parser("env", help="print versions, devices and backends (for bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON instead of `key: value` lines")

    merge = sub.add_parser("merge-weights", help="convert a checkpoint of save_state into a Hugging Face directory",
                           description="Gather the model weights of a (sharded) checkpoint written by "
                                       "Accelerator.save_state into safetensors shards with an index and the model's "
                                       "config.json, loadable by from_pretrained. Runs in one process, no GPU, "
                                       "reading one output shard at a time.")
    merge.add_argument("checkpoint_dir", metavar="CHECKPOINT", help="a directory written by save_state")
    merge.add_argument("output_dir", metavar="OUTPUT", help="the Hugging Face directory to write")
    merge.add_argument("--model-index", type=int, default=0, metavar="I", help="which prepared model (default 0)")
    merge.add_argument("--max-shard-size", default="10GB", metavar="SIZE",
                       help="largest shard, e.g. 5GB or 500MiB (default 10GB)")
    merge.add_argument("--unsafe-serialization", action="store_true",
                       help="write pytorch_model*.bin (torch.save) instead of safetensors")
    plan_commands.add_parsers(sub)
    return parser


# ---- launch ---------------------------------------------------------------------------------------------
def cmd_launch(args: argparse.Namespace) -> int:
    from .launcher import plan_launch, run_plan

    try:
        plan = plan_launch(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return error("launch", exc)
    for warning in plan.warnings:
        print(f"{PROG} launch: warning: {warning}", file=sys.stderr)
    if plan.origin is not None:
        print(plan.origin, file=sys.stderr)
    print(plan.describe(), file=sys.stderr, flush=True)
    return run_plan(plan)


# ---- config ---------------------------------------------------------------------------------------------
def _ask(label: str, default: Any, parse: Callable[[str], Any]) -> Any:
    """Prompt until the answer parses; an empty answer takes the default."""
    while True:
        answer = input(f"{label} [{default}]: ").strip() or str(default)
        try:
            return parse(answer)
        except ValueError as exc:
            print(f"  invalid value {answer!r}: {exc}", file=sys.stderr)


def _yes_no(text: str) -> bool:
    if text.lower() in ("y", "yes", "true", "1"):
        return True
    if text.lower() in ("n", "no", "false", "0"):
        return False
    raise ValueError("answer yes or no")


def _choice(text: str) -> str:
    if text not in MIXED_PRECISION:
        raise ValueError(f"choose one of {list(MIXED_PRECISION)}")
    return text


def _sizes_given(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in SIZE_FIELDS if getattr(args, name) is not None}


def _checked_sizes(sizes: dict[str, int], nproc_per_node: int | None, nnodes: int) -> ParallelismConfig:
    """Every size explicit (unset: 1), checked against nproc_per_node * nnodes when both are known (else, without -1,
    ep_size against the sizes' product)."""
    pc = ParallelismConfig(**{name: sizes.get(name, 1) for name in SIZE_FIELDS})
    if sizes and nproc_per_node is not None:
        pc.resolve(nproc_per_node * nnodes)
    elif sizes and -1 not in sizes.values():  # the world is their product: ep_size is checked against it
        pc.resolve(pc.total_size)
    return pc


def _prompt_settings(args: argparse.Namespace) -> None:
    import torch

    from .launcher import default_nproc, positive_int

    for name in SIZE_FIELDS:
        size = _ask(name, 1, lambda text, name=name: getattr(_checked_sizes({name: int(text)}, None, 1), name))
        setattr(args, name, None if size == 1 else size)  # all 1: no sizes, as `launch` without size flags
    args.nnodes = _ask("nnodes", 1, lambda text: positive_int("nnodes", int(text)))
    sizes = _sizes_given(args)

    def nproc(text: str) -> int:
        _checked_sizes(sizes, positive_int("nproc_per_node", int(text)), args.nnodes)
        return int(text)

    args.nproc_per_node = _ask("nproc_per_node", default_nproc(sizes, args.nnodes), nproc)
    args.mixed_precision = _ask(f"mixed_precision {list(MIXED_PRECISION)}", "no", _choice)
    args.gradient_accumulation_steps = _ask("gradient_accumulation_steps", 1,
                                            lambda text: positive_int("gradient_accumulation_steps", int(text)))
    args.cpu = _ask("cpu (yes/no)", "no" if torch.cuda.is_available() else "yes", _yes_no)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def cmd_config(args: argparse.Namespace) -> int:
    """Write the config file. Sizes not given are written as 1 when some are given; when none is, the
    ``parallelism`` section stays empty, so ``launch`` passes no sizes (as without size flags)."""
    import yaml

    from .launcher import check_launch_settings, config_file_data, default_nproc, positive_int

    keys = [*SIZE_FIELDS, "nproc_per_node", "nnodes", "mixed_precision", "gradient_accumulation_steps", "cpu"]
    if all(getattr(args, key) is None for key in keys) and sys.stdin.isatty():
        _prompt_settings(args)
    sizes = _sizes_given(args)
    try:
        nnodes = positive_int("--nnodes", _given(args.nnodes, 1))
        if args.nproc_per_node is not None:
            positive_int("--nproc-per-node", args.nproc_per_node)
        pc = _checked_sizes(sizes, args.nproc_per_node, nnodes)
        launch = check_launch_settings({
            "nproc_per_node": _given(args.nproc_per_node, default_nproc(pc.sizes() if sizes else {}, nnodes)),
            "nnodes": nnodes,
            "mixed_precision": _given(args.mixed_precision, "no"),
            "gradient_accumulation_steps": _given(args.gradient_accumulation_steps, 1),
            "cpu": bool(args.cpu),
        }, "ndparallel config")
        data = config_file_data(pc if sizes else None, launch, args.format)
    except (ValueError, TypeError) as exc:
        return error("config", exc)
    path = Path(args.config_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {path}")
    return 0


# ---- env ------------------------------------------------------------------------------------------------
def _optional_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, Any]:
    """Versions, CPUs, CUDA devices, torch.distributed backends and NDPARALLEL_* variables."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    available = dist.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ndparallel": _version(),
        "torch": torch.__version__,
        "transformers": _optional_version("transformers"),
        "accelerate": _optional_version("accelerate"),
        "cpu_count": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_device_count": len(devices),
        "cuda_devices": devices,
        "distributed_available": available,
        "gloo_available": available and dist.is_gloo_available(),
        "nccl_available": available and dist.is_nccl_available(),
        "mpi_available": available and dist.is_mpi_available(),
        "env": {key: value for key, value in sorted(os.environ.items()) if key.startswith(ENV_PREFIX)},
    }


def cmd_env(args: argparse.Namespace) -> int:
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    env = report.pop("env")
    for key, value in report.items():
        print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")
    for key, value in env.items():
        print(f"{key}: {value}")
    if not env:
        print(f"{ENV_PREFIX}*: (none set)")
    return 0


# ---- merge-weights --------------------------------------------------------------------------------------
def cmd_merge_weights(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, merge_weights
    from ..checkpoint.export import describe_output

    try:
        out = merge_weights(args.checkpoint_dir, args.output_dir, model_index=args.model_index,
                            max_shard_size=args.max_shard_size, safe_serialization=not args.unsafe_serialization)
    except (CheckpointError, ValueError, OSError) as exc:
        return error("merge-weights", exc)
    print(f"wrote {describe_output(out)}")
    return 0


# ---- entry point ----------------------------------------------------------------------------------------
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"launch": cmd_launch, "config": cmd_config, "env": cmd_env,
                                                           "merge-weights": cmd_merge_weights, "plan": plan_commands.cmd_plan,
                                                           "estimate-memory": plan_commands.cmd_estimate_memory}


def main(argv: list[str] | None = None) -> int:
    """Run the ``ndparallel`` command with `argv` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
