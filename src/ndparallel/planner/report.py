"""How a plan is shown: the ranked table (plain text, or rich in a terminal), JSON for tools, one row explained
term by term, the memory columns alone, and the best layout as the two things a user pastes."""

from __future__ import annotations

import shutil
import sys
from typing import IO, Any

from .comm import KINDS, by_kind, by_link
from .hardware import GiB
from ..distributed.layout import Layout
from .footprint import Memory
from .model import ModelSpec
from .expert_costs import figures
from .offload import host_bytes
from .search import Plan, Request, Row
from .recipe import Recipe, human_bytes

COLUMNS = ("#", "layout", "micro x acc", "AC", "mem", "peak GiB", "fits", "step s", "tok/s/GPU", "MFU",
           "comm GB in/across", "exposed ms")


def _fits(row: Row) -> str:
    return "yes" if row.fits else f"no (+{row.miss / GiB:.1f})"


def ring(layout: Layout, recipe: Recipe) -> bool:
    """Whether the row runs the ring context-parallel attention (``cp_comm_strategy="ring"``; only under cp)."""
    return layout.cp > 1 and recipe.cp_strategy == "ring"


def layout_cell(layout: Layout, recipe: Recipe) -> str:
    """The layout's name, and "(ring)" where its cp attention is the ring (the default all-gather unnamed)."""
    return layout.name + (" (ring)" if ring(layout, recipe) else "")


def config_line(layout: Layout, recipe: Recipe) -> str:
    """The ``ParallelismConfig(...)`` the script builds, with the ring's handler where the row runs the ring."""
    line = layout.config_line()
    if not ring(layout, recipe):
        return line
    return line[:-1] + ', cp_handler=TorchContextParallelConfig(cp_comm_strategy="ring"))'


def row_cells(index: int, row: Row) -> list[str]:
    s, t = row.recipe, row.timing
    links = by_link(row.transfers)
    return [str(index), layout_cell(row.layout, s), f"{s.micro_batch} x {s.accumulation}",
            "on" if s.checkpointing else "off",
            s.features, f"{row.memory.peak / GiB:.1f}", _fits(row), f"{t.step_s:.3f}", f"{t.tokens_per_s_per_gpu:,.0f}",
            f"{t.mfu:.1%}", f"{links['intra'] / 1e9:.1f} / {links['inter'] / 1e9:.1f}", f"{t.exposed_s * 1e3:.0f}"]


def model_size(model: ModelSpec) -> str:
    """``8.03 B parameters``; for a mixture of experts also its experts and what a token goes through."""
    text = f"{model.num_parameters() / 1e9:.2f} B parameters"
    if model.moe is not None:
        e = model.moe.routed
        text += (f" ({model.active_parameters() / 1e9:.2f} B active: top-{e.top_k} of {e.experts} experts in "
                 f"{e.sparse_layers} of {model.layers} layers)")
    return text


def header(plan: Plan) -> str:
    r = plan.request
    fitting = sum(row.fits for row in plan.rows)
    return (f"{r.model.name}: {model_size(r.model)}; {r.nodes} node(s) x "
            f"{r.gpus_per_node} {r.hardware.name} = {r.world} GPUs; seq {r.seq_len}, {r.global_batch_tokens:,} "
            f"tokens ({r.samples} samples) per step, {r.mixed_precision}, {r.optimizer}, budget "
            f"{r.budget_bytes / GiB:.1f} GiB per GPU\n{len(plan.rows)} layouts accepted ({len(plan.refused)} refused), "
            f"{fitting} fit; evaluated in {plan.seconds * 1e3:.0f} ms; mem: C chunked loss, T tiled MLP, N fused "
            "RMSNorm, H head-chunked Ulysses, O activation offload, P parameters, gradients and optimizer state in "
            "host memory (cpu_offload); "
            '(ring): cp attention TorchContextParallelConfig(cp_comm_strategy="ring"), else the all-gather; peak: '
            "predicted "
            "torch.cuda.max_memory_reserved; host memory per GPU "
            + (f"{r.host_budget_bytes / GiB:.1f} GiB" if r.host_budget_bytes is not None else "not checked"))


def table_text(plan: Plan, top: int) -> str:
    rows = [list(COLUMNS)] + [row_cells(i + 1, row) for i, row in enumerate(plan.rows[:top])]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if c not in (1,) else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(plan.rows) > top:
        lines.append(f"... {len(plan.rows) - top} more (--top N)")
    return "\n".join(lines)


def print_table(plan: Plan, top: int, file: IO[str] | None = None) -> None:
    """The ranked table; with rich when writing to a terminal and rich is installed."""
    file = file or sys.stdout
    if file.isatty():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            table = Table(title=None, header_style="bold")
            for c, name in enumerate(COLUMNS):
                table.add_column(name, justify="left" if c == 1 else "right", no_wrap=True)
            for i, row in enumerate(plan.rows[:top]):
                style = "bold green" if i == 0 and row.fits else ("dim" if not row.fits else None)
                table.add_row(*row_cells(i + 1, row), style=style)
            width = shutil.get_terminal_size().columns
            Console(file=file, width=max(width, len(table_text(plan, top).splitlines()[0]) + 40)).print(table)
            if len(plan.rows) > top:
                print(f"... {len(plan.rows) - top} more (--top N)", file=file)
            return
    print(table_text(plan, top), file=file)


def script_settings(recipe: Recipe) -> list[str]:
    """What the script passes for `setting`: the plugin, the memory features, the loader's batch size."""
    checkpointing = '{"every": 1, "offload": True}' if recipe.offload else "True"
    script = ["FullyShardedDataParallelPlugin(fsdp_version=2" + (f", activation_checkpointing={checkpointing}"
                                                               if recipe.checkpointing else "")
              + (", cpu_offload=True" if recipe.offload_params else "") + ")"]
    memory = (([] if recipe.chunked_loss else ["chunked_loss=False"]) + (["tiled_mlp=True"] if recipe.tiled_mlp else [])
              + (["fused_rms_norm=True"] if recipe.fused_norms else [])
              + (['ulysses_head_chunks="auto"'] if recipe.head_chunks else []))
    if memory:
        script.append(f"kwargs_handlers=[MemoryKwargs({', '.join(memory)})]")
    return script + [f"DataLoader(batch_size={recipe.micro_batch})"]


EXPANDABLE_SEGMENTS = ("in the launch environment: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (asked for; the "
                       "allocator's reserve under it is unmeasured until a GPU run records it: the peak above keeps "
                       "the profile's fragmentation)")


def recommendation(row: Row, yaml_text: str, expandable_segments: bool = False) -> str:
    s = row.recipe
    script = script_settings(s)
    if s.sync_each_batch:
        script.append("GradientAccumulationPlugin(sync_each_batch=True)")
    environment = f"{EXPANDABLE_SEGMENTS}\n\n" if expandable_segments else ""
    return (f"best: {layout_cell(row.layout, s)}\n\n{config_line(row.layout, s)}\n\n"
            f"in the script: {', '.join(script)}\n\n"
            f"{environment}# ndparallel launch --config-file plan.yaml SCRIPT\n{yaml_text.rstrip()}")


def memory_terms(memory: Memory) -> list[tuple[str, float, str]]:
    return [(term.name, term.bytes, term.how) for term in memory.terms.values()]


def memory_text(layout: Layout, recipe: Recipe, memory: Memory, budget: float | None = None) -> str:
    """The memory columns of one layout (``ndparallel estimate-memory``)."""
    lines = [f"{layout.name}: micro-batch {recipe.micro_batch} x {recipe.seq_len} tokens, {recipe.mixed_precision}, "
             f"activation checkpointing {'on' if recipe.checkpointing else 'off'}, memory features "
             f"{recipe.features} (C chunked loss, T tiled MLP, N fused RMSNorm, H head-chunked Ulysses, O activation "
             "offload, P cpu_offload)" + (f", cp_comm_strategy={recipe.cp_strategy!r}" if layout.cp > 1 else "")]
    lines += [f"  {name:<26} {value / GiB:9.2f} GiB" for name, value, _ in memory_terms(memory) if name != "peak"]
    lines.append(f"  {'(activations AC off / on)':<26} {memory.activations_without_checkpointing / GiB:9.2f} / "
                 f"{memory.activations_with_checkpointing / GiB:.2f} GiB")
    lines.append(f"  {'peak':<26} {memory.peak / GiB:9.2f} GiB")
    if budget is not None:
        lines.append(f"  fits in {budget / GiB:.1f} GiB" if memory.peak <= budget
                     else f"  misses {budget / GiB:.1f} GiB by {human_bytes(memory.peak - budget)}")
    return "\n".join(lines)


def explain_text(row: Row, request: Request) -> str:
    t, s = row.timing, row.recipe
    lines = [f"layout {layout_cell(row.layout, s)} ({config_line(row.layout, s)}) on {request.world} x "
             f"{request.hardware.name}",
             f"  micro-batch {s.micro_batch} samples x {s.accumulation} accumulation steps per data-parallel rank; "
             f"{s.tokens(row.layout):,} tokens per rank per micro-step", "", "memory per GPU"]
    lines += [f"  {name:<18} {value / GiB:9.3f} GiB   {how}" for name, value, how in memory_terms(row.memory)]
    lines.append(f"  {'budget':<18} {row.budget / GiB:9.3f} GiB   " + ("fits" if row.memory.peak <= row.budget else
                                                                       f"misses by {human_bytes(row.miss)}"))
    host = host_bytes(row.memory)
    if host:
        lines.append(f"  {'host memory':<18} {host / GiB:9.3f} GiB   the host_* terms and the offloaded layer inputs, "
                     + ("budget not known (--host-memory-gib)" if row.host_budget is None else
                        f"of {row.host_budget / GiB:.1f} GiB per GPU: " + ("fits" if row.fits_host else "does not fit")))
    if request.model.moe is not None:  # the figures `estimate-memory --ep-size` prints (planner/experts.py)
        lines += ["", *figures(request.model, row.layout, s).lines()]
    lines += ["", "communication per GPU per step"]
    for item in row.transfers:
        lines.append(f"  {item.purpose:<40} {item.kind:<14} {item.link:<5} {item.bytes / 2**20:12.2f} MiB "
                     f"{item.calls:6d} calls  {t.comm_s.get(item.purpose, 0.0) * 1e3:8.2f} ms  "
                     f"({'overlaps' if item.overlappable else 'critical'}; n={item.group_size}: {item.how})")
    kinds = by_kind(row.transfers)
    lines.append("  by collective: " + ", ".join(f"{k} {kinds[k] / 2**20:.2f} MiB" for k in KINDS if k in kinds))
    links = by_link(row.transfers)
    lines.append(f"  by link: inside a node {links['intra'] / 2**20:.2f} MiB, across nodes "
                 f"{links['inter'] / 2**20:.2f} MiB")
    lines += ["", "time per step",
              f"  compute    {t.compute_s * 1e3:10.2f} ms   {t.how['compute']}",
              f"  exposed    {t.exposed_s * 1e3:10.2f} ms   {t.how['exposed']}",
              f"  optimizer  {t.optimizer_s * 1e3:10.2f} ms   {t.how['optimizer']}",
              f"  step       {t.step_s * 1e3:10.2f} ms   -> {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU "
              f"{t.mfu:.1%} (FLOPs per token {request.model.flops_per_token(s.seq_len) / 1e9:.2f} G, "
              f"ndparallel.training.metrics convention)"]
    return "\n".join(lines)


def row_json(row: Row, model: ModelSpec | None = None) -> dict[str, Any]:
    t, s = row.timing, row.recipe
    experts = {"experts": vars(figures(model, row.layout, s))} if model is not None and model.moe else {}
    return {**experts,
        "layout": row.layout.sizes(), "ep": row.layout.ep, "name": row.layout.name,
        "parallelism_config": config_line(row.layout, s),
        "micro_batch": s.micro_batch, "gradient_accumulation_steps": s.accumulation,
        "activation_checkpointing": s.checkpointing, "chunked_loss": s.chunked_loss, "tiled_mlp": s.tiled_mlp,
        "fused_rms_norm": s.fused_norms, "head_chunks": s.head_chunks,
        "cp_comm_strategy": s.cp_strategy if row.layout.cp > 1 else None, "offload": s.offload,
        "offload_params": s.offload_params, "fits": row.fits,
        "miss_bytes": row.miss,
        "host_bytes": host_bytes(row.memory), "host_budget_bytes": row.host_budget,
        "memory_bytes": {name: term.bytes for name, term in row.memory.terms.items()},
        "activations_bytes": {"checkpointing_off": row.memory.activations_without_checkpointing,
                              "checkpointing_on": row.memory.activations_with_checkpointing},
        "comm_bytes": {"by_collective": by_kind(row.transfers), "by_link": by_link(row.transfers),
                       "transfers": [{"purpose": i.purpose, "kind": i.kind, "axes": list(i.axes),
                                      "group_size": i.group_size, "link": i.link, "bytes": i.bytes, "calls": i.calls,
                                      "overlappable": i.overlappable} for i in row.transfers]},
        "time_s": {"compute": t.compute_s, "communication": t.comm_s, "exposed_communication": t.exposed_s,
                   "optimizer": t.optimizer_s, "step": t.step_s},
        "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
    }


def plan_json(plan: Plan, top: int, config_file: dict[str, Any] | None) -> dict[str, Any]:
    r = plan.request
    return {
        "request": {"model": r.model.name, "gpu": r.hardware.name, "nodes": r.nodes, "gpus_per_node": r.gpus_per_node,
                    "seq_len": r.seq_len, "global_batch_tokens": r.global_batch_tokens,
                    "mixed_precision": r.mixed_precision, "optimizer": r.optimizer,
                    "activation_checkpointing": r.checkpointing, "budget_bytes": r.budget_bytes,
                    "ep_size": r.ep_size},
        "rows": [row_json(row, r.model) for row in plan.rows[:top]],
        "accepted": len(plan.rows), "refused": {layout.name: why for layout, why in plan.refused.items()},
        "best": None if plan.best is None else {"name": plan.best.layout.name,
                                                "parallelism_config": config_line(plan.best.layout,
                                                                                  plan.best.recipe),
                                                "config_file": config_file},
    }
