"""``ndparallel plan`` (rank the layouts for a model and a cluster) and ``ndparallel estimate-memory`` (one layout's
memory per GPU): their arguments and what they print, over `ndparallel.planner`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..configuration.parallelism import AXIS_FIELDS, SIZE_FIELDS, ParallelismConfig
from .arguments import error, spellings


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``plan`` and ``estimate-memory`` share: the model, the GPU and the precision."""
    parser.add_argument("--model", required=True, metavar="CONFIG",
                        help="a Hugging Face config.json, a model directory, or a built-in name (llama-3.1-8b, "
                             "llama-3.1-70b, llama-3.1-405b, qwen2.5-7b, qwen2.5-72b, mistral-7b, mixtral-8x7b, "
                             "qwen3-30b-a3b)")
    parser.add_argument("--gpu", default=None, metavar="NAME", help="hardware profile: h100, h200, a100-80g, ...")
    parser.add_argument("--hardware", default=None, metavar="FILE", help="JSON file with your own profile(s)")
    parser.add_argument(*spellings("seq-len"), dest="seq_len", type=int, default=None, metavar="S",
                        help="tokens per sequence (required, but for plan --max-seq)")
    parser.add_argument(*spellings("mixed-precision"), dest="mixed_precision", choices=("bf16", "fp32"),
                        default="bf16")
    parser.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    parser.add_argument(*spellings("memory-gib"), dest="memory_gib", type=float, default=None, metavar="M",
                        help="memory per GPU to plan for (default: the profile's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def add_parsers(sub: Any) -> None:
    """The ``plan`` and ``estimate-memory`` subcommands' parsers, under `sub`."""
    plan = sub.add_parser("plan", help="rank every layout for a model on a cluster (memory, bytes, step time)",
                          description="Enumerate every layout of dp_replicate x dp_shard x cp x sp x tp the library "
                                      "accepts on NODES x GPUS_PER_NODE GPUs, predict memory per GPU, bytes per "
                                      "collective and step time for each, rank them, and print the best as a "
                                      "ParallelismConfig and a config file for `ndparallel launch --config-file`. "
                                      "Formulas and constants: docs/planner.md.")
    _add_model_arguments(plan)
    plan.add_argument("--nodes", type=int, default=1, metavar="N")
    plan.add_argument(*spellings("gpus-per-node"), dest="gpus_per_node", type=int, default=None, metavar="G",
                      help="default: the profile's (8)")
    plan.add_argument(*spellings("global-batch-tokens"), dest="global_batch_tokens", type=int, default=None,
                      metavar="T", help="tokens per optimizer step over all GPUs (a multiple of --seq-len; required, "
                                        "but for --max-seq)")
    plan.add_argument(*spellings("max-seq"), dest="max_seq", action="store_true",
                      help="instead of ranking layouts at --seq-len: the longest sequence each layout trains at "
                           "(one per data-parallel rank), with every memory feature on and with plain FSDP2 + AC")
    for name, what in (("chunked-loss", "the LM head and loss over chunks of tokens (auto: on, as in the library)"),
                       ("tiled-mlp", "decoder MLPs over tiles of the sequence (auto: where it makes a layout fit)"),
                       ("fused-rms-norm", "RMSNorms that keep no fp32 copy of their input, "
                                          "MemoryKwargs(fused_rms_norm=True) (auto: where it makes a layout fit)"),
                       ("ulysses-head-chunks", "attention over groups of heads under cp or sp, as many as the "
                                               "library's \"auto\" picks, MemoryKwargs(ulysses_head_chunks=\"auto\") "
                                               "(auto: where it makes a layout, or a larger micro-batch, fit; with "
                                               "--max-seq where it makes the sequence longer)"),
                       ("offload", "checkpointed layers' inputs in host memory (auto: where it makes a layout fit)"),
                       ("offload-params", "FSDP2's CPU offload, FullyShardedDataParallelPlugin(cpu_offload=True): "
                                          "parameters, gradients and optimizer state in host memory, the optimizer "
                                          "step on the host (auto: where it makes a layout fit or run faster)")):
        plan.add_argument(f"--{name}", dest=name.replace("-", "_"), choices=("auto", "on", "off"), default="auto",
                          help=what)
    plan.add_argument(*spellings("cp-comm-strategy"), dest="cp_comm_strategy", choices=("auto", "allgather", "ring"),
                      default="auto",
                      help="the context-parallel attention, TorchContextParallelConfig(cp_comm_strategy=...): the "
                           "all-gather (the library's default) or the ring (auto: both, where cp > 1; the ring where "
                           "it makes a layout, a larger micro-batch or, with --max-seq, a longer sequence fit)")
    plan.add_argument(*spellings("expandable-segments"), dest="expandable_segments", action="store_true",
                      help="the recipe sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the allocator's reserve "
                           "under it is unmeasured, so the profile's fragmentation is kept")
    plan.add_argument(*spellings("host-memory-gib"), dest="host_memory_gib", type=float, default=None, metavar="H",
                      help="host (CPU) memory per node for offloading, shared by its GPUs' processes (default: the "
                           "profile's; 0: not checked)")
    plan.add_argument(*spellings("activation-checkpointing"), dest="activation_checkpointing",
                      choices=("auto", "on", "off"), default="auto",
                      help="auto: off where it fits, else on (default)")
    plan.add_argument(*spellings("sync-each-batch"), dest="sync_each_batch", choices=("auto", "on", "off"),
                      default="auto", help="reduce-scatter gradients every micro-step instead of keeping them "
                                           "unsharded between them (auto: whichever is faster and fits)")
    plan.add_argument(*spellings("allow-cross-node-tp"), dest="allow_cross_node_tp", action="store_true",
                      help="also consider tensor parallelism across nodes")
    plan.add_argument(*spellings("ep-size"), dest="ep_size", type=int, default=None, metavar="N",
                      help="a mixture of experts: only layouts with expert parallelism N (default: every ep that "
                           "divides dp_shard x cp x sp and the experts, 1 included)")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="rows to show (default 10)")
    plan.add_argument("--explain", default=None, metavar="LAYOUT",
                      help="break one layout down term by term: a row number of the table or sizes such as "
                           "dp_shard=4,tp=2")
    plan.add_argument(*spellings("write-config"), dest="write_config", default=None, metavar="PATH",
                      help="also write the best layout's config file here")
    plan.add_argument("--plot", default=None, metavar="FILE",
                      help="also draw the plan to FILE (.png, .svg, .pdf: by its suffix): each top layout's memory "
                           "per GPU by term against the budget; with --max-seq the peak against the sequence length "
                           "with and without each feature (needs matplotlib: pip install 'ndparallel[plot]')")
    plan.add_argument(*spellings("measure-top"), dest="measure_top", type=int, default=3, metavar="K",
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
        sizes.add_argument(*spellings(name), dest=name, type=int, default=1, metavar="N")
    memory.add_argument(*spellings("micro-batch-size"), dest="micro_batch_size", type=int, default=1, metavar="B",
                        help="samples per data-parallel rank per micro-step (default 1)")
    memory.add_argument(*spellings("gradient-accumulation-steps"), dest="gradient_accumulation_steps", type=int,
                        default=1, metavar="N")
    memory.add_argument(*spellings("activation-checkpointing"), dest="activation_checkpointing",
                        choices=("on", "off"), default="off")
    memory.add_argument(*spellings("sync-each-batch"), dest="sync_each_batch", action="store_true")
    memory.add_argument("--chunked-loss", dest="chunked_loss", choices=("on", "off"), default="on",
                        help="the chunked loss (default on, as in the library)")
    memory.add_argument("--tiled-mlp", dest="tiled_mlp", action="store_true", help="tiled decoder MLPs")
    memory.add_argument(*spellings("fused-rms-norm"), dest="fused_rms_norm", action="store_true",
                        help="fused RMSNorms (MemoryKwargs(fused_rms_norm=True))")
    memory.add_argument("--offload", action="store_true", help="checkpointed layers' inputs in host memory")
    memory.add_argument(*spellings("ulysses-head-chunks"), dest="ulysses_head_chunks", action="store_true",
                        help="Ulysses attention over head chunks, as many as the library's \"auto\" picks "
                             "(MemoryKwargs(ulysses_head_chunks=\"auto\"); cp or sp > 1)")
    memory.add_argument(*spellings("cp-comm-strategy"), dest="cp_comm_strategy", choices=("allgather", "ring"),
                        default="allgather", help="the context-parallel attention under cp > 1, "
                                                  "TorchContextParallelConfig(cp_comm_strategy=...) (default: the "
                                                  "library's, allgather)")
    memory.add_argument(*spellings("offload-params"), dest="offload_params", action="store_true",
                        help="FSDP2's CPU offload (cpu_offload=True): parameters, gradients, optimizer state in host "
                             "memory")


# ---- plan, estimate-memory (ndparallel.planner) ---------------------------------------------------------------
def _plan_config_file(row: Any, nodes: int, gpus_per_node: int) -> dict[str, Any]:
    from .launcher import check_launch_settings, config_file_data

    launch = check_launch_settings({"nproc_per_node": gpus_per_node, "nnodes": nodes,
                                    "mixed_precision": "bf16" if row.recipe.mixed_precision == "bf16" else "no",
                                    "gradient_accumulation_steps": row.recipe.accumulation, "cpu": False},
                                   "ndparallel plan")
    return config_file_data(ParallelismConfig(**row.layout.config_kwargs()), launch)


def _plan_request(args: argparse.Namespace, hardware: Any, model: Any) -> Any:
    from ..planner import Request

    return Request(model=model, hardware=hardware, nodes=args.nodes,
                   gpus_per_node=args.gpus_per_node or hardware.gpus_per_node, seq_len=args.seq_len,
                   global_batch_tokens=args.global_batch_tokens, memory_gib=args.memory_gib,
                   mixed_precision=args.mixed_precision, checkpointing=args.activation_checkpointing,
                   optimizer=args.optimizer, allow_cross_node_tp=args.allow_cross_node_tp,
                   sync_each_batch=args.sync_each_batch, chunked_loss=args.chunked_loss, tiled_mlp=args.tiled_mlp,
                   fused_rms_norm=args.fused_rms_norm, head_chunks=args.ulysses_head_chunks, offload=args.offload,
                   cp_strategy=args.cp_comm_strategy,
                   offload_params=args.offload_params,
                   host_memory_gib=args.host_memory_gib, ep_size=args.ep_size,
                   expandable_segments=args.expandable_segments)


def cmd_plan(args: argparse.Namespace) -> int:
    import yaml

    from ..planner import get_hardware, load_model, parse_layout, plan, report, row_for

    if args.plot is not None:  # before the search: a missing matplotlib or an unknown format costs nothing
        from ..planner import plot

        try:
            plot.check(args.plot)
        except (ImportError, ValueError) as exc:
            return error("plan", exc)
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
        return error("plan", exc)
    best = result.best
    config = _plan_config_file(best, request.nodes, request.gpus_per_node) if best is not None else None
    measured = None
    if args.measure is not None and best is not None:
        try:
            measured = _plan_measure(args, request, result)
        except ValueError as exc:
            return error("plan", exc)
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
            print("\n" + report.recommendation(best, yaml.safe_dump(config, sort_keys=False),
                                                request.expandable_segments))
        if measured is not None:
            from ..planner import measure

            print("\nmeasured on this machine (ranked by measured tokens/s per GPU):\n" + measure.table(measured))
    if args.plot is not None:
        print(f"wrote {plot.save(plot.plan_figure(result, args.top), args.plot)}", file=sys.stderr)
    if measured is not None and not any("error" not in r for r in measured):
        return error("plan", "no layout could be measured (see the failures above)")
    if config is not None and args.write_config:
        path = Path(args.write_config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"wrote {path}", file=sys.stderr)
    if best is None:
        return error("plan", result.no_fit_message())
    return 0


def _plan_max_seq(args: argparse.Namespace) -> int:
    """``plan --max-seq``: the longest sequence per layout (`ndparallel.planner.longest`)."""
    from ..planner import get_hardware, load_model
    from ..planner.longest import longest, longest_text
    from ..planner.offload import host_bytes

    try:
        hardware = get_hardware(args.gpu, args.hardware)
        args.seq_len, args.global_batch_tokens = 1024, 1024  # unused by the search; the request checks them
        request = _plan_request(args, hardware, load_model(args.model))
        rows = longest(request)
    except (ValueError, FileNotFoundError) as exc:
        return error("plan", exc)
    if args.json:
        print(json.dumps([{"layout": r.layout.sizes(), "name": r.layout.name, "tokens": r.tokens,
                           "offload_params": r.offload_params, "tokens_without_offload_params": r.without_offload,
                           "head_chunks": r.head_chunks, "tokens_without_head_chunks": r.without_chunks,
                           "cp_comm_strategy": r.cp_strategy if r.layout.cp > 1 else None,
                           "tokens_with_other_cp_strategy": r.other_strategy,
                           "peak_bytes": {n: (m.peak if m else None) for n, m in r.memory.items()},
                           "host_bytes": {n: (host_bytes(m) if m else None) for n, m in r.memory.items()}}
                          for r in rows], indent=1))
    else:
        print(longest_text(rows, request, args.top))
    if args.plot is not None and rows:
        from ..planner import plot

        print(f"wrote {plot.save(plot.max_seq_figure(rows[0], request), args.plot)}", file=sys.stderr)
    return 0 if rows and rows[0].tokens["all"] else error("plan", "no layout fits even 1024 tokens")


def _plan_measure(args: argparse.Namespace, request: Any, result: Any) -> list[dict[str, Any]]:
    """Run the best fitting layouts with the --measure script (`ndparallel.planner.measure`)."""
    from ..planner import measure

    if not args.measure:
        raise ValueError("--measure needs a script: --measure SCRIPT [ARGS] (last on the command line)")
    if request.nodes != 1:
        raise ValueError(f"--measure runs the layouts on this machine: use --nodes 1 (got {request.nodes})")
    if args.measure_top < 1:
        raise ValueError(f"--measure-top must be >= 1, got {args.measure_top}")
    rows = [row for row in result.rows if row.fits][:args.measure_top]
    return measure.measure(rows, request.gpus_per_node, args.measure, request.mixed_precision,
                           lambda line: print(line, file=sys.stderr, flush=True))


def _expert_figures(args: argparse.Namespace, layout: Any, recipe: Any) -> Any:
    """For a mixture-of-experts config, `planner.experts.expert_figures` of the layout and ep_size; None for a dense
    one (where ep_size > 1 is refused)."""
    from ..planner.experts import expert_figures, expert_spec
    from ..planner.model import read_config

    data, where = read_config(args.model)
    spec = expert_spec(data, where)
    if spec is None:
        if args.ep_size != 1:
            raise ValueError(f"--ep-size {args.ep_size}: {where} is not a mixture of experts")
        return None
    return expert_figures(spec, layout.fsdp, args.ep_size, recipe.tokens(layout), recipe.accumulation,
                          recipe.compute_bytes, recipe.checkpointing, recipe.optimizer)


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    from ..planner import Layout, Recipe, get_hardware, load_model, report
    from ..planner.layouts import Constraints, reasons
    from ..planner.footprint import estimate

    try:
        layout = Layout(**{name.removesuffix("_size"): getattr(args, name) for name in AXIS_FIELDS}, ep=args.ep_size)
        if min(layout.sizes().values()) < 1 or layout.ep < 1:
            raise ValueError(f"every size must be >= 1, got {layout.all_sizes()}")
        if args.seq_len is None:
            raise ValueError("--seq-len is required")
        recipe = Recipe(args.seq_len, args.micro_batch_size, args.gradient_accumulation_steps, args.mixed_precision,
                          args.activation_checkpointing == "on", args.optimizer, args.sync_each_batch,
                          args.chunked_loss == "on", args.tiled_mlp, args.offload, offload_params=args.offload_params,
                          fused_norms=args.fused_rms_norm, head_chunks=args.ulysses_head_chunks,
                          cp_strategy=args.cp_comm_strategy)
        experts = _expert_figures(args, layout, recipe)  # a mixture of experts: expert parallelism's figures
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
        memory = estimate(model, layout, recipe, fragmentation)
    except (ValueError, FileNotFoundError) as exc:
        return error("estimate-memory", exc)
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
        print(report.memory_text(layout, recipe, memory, budget))
        if experts is not None:
            print("\n".join(experts.lines()))
    return 0
