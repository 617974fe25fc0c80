"""The plan: every accepted layout, its best micro-batch and checkpointing, ranked by predicted tokens/s per GPU.

For each layout the data-parallel ranks get ``samples / (dp_replicate x dp_shard)`` sequences per step, run as
``accumulation`` micro-steps of ``micro_batch`` samples (micro_batch x accumulation = that share). A larger micro-batch
means fewer FSDP2 all-gathers per step and is never slower, so for each choice of activation checkpointing (off / on)
and gradient synchronisation (``sync_each_batch`` off / on) the largest micro-batch that fits is taken, and the
fastest of those wins. A layout where nothing fits is shown
with its smallest peak and how much it misses by. For a mixture of experts each ep that splits the experts
(`layouts.expert_layouts`; ``--ep-size`` pins one) makes a layout of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from .comm import Transfer, transfers
from .hardware import GiB, Hardware
from .layouts import Constraints, Layout, explain_no_layout, reasons, valid_layouts
from .footprint import Memory, estimate, head_chunks
from .offload import host_bytes
from .model import ModelSpec
from .recipe import CP_STRATEGIES, Recipe, human_bytes
from .timing import Timing, step_time

CHECKPOINTING = ("auto", "on", "off")


@dataclass(frozen=True)
class Request:
    model: ModelSpec
    hardware: Hardware
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch_tokens: int
    memory_gib: float | None = None  # memory per GPU to plan for; None: the profile's
    mixed_precision: str = "bf16"
    checkpointing: str = "auto"
    optimizer: str = "adamw"
    allow_cross_node_tp: bool = False
    sync_each_batch: str = "auto"  # auto | on | off
    # The memory features (`ndparallel.parallel.memory`): "auto" tries them off and on and keeps the fastest setting
    # that fits (the chunked loss is never slower, so auto means on, as in the library).
    chunked_loss: str = "auto"
    tiled_mlp: str = "auto"
    fused_rms_norm: str = "auto"
    head_chunks: str = "auto"  # MemoryKwargs(ulysses_head_chunks="auto") under cp or sp (`footprint.head_chunks`)
    # TorchContextParallelConfig(cp_comm_strategy=...) under cp: "auto" tries the all-gather and the ring and keeps
    # what fits, the fastest of those (`Recipe.cp_strategy`)
    cp_strategy: str = "auto"
    offload: str = "auto"
    offload_params: str = "auto"  # FSDP2's cpu_offload: parameters, gradients, optimizer state in host memory
    host_memory_gib: float | None = None  # per node; None: the profile's
    ep_size: int | None = None  # expert parallelism pinned; None: every ep that splits the experts
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True asked for: printed in the recipe; the allocator's reserve
    # under it is unmeasured, so the profile's fragmentation is kept (docs/planner.md)
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seq_len", "global_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(f"--global-batch-tokens {self.global_batch_tokens} is not a multiple of --seq-len "
                             f"{self.seq_len}: a step holds whole sequences (e.g. "
                             f"{max(1, self.global_batch_tokens // self.seq_len) * self.seq_len})")
        for name in ("checkpointing", "sync_each_batch", "chunked_loss", "tiled_mlp", "fused_rms_norm", "head_chunks",
                     "offload", "offload_params"):
            if getattr(self, name) not in CHECKPOINTING:
                raise ValueError(f"{name} {getattr(self, name)!r}: use one of {list(CHECKPOINTING)}")
        if self.memory_gib is not None and self.memory_gib <= self.hardware.memory_reserve_gib:
            raise ValueError(f"--memory-gib {self.memory_gib} leaves nothing once the profile's reserve of "
                             f"{self.hardware.memory_reserve_gib} GiB (CUDA context, NCCL, fragmentation) is set "
                             "aside")
        if self.host_memory_gib is not None and (isinstance(self.host_memory_gib, bool) or self.host_memory_gib < 0):
            raise ValueError(f"--host-memory-gib must be a number >= 0 (0: not checked), got {self.host_memory_gib!r}")
        if self.host_budget_bytes is not None and self.host_budget_bytes <= 0:
            node = self.hardware.host_memory_gib if self.host_memory_gib is None else self.host_memory_gib
            raise ValueError(f"host memory of {node} GiB per node leaves nothing per GPU once each of the "
                             f"{min(self.gpus_per_node, self.world)} processes' reserve of "
                             f"{self.hardware.host_reserve_gib} GiB is set aside: raise --host-memory-gib (0: not "
                             "checked)")
        if self.cp_strategy not in CP_OPTIONS:
            raise ValueError(f"cp_strategy {self.cp_strategy!r}: use one of {list(CP_OPTIONS)}")
        Recipe(self.seq_len, 1, mixed_precision=self.mixed_precision, optimizer=self.optimizer)  # checks both
        ep, moe = self.ep_size, self.model.moe
        if ep is not None:
            if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
                raise ValueError(f"--ep-size must be a positive integer, got {ep!r}")
            if moe is None and ep != 1:
                raise ValueError(f"--ep-size {ep}: {self.model.name} is not a mixture of experts")
            if moe is not None and moe.routed.experts % ep:
                count = moe.routed.experts
                raise ValueError(f"--ep-size {ep} must divide the experts of {self.model.name}: its {count} experts "
                                 f"cannot be split over {ep} ranks; use an ep_size in "
                                 f"{[d for d in range(1, count + 1) if count % d == 0]} (that also divides dp_shard x "
                                 "cp x sp)")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def samples(self) -> int:
        return self.global_batch_tokens // self.seq_len

    @property
    def budget_bytes(self) -> float:
        memory = self.hardware.memory_gib if self.memory_gib is None else self.memory_gib
        return (memory - self.hardware.memory_reserve_gib) * GiB

    @property
    def host_budget_bytes(self) -> float | None:
        """Host memory per GPU (`Hardware.host_budget_bytes`); None: unknown, not checked."""
        return self.hardware.host_budget_bytes(self.host_memory_gib, min(self.gpus_per_node, self.world))

    def fits(self, memory: Memory) -> bool:
        """Whether one GPU's `memory` fits its budget, and its host memory the host's share (where known)."""
        host = self.host_budget_bytes
        return memory.peak <= self.budget_bytes and (host is None or host_bytes(memory) <= host)

    def constraints(self) -> Constraints:
        return Constraints(self.model, self.seq_len, self.samples, self.gpus_per_node, self.allow_cross_node_tp,
                           self.ep_size)


@dataclass
class Row:
    layout: Layout
    recipe: Recipe
    memory: Memory
    transfers: list[Transfer]
    timing: Timing
    budget: float
    host_budget: float | None = None  # host memory per GPU; None: not checked

    @property
    def fits_host(self) -> bool:
        return self.host_budget is None or host_bytes(self.memory) <= self.host_budget

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget and self.fits_host

    @property
    def shortfall(self) -> tuple[bool, float]:
        """How far from fitting, for ranking rows that do not: the host first, then the GPU's peak."""
        return not self.fits_host, self.memory.peak

    @property
    def miss(self) -> float:
        """Bytes over the budget (0 when it fits)."""
        return max(0.0, self.memory.peak - self.budget)


@dataclass
class Plan:
    request: Request
    rows: list[Row]  # ranked: fitting rows by tokens/s, then the others by peak
    refused: dict[Layout, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None

    def no_fit_message(self) -> str:
        smallest = min(self.rows, key=lambda row: row.shortfall)
        r, s = self.request, smallest.recipe
        if smallest.memory.peak <= smallest.budget:  # the GPU's memory would do: the host's is what is short
            return (f"no layout fits: the smallest GPU peak ({smallest.layout.name}) needs "
                    f"{human_bytes(host_bytes(smallest.memory))} of host memory per GPU, more than the "
                    f"{human_bytes(smallest.host_budget or 0)} each GPU's process has of the node's; raise "
                    "--host-memory-gib or turn offloading off")
        return (f"no layout fits in {r.budget_bytes / GiB:.1f} GiB per GPU ({r.hardware.name}, "
                f"{(r.memory_gib or r.hardware.memory_gib)} GiB less a {r.hardware.memory_reserve_gib} GiB reserve): "
                f"the smallest peak is {human_bytes(smallest.memory.peak)} ({smallest.layout.name}, micro-batch "
                f"{s.micro_batch}, activation checkpointing {'on' if s.checkpointing else 'off'}), "
                f"{human_bytes(smallest.miss)} over. Add GPUs, shorten --seq-len or lower --global-batch-tokens")


def evaluate(request: Request, layout: Layout, recipe: Recipe) -> Row:
    """Predictions for one layout run with one setting."""
    memory = estimate(request.model, layout, recipe, request.hardware.fragmentation)
    items = transfers(request.model, layout, recipe, request.gpus_per_node)
    timing = step_time(request.model, layout, recipe, items, request.hardware, request.global_batch_tokens)
    return Row(layout, recipe, memory, items, timing, request.budget_bytes, request.host_budget_bytes)


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


OPTIONS = {"auto": (False, True), "on": (True,), "off": (False,)}
CP_OPTIONS = {"auto": CP_STRATEGIES, **{name: (name,) for name in CP_STRATEGIES}}


def cp_strategies(request: Request, layout: Layout) -> tuple[str, ...]:
    """The cp strategies to try for `layout`: the request's under cp, the default alone without it (nothing
    differs)."""
    return CP_OPTIONS[request.cp_strategy] if layout.cp > 1 else ("allgather",)


def memory_options(request: Request) -> list[tuple[bool, bool, bool, bool, bool, bool]]:
    """(checkpointing, chunked loss, tiled MLP, activation offload, parameter offload, fused RMSNorm) combinations
    the request allows; activation offloading only with checkpointing, and "auto" for the chunked loss is on (never
    slower in the model, on by default in the library)."""
    chunked = (True,) if request.chunked_loss == "auto" else OPTIONS[request.chunked_loss]
    out = []
    for ac, loss, tiled, offload, params, norms in itertools.product(
            OPTIONS[request.checkpointing], chunked, OPTIONS[request.tiled_mlp], OPTIONS[request.offload],
            OPTIONS[request.offload_params], OPTIONS[request.fused_rms_norm]):
        if offload and not ac:
            if request.offload == "on":
                raise ValueError("--offload on needs activation checkpointing (--activation-checkpointing on|auto)")
            continue
        out.append((ac, loss, tiled, offload, params, norms))
    return out


def best_row(request: Request, layout: Layout) -> Row:
    """The fastest setting of `layout` that fits, else the one with the smallest peak. Head chunks
    (``MemoryKwargs(ulysses_head_chunks="auto")``) only where sequences are sharded (cp or sp); they cost each
    chunk's attention forward again (`timing`), so "auto" takes them where they make a layout fit or a larger
    micro-batch fit. Under cp both strategies (``cp_comm_strategy``, `cp_strategies`): the ring's point-to-point
    traffic is a little more than the all-gather's (its gradients travel cp hops in fp32), so it is taken where it
    makes a layout or a larger micro-batch fit."""
    per_rank = request.samples // layout.batch
    fitting: list[Row] = []
    smallest: Row | None = None
    # Reduce-scattering every micro-step only changes anything with accumulation over a sharded group.
    syncs = OPTIONS[request.sync_each_batch] if layout.fsdp > 1 and per_rank > 1 else (False,)
    chunk_options = OPTIONS[request.head_chunks] if layout.seq_split > 1 else (False,)
    for (checkpointing, loss, tiled, offload, params, norms), sync, chunks, strategy in itertools.product(
            memory_options(request), syncs, chunk_options, cp_strategies(request, layout)):
        for micro in _divisors_desc(per_rank):
            if micro % layout.pp:  # pipeline stages cut each micro-step into pp micro-batches
                continue
            if sync and micro == per_rank and len(syncs) > 1:
                continue  # no accumulation: the same as without sync_each_batch
            recipe = Recipe(request.seq_len, micro, per_rank // micro, request.mixed_precision, checkpointing,
                            request.optimizer, sync, loss, tiled, offload, offload_params=params,
                            fused_norms=norms, head_chunks=chunks, cp_strategy=strategy)
            if chunks and len(chunk_options) > 1 and head_chunks(request.model, layout, recipe) == 1:
                continue  # "auto" runs all heads at once at this length: the setting without chunks
            row = evaluate(request, layout, recipe)
            if row.fits:
                fitting.append(row)
                break
            if smallest is None or row.shortfall < smallest.shortfall:
                smallest = row
    if fitting:
        return max(fitting, key=lambda row: row.timing.tokens_per_s_per_gpu)
    assert smallest is not None
    return smallest


def plan(request: Request) -> Plan:
    """Rank every layout the library accepts for `request`; raise ValueError when it accepts none."""
    start = time.perf_counter()
    ok, refused = valid_layouts(request.world, request.constraints())
    if not ok:
        raise ValueError(explain_no_layout(request.world, request.constraints()))
    rows = [best_row(request, layout) for layout in ok]
    rows.sort(key=lambda row: (not row.fits, (-row.timing.tokens_per_s_per_gpu,) if row.fits else row.shortfall))
    return Plan(request, rows, refused, time.perf_counter() - start)


def row_for(request: Request, layout: Layout) -> Row:
    """The row of one given layout (``--explain``; the pinned ``--ep-size`` where it names no ep); raises if the
    library would refuse it."""
    if request.ep_size is not None and layout.ep == 1:
        layout = dataclasses.replace(layout, ep=request.ep_size)
    why = reasons(layout, request.constraints())
    if why:
        raise ValueError(f"layout {layout.name} is refused: {'; '.join(why)}")
    return best_row(request, layout)
