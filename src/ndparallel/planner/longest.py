"""``ndparallel plan --max-seq``: the longest sequence a model trains at on the given GPUs, per layout.

For every layout of the world (pipeline stages left out: one micro-batch of one sequence per data-parallel rank;
each ep of a mixture of experts apart),
the longest sequence -- a multiple of ``QUANTUM`` tokens that the layout can split -- whose predicted peak
(`memory.estimate`, the allocator's fragmentation included) fits the budget, found by bisection (memory grows with
the length). Two settings side by side: every memory feature on (activation checkpointing with offloading, the
chunked loss, tiled MLPs) and plain FSDP2 with activation checkpointing (the model's own loss). Memory only: at these
lengths the step time is what the rows of ``ndparallel plan --seq-len S`` predict.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import Constraints, Layout, all_layouts, expert_layouts, reasons
from .memory import Memory, estimate
from .search import Request
from .setting import Setting

QUANTUM = 1024
LIMIT = 2**25  # 32 M tokens: searched no further
SETTINGS = {  # name -> (checkpointing, chunked loss, tiled MLP, offload)
    "all": (True, True, True, True),
    "plain": (True, False, False, False),
}


@dataclass(frozen=True)
class Longest:
    layout: Layout
    tokens: dict[str, int]  # setting name -> longest sequence (0: not even QUANTUM tokens fit)
    memory: dict[str, Memory | None]  # at that length


def _setting(name: str, seq: int, precision: str, optimizer: str) -> Setting:
    ac, loss, tiled, offload = SETTINGS[name]
    return Setting(seq, 1, 1, precision, ac, optimizer, False, loss, tiled, offload)


def _constraints(layout: Layout, seq: int, request: Request) -> Constraints:
    return Constraints(request.model, seq, layout.batch, request.gpus_per_node, request.allow_cross_node_tp,
                       request.ep_size)


def _accepts(layout: Layout, seq: int, request: Request) -> bool:
    return not reasons(layout, _constraints(layout, seq, request))


def _fits(layout: Layout, seq: int, name: str, request: Request) -> Memory | None:
    memory = estimate(request.model, layout, _setting(name, seq, request.mixed_precision, request.optimizer),
                      request.hardware.fragmentation)
    return memory if memory.peak <= request.budget_bytes else None


def longest_for(layout: Layout, name: str, request: Request) -> tuple[int, Memory | None]:
    """The longest multiple of the layout's step (QUANTUM x 2 cp x sp) that fits, and its memory."""
    step = QUANTUM * 2 * layout.cp * layout.sp
    if not _accepts(layout, step, request) or _fits(layout, step, name, request) is None:
        return 0, None
    lo, hi = 1, 2
    while hi * step <= LIMIT and _fits(layout, hi * step, name, request) is not None:
        lo, hi = hi, 2 * hi
    if hi * step > LIMIT:
        return lo * step, _fits(layout, lo * step, name, request)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(layout, mid * step, name, request) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, _fits(layout, lo * step, name, request)


def longest(request: Request) -> list[Longest]:
    """Every layout without pipeline stages, by its longest sequence with all features on, longest first."""
    out = []
    meshes = [mesh for mesh in all_layouts(request.world) if mesh.pp == 1]
    for layout in (x for mesh in meshes for x in expert_layouts(mesh, _constraints(mesh, QUANTUM, request))):
        if not _accepts(layout, QUANTUM * 2 * layout.cp * layout.sp, request):
            continue
        found = {name: longest_for(layout, name, request) for name in SETTINGS}
        out.append(Longest(layout, {n: f[0] for n, f in found.items()}, {n: f[1] for n, f in found.items()}))
    out.sort(key=lambda row: (-row.tokens["all"], -row.tokens["plain"], row.layout.name))
    return out


def longest_text(rows: list[Longest], request: Request, top: int) -> str:
    gib = 2**30
    lines = [f"{request.model.name} on {request.world} x {request.hardware.name} ({request.budget_bytes / gib:.1f} GiB "
             f"per GPU), {request.mixed_precision}, {request.optimizer}: the longest sequence per layout, one "
             "sequence per data-parallel rank",
             "all: activation checkpointing with offloading, chunked loss, tiled MLP; plain: FSDP2 with activation "
             "checkpointing and the model's own loss", ""]
    header = f"{'#':>3}  {'layout':<34} {'all: tokens':>12} {'peak GiB':>9} {'host GiB':>9} {'plain: tokens':>14} " \
             f"{'ratio':>7}"
    lines += [header, "-" * len(header)]
    for i, row in enumerate(rows[:top]):
        mem = row.memory["all"]
        peak = f"{mem.peak / gib:.1f}" if mem else "-"
        host = f"{mem['host_offload'] / gib:.1f}" if mem else "-"
        ratio = f"{row.tokens['all'] / row.tokens['plain']:.1f}x" if row.tokens["plain"] else "-"
        lines.append(f"{i + 1:>3}  {row.layout.name:<34} {row.tokens['all']:>12,} {peak:>9} {host:>9} "
                     f"{row.tokens['plain']:>14,} {ratio:>7}")
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more (--top N)")
    fsdp = next((r for r in rows if r.layout == Layout(dp_shard=request.world)), None)
    best_plain = max(rows, key=lambda r: r.tokens["plain"]) if rows else None
    if rows:
        lines += ["", f"longest with every feature: {rows[0].tokens['all']:,} tokens ({rows[0].layout.name}); without "
                  f"them (plain FSDP2 + AC): {best_plain.tokens['plain']:,} ({best_plain.layout.name})"
                  + (f"; plain FSDP2 over all {request.world} GPUs: {fsdp.tokens['plain']:,}" if fsdp else "")]
    return "\n".join(lines)
