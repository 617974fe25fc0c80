"""The ``ndparallel`` command: ``launch`` (torchrun with checked sizes), ``config`` (write the YAML file
that ``launch --config-file`` reads), ``env`` (versions, devices, backends, for bug reports), ``merge-weights``
(a sharded checkpoint of ``save_state`` into a Hugging Face directory, offline), ``plan`` (rank the layouts for a
model and a cluster: `ndparallel.planner`) and ``estimate-memory`` (one layout's memory per GPU)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

from ndparallel.launch import accelerate_launch
from ndparallel.config import AXIS_FIELDS, ENV_PREFIX, MIXED_PRECISION, SIZE_FIELDS, ParallelismConfig

DEFAULT_CONFIG_FILE = "ndparallel_config.yaml"
PROG = "ndparallel"


def _version() -> str:
    version = getattr(sys.modules.get("ndparallel"), "__version__", None)
    if version:
        return version
    try:
        return importlib.metadata.version("ndparallel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error(command: str, message: Any) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 2


# ---- arguments ------------------------------------------------------------------------------------------
def _spellings(*names: str) -> list[str]:
    """``--a-b`` and ``--a_b`` for each name: every flag is accepted both ways, as ``accelerate launch`` does."""
    return [f"--{spelling}" for name in names for spelling in dict.fromkeys((name.replace("_", "-"),
                                                                               name.replace("-", "_")))]


def _add_settings_arguments(parser: argparse.ArgumentParser, accelerate_names: bool = False) -> None:
    """Sizes and launch settings shared by ``launch`` and ``config``; None means 'not given'. With
    `accelerate_names`, also ``accelerate launch``'s names for the same settings."""
    sizes = parser.add_argument_group("parallelism sizes (-1: the ranks that are left; unset: 1)")
    for name in SIZE_FIELDS:
        extra = (f"parallelism_config_{name}",) if accelerate_names else ()
        sizes.add_argument(*_spellings(name, *extra), dest=name, type=int, default=None, metavar="N")
    parser.add_argument(*_spellings("nproc-per-node"), type=int, default=None, metavar="N",
                        help="processes per node (default: the product of the sizes, or 1)")
    parser.add_argument(*_spellings("nnodes", *(("num_machines",) if accelerate_names else ())), dest="nnodes",
                        type=int, default=None, metavar="N", help="number of nodes (default 1)")
    parser.add_argument(*_spellings("mixed-precision"), choices=MIXED_PRECISION, default=None,
                        help="sets NDPARALLEL_MIXED_PRECISION for the script")
    parser.add_argument(*_spellings("gradient-accumulation-steps"), type=int, default=None, metavar="N",
                        help="sets NDPARALLEL_GRADIENT_ACCUMULATION_STEPS for the script")
    parser.add_argument("--cpu", action="store_true", default=None,
                        help="run on the CPU with gloo (the default when CUDA is not available)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="N-dimensional parallel training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{launch,config,env,merge-weights,plan,estimate-memory}")

    launch = sub.add_parser("launch", help="start a training script on N processes (wraps torchrun)",
                            description="Check the parallelism sizes, then start SCRIPT on every rank with "
                                        "torchrun. Precedence: flag > --config-file > default. accelerate launch's "
                                        "flags and config files are accepted too (ndparallel.launch.accelerate_launch).")
    launch.add_argument(*_spellings("config-file"), dest="config_file", default=None, metavar="PATH",
                        help="YAML written by `ndparallel config` or by `accelerate config`")
    _add_settings_arguments(launch, accelerate_names=True)
    launch.add_argument(*_spellings("node-rank", "machine_rank"), dest="node_rank", type=int, default=None,
                        metavar="K", help="this node's rank (default 0)")
    launch.add_argument(*_spellings("rdzv-endpoint"), default=None, metavar="HOST:PORT",
                        help="rendezvous address; default: a free local port (one node only)")
    launch.add_argument(*_spellings("rdzv-backend"), choices=("static", "c10d"), default=None,
                        help="with --rdzv-endpoint: static (uses --node-rank) or c10d (default static)")
    launch.add_argument(*_spellings("rdzv-id"), default="ndparallel", help="job id for the c10d rendezvous")
    launch.add_argument(*_spellings("rdzv-timeout"), type=float, default=300.0, metavar="SECONDS",
                        help="with --nnodes > 1: how long the nodes may take to meet at --rdzv-endpoint before the "
                             "launch ends with a message naming the missing or duplicate node ranks (default 300)")
    launch.add_argument(*_spellings("stall-timeout"), type=float, default=None, metavar="SECONDS",
                        help="report and stop a rank that makes no library call for this long (rank, host, last "
                             "call); the job then exits non-zero, or restarts under --max-restarts (default: off)")
    launch.add_argument(*_spellings("max-restarts"), type=int, default=0, metavar="N",
                        help="restart all ranks up to N times when one fails (default 0); a script that calls "
                             "load_state() on start resumes from its newest checkpoint (examples/resume.py)")
    launch.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    accelerate_launch.add_flags(launch)
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
    _add_planner_parsers(sub)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``plan`` and ``estimate-memory`` share: the model, the GPU and the precision."""
    parser.add_argument("--model", required=True, metavar="CONFIG",
                        help="a Hugging Face config.json, a model directory, or a built-in name (llama-3.1-8b, "
                             "llama-3.1-70b, llama-3.1-405b, qwen2.5-7b, qwen2.5-72b, mistral-7b, mixtral-8x7b, "
                             "qwen3-30b-a3b)")
    parser.add_argument("--gpu", default=None, metavar="NAME", help="hardware profile: h100, h200, a100-80g, ...")
    parser.add_argument("--hardware", default=None, metavar="FILE", help="JSON file with your own profile(s)")
    parser.add_argument(*_spellings("seq-len"), dest="seq_len", type=int, default=None, metavar="S",
                        help="tokens per sequence (required, but for plan --max-seq)")
    parser.add_argument(*_spellings("mixed-precision"), dest="mixed_precision", choices=("bf16", "fp32"),
                        default="bf16")
    parser.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    parser.add_argument(*_spellings("memory-gib"), dest="memory_gib", type=float, default=None, metavar="M",
                        help="memory per GPU to plan for (default: the profile's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_planner_parsers(sub: Any) -> None:
    plan = sub.add_parser("plan", help="rank every layout for a model on a cluster (memory, bytes, step time)",
                          description="Enumerate every layout of dp_replicate x dp_shard x cp x sp x tp the library "
                                      "accepts on NODES x GPUS_PER_NODE GPUs, predict memory per GPU, bytes per "
                                      "collective and step time for each, rank them, and print the best as a "
                                      "ParallelismConfig and a config file for `ndparallel launch --config-file`. "
                                      "Formulas and constants: docs/planner.md.")
    _add_model_arguments(plan)
    plan.add_argument("--nodes", type=int, default=1, metavar="N")
    plan.add_argument(*_spellings("gpus-per-node"), dest="gpus_per_node", type=int, default=None, metavar="G",
                      help="default: the profile's (8)")
    plan.add_argument(*_spellings("global-batch-tokens"), dest="global_batch_tokens", type=int, default=None,
                      metavar="T", help="tokens per optimizer step over all GPUs (a multiple of --seq-len; required, "
                                        "but for --max-seq)")
    plan.add_argument(*_spellings("max-seq"), dest="max_seq", action="store_true",
                      help="instead of ranking layouts at --seq-len: the longest sequence each layout trains at "
                           "(one per data-parallel rank), with every memory feature on and with plain FSDP2 + AC")
    for name, what in (("chunked-loss", "the LM head and loss over chunks of tokens (auto: on, as in the library)"),
                       ("tiled-mlp", "decoder MLPs over tiles of the sequence (auto: where it makes a layout fit)"),
                       ("offload", "checkpointed layers' inputs in host memory (auto: where it makes a layout fit)")):
        plan.add_argument(f"--{name}", dest=name.replace("-", "_"), choices=("auto", "on", "off"), default="auto",
                          help=what)
    plan.add_argument(*_spellings("activation-checkpointing"), dest="activation_checkpointing",
                      choices=("auto", "on", "off"), default="auto",
                      help="auto: off where it fits, else on (default)")
    plan.add_argument(*_spellings("sync-each-batch"), dest="sync_each_batch", choices=("auto", "on", "off"),
                      default="auto", help="reduce-scatter gradients every micro-step instead of keeping them "
                                           "unsharded between them (auto: whichever is faster and fits)")
    plan.add_argument(*_spellings("allow-cross-node-tp"), dest="allow_cross_node_tp", action="store_true",
                      help="also consider tensor parallelism across nodes")
    plan.add_argument(*_spellings("ep-size"), dest="ep_size", type=int, default=None, metavar="N",
                      help="a mixture of experts: only layouts with expert parallelism N (default: every ep that "
                           "divides dp_shard x cp x sp and the experts, 1 included)")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="rows to show (default 10)")
    plan.add_argument("--explain", default=None, metavar="LAYOUT",
                      help="break one layout down term by term: a row number of the table or sizes such as "
                           "dp_shard=4,tp=2")
    plan.add_argument(*_spellings("write-config"), dest="write_config", default=None, metavar="PATH",
                      help="also write the best layout's config file here")
    plan.add_argument(*_spellings("measure-top"), dest="measure_top", type=int, default=3, metavar="K",
                      help="with --measure: how many of the best fitting layouts to run (default 3)")
    plan.add_argument("--measure", nargs=argparse.REMAINDER, default=None, metavar="SCRIPT [ARGS]",
                      help="last: run the top layouts of the table on this machine with SCRIPT (through "
                           "ndparallel launch; it must time its steps with accelerator.step_timer) and print "
                           "predicted next to measured tokens/s and peak memory")

    memory = sub.add_parser("estimate-memory", help="memory per GPU of one layout (params, grads, optimizer, "
                                                    "activations, buffers, peak)",
                            description="The memory columns of `ndparallel plan` for one layout given by its sizes "
                                        "(unset sizes: 1; the world is their product; ep_size is carved out of "
                                        "dp_shard x cp x sp). For a mixture-of-experts config: expert parallelism's "
                                        "figures (expert states per rank, all-to-all bytes per step).")
    _add_model_arguments(memory)
    sizes = memory.add_argument_group("parallelism sizes (unset: 1)")
    for name in SIZE_FIELDS:
        sizes.add_argument(*_spellings(name), dest=name, type=int, default=1, metavar="N")
    memory.add_argument(*_spellings("micro-batch-size"), dest="micro_batch_size", type=int, default=1, metavar="B",
                        help="samples per data-parallel rank per micro-step (default 1)")
    memory.add_argument(*_spellings("gradient-accumulation-steps"), dest="gradient_accumulation_steps", type=int,
                        default=1, metavar="N")
    memory.add_argument(*_spellings("activation-checkpointing"), dest="activation_checkpointing",
                        choices=("on", "off"), default="off")
    memory.add_argument(*_spellings("sync-each-batch"), dest="sync_each_batch", action="store_true")
    memory.add_argument("--chunked-loss", dest="chunked_loss", choices=("on", "off"), default="on",
                        help="the chunked loss (default on, as in the library)")
    memory.add_argument("--tiled-mlp", dest="tiled_mlp", action="store_true", help="tiled decoder MLPs")
    memory.add_argument("--offload", action="store_true", help="checkpointed layers' inputs in host memory")


# ---- launch ---------------------------------------------------------------------------------------------
def cmd_launch(args: argparse.Namespace) -> int:
    from ndparallel.launch.launcher import plan_launch, run_plan

    try:
        plan = plan_launch(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return _error("launch", exc)
    for warning in plan.warnings:
        print(f"{PROG} launch: warning: {warning}", file=sys.stderr)
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

    from ndparallel.launch.launcher import default_nproc, positive_int

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


def config_file_data(pc: ParallelismConfig | None, launch: dict[str, Any], fmt: str = "ndparallel") -> dict[str, Any]:
    """What `ndparallel config` writes (and `plan` prints): the ``parallelism`` sizes (empty without a config) and the
    checked ``launch`` settings; with `fmt` "accelerate", an `accelerate config` file instead."""
    if fmt == "accelerate":
        return accelerate_launch.to_file(pc, launch)
    parallelism = {name: value for name, value in pc.to_dict().items() if name in SIZE_FIELDS} if pc else {}
    return {"parallelism": parallelism, "launch": launch}


def cmd_config(args: argparse.Namespace) -> int:
    """Write the config file. Sizes not given are written as 1 when some are given; when none is, the
    ``parallelism`` section stays empty, so ``launch`` passes no sizes (as without size flags)."""
    import yaml

    from ndparallel.launch.launcher import check_launch_settings, default_nproc, positive_int

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
        return _error("config", exc)
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
    from ndparallel.checkpoint import CheckpointError, merge_weights
    from ndparallel.checkpoint.export import describe_output

    try:
        out = merge_weights(args.checkpoint_dir, args.output_dir, model_index=args.model_index,
                            max_shard_size=args.max_shard_size, safe_serialization=not args.unsafe_serialization)
    except (CheckpointError, ValueError, OSError) as exc:
        return _error("merge-weights", exc)
    print(f"wrote {describe_output(out)}")
    return 0


# ---- plan, estimate-memory (ndparallel.planner) ---------------------------------------------------------------
def _plan_config_file(row: Any, nodes: int, gpus_per_node: int) -> dict[str, Any]:
    from ndparallel.launch.launcher import check_launch_settings

    launch = check_launch_settings({"nproc_per_node": gpus_per_node, "nnodes": nodes,
                                    "mixed_precision": "bf16" if row.setting.mixed_precision == "bf16" else "no",
                                    "gradient_accumulation_steps": row.setting.accumulation, "cpu": False},
                                   "ndparallel plan")
    return config_file_data(ParallelismConfig(**row.layout.config_kwargs()), launch)


def _plan_request(args: argparse.Namespace, hardware: Any, model: Any) -> Any:
    from ndparallel.planner import Request

    return Request(model=model, hardware=hardware, nodes=args.nodes,
                   gpus_per_node=args.gpus_per_node or hardware.gpus_per_node, seq_len=args.seq_len,
                   global_batch_tokens=args.global_batch_tokens, memory_gib=args.memory_gib,
                   mixed_precision=args.mixed_precision, checkpointing=args.activation_checkpointing,
                   optimizer=args.optimizer, allow_cross_node_tp=args.allow_cross_node_tp,
                   sync_each_batch=args.sync_each_batch, chunked_loss=args.chunked_loss, tiled_mlp=args.tiled_mlp,
                   offload=args.offload, ep_size=args.ep_size)


def cmd_plan(args: argparse.Namespace) -> int:
    import yaml

    from ndparallel.planner import get_hardware, load_model, parse_layout, plan, row_for
    from ndparallel.planner import report

    if args.max_seq:
        return _plan_max_seq(args)
    try:
        if args.seq_len is None or args.global_batch_tokens is None:
            raise ValueError("--seq-len and --global-batch-tokens are required (or --max-seq)")
        request = _plan_request(args, get_hardware(args.gpu, args.hardware), load_model(args.model))
        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        result = plan(request)
        row = None
        if args.explain is not None:
            text = args.explain.strip().lstrip("#")
            if text.isdigit():
                if not 1 <= int(text) <= len(result.rows):
                    raise ValueError(f"--explain {args.explain}: the table has rows 1 to {len(result.rows)}")
                row = result.rows[int(text) - 1]
            else:
                row = row_for(request, parse_layout(args.explain, request.world))
    except (ValueError, FileNotFoundError) as exc:
        return _error("plan", exc)
    best = result.best
    config = _plan_config_file(best, request.nodes, request.gpus_per_node) if best is not None else None
    measured = None
    if args.measure is not None and best is not None:
        try:
            measured = _plan_measure(args, request, result)
        except ValueError as exc:
            return _error("plan", exc)
    if args.json:
        out = report.plan_json(result, args.top, config)
        if row is not None:
            out["explain"] = report.row_json(row, request.model)
        if measured is not None:
            out["measured"] = [{k: v for k, v in r.items() if k != "row"} for r in measured]
        print(json.dumps(out, indent=1))
    elif row is not None:
        print(report.explain_text(row, request))
    else:
        print(report.header(result), flush=True)
        report.print_table(result, args.top)
        if config is not None:
            print("\n" + report.recommendation(best, yaml.safe_dump(config, sort_keys=False)))
        if measured is not None:
            from ndparallel.planner import measure

            print("\nmeasured on this machine (ranked by measured tokens/s per GPU):\n" + measure.table(measured))
    if measured is not None and not any("error" not in r for r in measured):
        return _error("plan", "no layout could be measured (see the failures above)")
    if config is not None and args.write_config:
        path = Path(args.write_config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"wrote {path}", file=sys.stderr)
    if best is None:
        return _error("plan", result.no_fit_message())
    return 0


def _plan_max_seq(args: argparse.Namespace) -> int:
    """``plan --max-seq``: the longest sequence per layout (`ndparallel.planner.longest`)."""
    from ndparallel.planner import get_hardware, load_model
    from ndparallel.planner.longest import longest, longest_text

    try:
        hardware = get_hardware(args.gpu, args.hardware)
        args.seq_len, args.global_batch_tokens = 1024, 1024  # unused by the search; the request checks them
        request = _plan_request(args, hardware, load_model(args.model))
        rows = longest(request)
    except (ValueError, FileNotFoundError) as exc:
        return _error("plan", exc)
    if args.json:
        print(json.dumps([{"layout": r.layout.sizes(), "name": r.layout.name, "tokens": r.tokens,
                           "peak_bytes": {n: (m.peak if m else None) for n, m in r.memory.items()}} for r in rows],
                         indent=1))
    else:
        print(longest_text(rows, request, args.top))
    return 0 if rows and rows[0].tokens["all"] else _error("plan", "no layout fits even 1024 tokens")


def _plan_measure(args: argparse.Namespace, request: Any, result: Any) -> list[dict[str, Any]]:
    """Run the best fitting layouts with the --measure script (`ndparallel.planner.measure`)."""
    from ndparallel.planner import measure

    if not args.measure:
        raise ValueError("--measure needs a script: --measure SCRIPT [ARGS] (last on the command line)")
    if request.nodes != 1:
        raise ValueError(f"--measure runs the layouts on this machine: use --nodes 1 (got {request.nodes})")
    if args.measure_top < 1:
        raise ValueError(f"--measure-top must be >= 1, got {args.measure_top}")
    rows = [row for row in result.rows if row.fits][:args.measure_top]
    return measure.measure(rows, request.gpus_per_node, args.measure, request.mixed_precision,
                           lambda line: print(line, file=sys.stderr, flush=True))


def _expert_figures(args: argparse.Namespace, layout: Any, setting: Any) -> Any:
    """For a mixture-of-experts config, `planner.experts.expert_figures` of the layout and ep_size; None for a dense
    one (where ep_size > 1 is refused)."""
    from ndparallel.planner.experts import expert_figures, expert_spec
    from ndparallel.planner.model import read_config

    data, where = read_config(args.model)
    spec = expert_spec(data, where)
    if spec is None:
        if args.ep_size != 1:
            raise ValueError(f"--ep-size {args.ep_size}: {where} is not a mixture of experts")
        return None
    return expert_figures(spec, layout.fsdp, args.ep_size, setting.tokens(layout), setting.accumulation,
                          setting.compute_bytes, setting.checkpointing, setting.optimizer)


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    from ndparallel.planner import Layout, Setting, get_hardware, load_model, report
    from ndparallel.planner.layouts import Constraints, reasons
    from ndparallel.planner.memory import estimate

    try:
        layout = Layout(**{name.removesuffix("_size"): getattr(args, name) for name in AXIS_FIELDS}, ep=args.ep_size)
        if min(layout.sizes().values()) < 1 or layout.ep < 1:
            raise ValueError(f"every size must be >= 1, got {layout.all_sizes()}")
        if args.seq_len is None:
            raise ValueError("--seq-len is required")
        setting = Setting(args.seq_len, args.micro_batch_size, args.gradient_accumulation_steps, args.mixed_precision,
                          args.activation_checkpointing == "on", args.optimizer, args.sync_each_batch,
                          args.chunked_loss == "on", args.tiled_mlp, args.offload)
        experts = _expert_figures(args, layout, setting)  # a mixture of experts: expert parallelism's figures
        model = load_model(args.model)
        samples = args.micro_batch_size * args.gradient_accumulation_steps * layout.batch
        why = reasons(layout, Constraints(model, args.seq_len, samples, layout.world, allow_cross_node_tp=True))
        if why:
            raise ValueError(f"layout {layout.name} is refused: {'; '.join(why)}")
        budget, fragmentation = None, 0.0
        if args.gpu or args.hardware:
            hardware = get_hardware(args.gpu, args.hardware)
            budget = ((args.memory_gib or hardware.memory_gib) - hardware.memory_reserve_gib) * 2**30
            fragmentation = hardware.fragmentation
        elif args.memory_gib:
            budget = args.memory_gib * 2**30
        memory = estimate(model, layout, setting, fragmentation)
    except (ValueError, FileNotFoundError) as exc:
        return _error("estimate-memory", exc)
    if args.json:
        print(json.dumps({"layout": layout.sizes(), "ep": layout.ep,
                          **({"experts": vars(experts)} if experts is not None else {}),
                          "memory_bytes": {k: t.bytes for k, t in memory.terms.items()},
                          "activations_bytes": {"checkpointing_off": memory.activations_without_checkpointing,
                                                "checkpointing_on": memory.activations_with_checkpointing},
                          "budget_bytes": budget, "fits": None if budget is None else memory.peak <= budget},
                         indent=1))
    else:
        print(f"{model.name}: {report.model_size(model)}, {layout.world} GPU(s)")
        print(report.memory_text(layout, setting, memory, budget))
        if experts is not None:
            print("\n".join(experts.lines()))
    return 0


# ---- entry point ----------------------------------------------------------------------------------------
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"launch": cmd_launch, "config": cmd_config, "env": cmd_env,
                                                           "merge-weights": cmd_merge_weights, "plan": cmd_plan,
                                                           "estimate-memory": cmd_estimate_memory}


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
