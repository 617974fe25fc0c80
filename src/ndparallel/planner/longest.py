"""``ndparallel plan --max-seq``: the longest sequence a model trains at on the given GPUs, per layout.

For every layout of the world (pipeline stages left out: one micro-batch of one sequence per data-parallel rank;
each ep of a mixture of experts apart),
the longest sequence -- a multiple of ``QUANTUM`` tokens that the layout can split -- whose predicted peak
(`memory.estimate`, the allocator's fragmentation included) fits the budget, and whose host memory (offloaded layer
inputs and states, `offload.host_bytes`) fits each GPU's share of the node's, found by bisection (memory grows with
the length). Two settings side by side: every memory feature on (activation checkpointing with offloading, the
chunked loss, tiled MLPs, fused RMSNorms; under cp or sp head-chunked attention (``--ulysses-head-chunks auto``) where
it makes the sequence longer, as many chunks as the library's "auto" picks at that length; and FSDP2's CPU offload of the parameters,
gradients and optimizer state as ``--offload-params`` allows it: with ``auto`` the longer of with and without, and the
row says whether it needs it)
and plain FSDP2 with activation checkpointing (the model's own loss). Memory only: at these lengths the step time is
what the rows of ``ndparallel plan --seq-len S`` predict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .layouts import Constraints, Layout, all_layouts, expert_layouts, reasons
from .footprint import Memory, backward_transient, estimate, head_chunks
from .offload import host_bytes
from .search import OPTIONS, Request, cp_strategies
from .recipe import Recipe
from .report import config_line

QUANTUM = 1024
STRATEGY_CELL = {"allgather": "ag", "ring": "ring"}  # the table's cp column
LIMIT = 2**25  # 32 M tokens: searched no further
SETTINGS = {  # name -> (checkpointing, chunked loss, tiled MLP, offload, fused RMSNorm)
    "all": (True, True, True, True, True),
    "plain": (True, False, False, False, False),
}


# The features "all" turns on, by the letter of the `mem` column (`Recipe.features`): (name, the Recipe field that
# turns it off). P: FSDP2's CPU offload, which "all" takes where --offload-params allows it and it helps.
FEATURES = {"C": ("chunked loss", "chunked_loss"), "T": ("tiled MLP", "tiled_mlp"),
            "N": ("fused RMSNorm", "fused_norms"), "H": ("head-chunked Ulysses", "head_chunks"),
            "O": ("activation offload", "offload"),
            "P": ("FSDP2's CPU offload", "offload_params")}


@dataclass(frozen=True)
class Longest:
    layout: Layout
    tokens: dict[str, int]  # setting name -> longest sequence (0: not even QUANTUM tokens fit)
    memory: dict[str, Memory | None]  # at that length
    offload_params: bool = False  # whether "all" keeps the states in host memory (FSDP2's cpu_offload) for it
    without_offload: int | None = None  # "all" without that offload (None: not tried, --offload-params on)
    head_chunks: bool = False  # whether "all" runs Ulysses attention over head chunks ("auto"'s count) for it
    without_chunks: int | None = None  # "all" without head chunks (None: not tried, no cp or sp)
    cp_strategy: str = "allgather"  # the cp attention "all" runs for it (TorchContextParallelConfig(cp_comm_strategy))
    other_strategy: int | None = None  # "all" with the other cp strategy (None: not tried, no cp)


def _setting(name: str, seq: int, precision: str, optimizer: str, params: bool = False,
             chunks: bool = False, strategy: str = "allgather") -> Recipe:
    ac, loss, tiled, offload, norms = SETTINGS[name]
    return Recipe(seq, 1, 1, precision, ac, optimizer, False, loss, tiled, offload, offload_params=params,
                  fused_norms=norms, head_chunks=chunks, cp_strategy=strategy)


def _constraints(layout: Layout, seq: int, request: Request) -> Constraints:
    return Constraints(request.model, seq, layout.batch, request.gpus_per_node, request.allow_cross_node_tp,
                       request.ep_size)


def _accepts(layout: Layout, seq: int, request: Request) -> bool:
    return not reasons(layout, _constraints(layout, seq, request))


def _fits(layout: Layout, seq: int, name: str, request: Request, params: bool = False,
          chunks: bool = False, strategy: str = "allgather") -> Memory | None:
    memory = estimate(request.model, layout, _setting(name, seq, request.mixed_precision, request.optimizer, params,
                                                      chunks, strategy), request.hardware.fragmentation)
    return memory if request.fits(memory) else None


def longest_for(layout: Layout, name: str, request: Request, params: bool = False,
                chunks: bool = False, strategy: str = "allgather") -> tuple[int, Memory | None]:
    """The longest multiple of the layout's step (QUANTUM x `Layout.sequence_divisor`) that fits, and its memory;
    `params`: with FSDP2's CPU offload; `chunks`: with head-chunked Ulysses attention ("auto"); `strategy`: the cp
    attention's (``cp_comm_strategy``)."""
    step = QUANTUM * layout.sequence_divisor

    def fits(k: int) -> Memory | None:
        return _fits(layout, k * step, name, request, params, chunks, strategy)

    if not _accepts(layout, step, request) or fits(1) is None:
        return 0, None
    lo, hi = 1, 2
    while hi * step <= LIMIT and fits(hi) is not None:
        lo, hi = hi, 2 * hi
    if hi * step > LIMIT:
        return lo * step, fits(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, fits(lo)


def longest_all(layout: Layout, request: Request) -> Longest:
    """Every feature on (`Longest`'s "all" fields; "plain" left for the caller): the offload as ``--offload-params``
    allows ("auto" takes it only where it makes the sequence longer), head chunks under cp or sp only where they make
    it longer (they can hold more than they free: `footprint.attention_backward`), and under cp the strategy
    (``cp_comm_strategy``, `search.cp_strategies`) that makes it longer, the all-gather where they tie."""
    chunk_options = OPTIONS[request.head_chunks] if layout.seq_split > 1 else (False,)
    strategies = cp_strategies(request, layout)
    found = {(params, chunks, strategy): longest_for(layout, "all", request, params, chunks, strategy)
             for params in OPTIONS[request.offload_params] for chunks in chunk_options for strategy in strategies}
    best = max(found, key=lambda k: (found[k][0], not k[0], not k[1], k[2] == "allgather"))
    params, chunks, strategy = best
    without = found[(False, chunks, strategy)][0] if (False, chunks, strategy) in found else None
    unchunked = found[(params, False, strategy)][0] if layout.seq_split > 1 and (params, False, strategy) in found \
        else None
    other = next((found[(params, chunks, s)][0] for s in strategies if s != strategy), None)
    tokens, memory = found[best]
    return Longest(layout, {"all": tokens}, {"all": memory}, params, without, chunks, unchunked, strategy, other)


def longest(request: Request) -> list[Longest]:
    """Every layout without pipeline stages, by its longest sequence with all features on, longest first."""
    out = []
    meshes = [mesh for mesh in all_layouts(request.world) if mesh.pp == 1]
    for layout in (x for mesh in meshes for x in expert_layouts(mesh, _constraints(mesh, QUANTUM, request))):
        if not _accepts(layout, QUANTUM * layout.sequence_divisor, request):
            continue
        row = longest_all(layout, request)
        plain = longest_for(layout, "plain", request)
        out.append(dataclasses.replace(row, tokens={**row.tokens, "plain": plain[0]},
                                       memory={**row.memory, "plain": plain[1]}))
    out.sort(key=lambda row: (-row.tokens["all"], -row.tokens["plain"], row.layout.name))
    return out


def longest_text(rows: list[Longest], request: Request, top: int) -> str:
    gib = 2**30
    host = request.host_budget_bytes
    lines = [f"{request.model.name} on {request.world} x {request.hardware.name} ({request.budget_bytes / gib:.1f} GiB "
             f"per GPU; host " + (f"{host / gib:.1f} GiB per GPU" if host is not None else "memory not checked")
             + f"), {request.mixed_precision}, {request.optimizer}: the longest sequence per layout, one sequence per "
             "data-parallel rank",
             "all: activation checkpointing with offloading, chunked loss, tiled MLP, fused RMSNorm (H: and "
             "head-chunked Ulysses attention; P: and FSDP2's CPU offload of parameters, gradients and optimizer "
             "state; cp: the context-parallel attention, ag the all-gather or ring, cp_comm_strategy=\"ring\", and "
             "the other's tokens); plain: FSDP2 with activation checkpointing and the model's own loss", ""]
    header = f"{'#':>3}  {'layout':<34} {'all: tokens':>12} {'H':>2} {'without H':>10} {'P':>2} {'without P':>10} " \
             f"{'cp':>4} {'other cp':>10} {'peak GiB':>9} {'host GiB':>9} {'plain: tokens':>14} {'ratio':>7}"
    lines += [header, "-" * len(header)]
    for i, row in enumerate(rows[:top]):
        mem = row.memory["all"]
        peak = f"{mem.peak / gib:.1f}" if mem else "-"
        host_gib = f"{host_bytes(mem) / gib:.1f}" if mem else "-"
        ratio = f"{row.tokens['all'] / row.tokens['plain']:.1f}x" if row.tokens["plain"] else "-"
        lines.append(f"{i + 1:>3}  {row.layout.name:<34} {row.tokens['all']:>12,} {'H' if row.head_chunks else '-':>2} "
                     f"{'-' if row.without_chunks is None else f'{row.without_chunks:,}':>10} "
                     f"{'P' if row.offload_params else '-':>2} "
                     f"{'-' if row.without_offload is None else f'{row.without_offload:,}':>10} "
                     f"{STRATEGY_CELL[row.cp_strategy] if row.layout.cp > 1 else '-':>4} "
                     f"{'-' if row.other_strategy is None else f'{row.other_strategy:,}':>10} "
                     f"{peak:>9} {host_gib:>9} {row.tokens['plain']:>14,} {ratio:>7}")
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more (--top N)")
    fsdp = next((r for r in rows if r.layout == Layout(dp_shard=request.world)), None)
    best_plain = max(rows, key=lambda r: r.tokens["plain"]) if rows else None
    if rows:
        best = rows[0]
        ring = _setting("all", QUANTUM, request.mixed_precision, request.optimizer, strategy="ring")
        lines += ["", f"longest with every feature: {best.tokens['all']:,} tokens ({best.layout.name}"
                  + (", with FSDP2's CPU offload: FullyShardedDataParallelPlugin(cpu_offload=True)" if best.offload_params
                     else "")
                  + (f"; without it {best.without_offload:,}" if best.offload_params and best.without_offload
                     is not None else "")
                  + (f"; head chunks: MemoryKwargs(ulysses_head_chunks=\"auto\"), {best_chunks(best, request)} at "
                     "that length" + (f", without them {best.without_chunks:,}" if best.without_chunks is not None
                                      else "") if best.head_chunks else "")
                  + (f"; the ring attention: {config_line(best.layout, ring)}"
                     + (f", with the all-gather {best.other_strategy:,}" if best.other_strategy is not None else "")
                     if best.cp_strategy == "ring" else "")
                  + f"); without them (plain FSDP2 + AC): {best_plain.tokens['plain']:,} ({best_plain.layout.name})"
                  + (f"; plain FSDP2 over all {request.world} GPUs: {fsdp.tokens['plain']:,}" if fsdp else "")]
        if request.expandable_segments:
            lines.append("with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the launch environment, as asked "
                         "(--expandable-segments); the allocator's reserve under it is unmeasured: the figures keep "
                         f"the profile's fragmentation {request.hardware.fragmentation} until a GPU run records it")
        lines += missing_features(best, request)
    return "\n".join(lines)


def best_chunks(row: Longest, request: Request) -> int:
    """The head chunks `row`'s setting runs with at its longest sequence (the library's "auto" count)."""
    return head_chunks(request.model, row.layout, _setting("all", row.tokens["all"], request.mixed_precision,
                                                           request.optimizer, row.offload_params, row.head_chunks,
                                                           row.cp_strategy))


def missing_features(row: Longest, request: Request) -> list[str]:
    """What bounds the longest row on the GPU that the library has no feature for, with the bytes at that length:
    said, never planned with (the search uses only what the library runs)."""
    mem, model = row.memory["all"], request.model
    if mem is None:
        return []
    gib, out = 2**30, []
    step = QUANTUM * row.layout.sequence_divisor
    recipe = _setting("all", row.tokens["all"] + step, request.mixed_precision, request.optimizer, row.offload_params,
                      row.head_chunks, row.cp_strategy)
    longer = estimate(model, row.layout, recipe, request.hardware.fragmentation)
    if longer.peak <= request.budget_bytes and row.tokens["all"] + step <= LIMIT:
        rounding = host_bytes(longer) - host_bytes(estimate(model, row.layout, recipe, pin=False))
        out.append(f"  - bounded by host memory, not the GPU's: {row.tokens['all'] + step:,} tokens would need "
                   f"{host_bytes(longer) / gib:.1f} GiB per GPU of the host's {request.host_budget_bytes / gib:.1f} ("
                   f"the layer inputs {longer['host_offload'] / gib:.1f} GiB at their bytes in the offload's host "
                   "pool" + (f"; {rounding / gib:.1f} GiB the power-of-two rounding of FSDP2's pinned states by "
                             "torch's host allocator" if rounding else "") + ")")
    if row.layout.fsdp == 1 and mem["unsharded_params"]:
        out.append(f"  - {mem['unsharded_params'] / gib:.1f} GiB of gathered compute-dtype copies: without cpu_offload "
                   "a one-rank shard group keeps them from forward to backward (parallel/gathered.py, "
                   "reshards_after_forward); resharding would free them for a cast per layer in backward")
    held, how = backward_transient(model, row.layout, _setting("all", row.tokens["all"], request.mixed_precision,
                                                                request.optimizer, row.offload_params, row.head_chunks,
                                                                row.cp_strategy))
    out.append(f"  - {held / gib:.1f} GiB: the largest buffer the rebuilt layer allocates (in its backward, or its forward again), {how}")
    if mem["fragmentation"]:
        out.append(f"  - {mem['fragmentation'] / gib:.1f} GiB of the caching allocator's reserve (the profile's "
                   f"fragmentation {request.hardware.fragmentation}, tuned on torchtitan's runs without "
                   "expandable_segments): " + ("under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it is unmeasured"
                                               if request.expandable_segments else
                                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                               "(--expandable-segments) may hold less")
                   + "; not modelled")
    return ["", "what bounds it at that length, and what the library lacks to go further:", *out]


def curve_lengths(row: Longest, points: int = 25) -> list[int]:
    """Sequence lengths to draw `row`'s layout at: multiples of its step (QUANTUM x `Layout.sequence_divisor`), up to
    `points` of them spaced evenly on a log scale from one step to twice its longest with every feature, and the longest
    sequences found (`row.tokens`)."""
    step = QUANTUM * row.layout.sequence_divisor
    end = 2 * max(row.tokens["all"], step) // step
    found = {tokens // step for tokens in row.tokens.values() if tokens}
    return [k * step for k in sorted({round(end ** (i / (points - 1))) for i in range(points)} | found)]


def curves(row: Longest, request: Request, lengths: list[int]) -> dict[str, list[Memory]]:
    """`estimate` of `row`'s layout at each of `lengths`, by curve: the setting --max-seq found for it ("every
    feature": `SETTINGS["all"]`, with FSDP2's CPU offload where the row takes it and the row's cp strategy), that
    setting without each of its features in turn (`FEATURES`) and, where it runs the ring, with the all-gather, and
    plain FSDP2 + AC (`SETTINGS["plain"]`, the library's default all-gather)."""
    def found(seq: int) -> Recipe:
        return _setting("all", seq, request.mixed_precision, request.optimizer, row.offload_params, row.head_chunks,
                        row.cp_strategy)

    recipes = {"every feature": found}
    for letter in found(QUANTUM).features:
        name, flag = FEATURES[letter]
        recipes[f"without {name} ({letter})"] = lambda seq, flag=flag: dataclasses.replace(found(seq), **{flag: False})
    if row.layout.cp > 1 and row.cp_strategy == "ring":
        recipes["with the all-gather cp attention"] = lambda seq: dataclasses.replace(found(seq),
                                                                                      cp_strategy="allgather")
    recipes["plain FSDP2 + AC"] = lambda seq: _setting("plain", seq, request.mixed_precision, request.optimizer)
    return {label: [estimate(request.model, row.layout, recipe(seq), request.hardware.fragmentation)
                    for seq in lengths] for label, recipe in recipes.items()}
