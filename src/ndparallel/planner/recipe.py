"""`Recipe`: how one optimizer step runs on every rank (sequence, micro-batch, accumulation, precision, memory
features), which every part of the cost model reads, and the small helpers they share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..distributed.layout import Layout
from ..parallel.memory.cross_entropy import chunk_rows as loss_chunk_rows  # the library's own, not a copy
from ..parallel.memory.tiled_mlp import default_tile

MIXED_PRECISIONS = ("bf16", "fp32")
# the library's cp_comm_strategy values the planner models ("alltoall" is the library's other name for the ring)
CP_STRATEGIES = ("allgather", "ring")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # fp32 tensors the optimizer keeps per parameter
FP32 = 4


@dataclass(frozen=True)
class Recipe:
    """How one optimizer step runs on every rank."""

    seq_len: int
    micro_batch: int  # samples per data-parallel rank per micro-step (the DataLoader's batch_size)
    accumulation: int = 1  # micro-steps per optimizer step (gradient_accumulation_steps)
    mixed_precision: str = "bf16"  # "bf16": FSDP2 computes in bf16, reduces in fp32; "fp32": everything fp32
    checkpointing: bool = False  # activation checkpointing of every decoder layer
    optimizer: str = "adamw"
    sync_each_batch: bool = False  # GradientAccumulationPlugin(sync_each_batch=True): reduce-scatter every micro-step
    chunked_loss: bool = True  # MemoryKwargs(chunked_loss=...): on by default in the library for these models
    tiled_mlp: bool = False  # MemoryKwargs(tiled_mlp=True)
    offload: bool = False  # activation_checkpointing={"offload": True}: checkpointed layers' inputs in host memory
    mlp_tile: int | None = None  # MemoryKwargs(mlp_tile_size=...); None: the library's default
    # FullyShardedDataParallelPlugin(cpu_offload=True): FSDP2 keeps the sharded parameters, their gradients and the
    # optimizer's state in host memory and steps the optimizer there (`planner.offload`)
    offload_params: bool = False
    fused_norms: bool = False  # MemoryKwargs(fused_rms_norm=True): RMSNorms keep no fp32 copy of their input
    # MemoryKwargs(ulysses_head_chunks="auto"): under cp or sp attention over groups of heads, as many as the
    # library's "auto" picks for the length (`footprint.head_chunks`); nothing without sharded sequences
    head_chunks: bool = False
    # TorchContextParallelConfig(cp_comm_strategy=...) under cp: "allgather" (the library's default: K/V all-gathered,
    # their gradients reduce-scattered) or "ring" (K/V blocks passed around the ring point to point; `CP_STRATEGIES`)
    cp_strategy: str = "allgather"

    def __post_init__(self) -> None:
        if self.cp_strategy not in CP_STRATEGIES:
            raise ValueError(f"cp strategy {self.cp_strategy!r}: the planner models {list(CP_STRATEGIES)}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"mixed precision {self.mixed_precision!r}: use one of {list(MIXED_PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer {self.optimizer!r}: the planner knows {sorted(OPTIMIZER_STATES)}")
        if self.seq_len < 1 or self.micro_batch < 1 or self.accumulation < 1:
            raise ValueError("seq_len, micro_batch and accumulation must be >= 1")
        if self.offload and not self.checkpointing:
            raise ValueError("activation offloading moves the inputs of checkpointed layers: it needs activation "
                             "checkpointing")

    @property
    def features(self) -> str:
        """The memory features on, as letters: C chunked loss, T tiled MLP, N fused RMSNorm, H head-chunked Ulysses
        attention, O activation offload, P parameters, gradients and optimizer state offloaded (FSDP2's cpu_offload)
        ("-": none)."""
        return "".join(k for k, on in (("C", self.chunked_loss), ("T", self.tiled_mlp), ("N", self.fused_norms),
                                       ("H", self.head_chunks), ("O", self.offload), ("P", self.offload_params))
                       if on) or "-"

    @property
    def norm_copy_bytes(self) -> int:
        """Bytes per element an RMSNorm keeps beyond its input and output: the fp32 copy of its input, which the
        fused norm does not keep (`ndparallel.parallel.memory.rms_norm`)."""
        return 0 if self.fused_norms else FP32

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element (and of a parameter as FSDP2 gathers it)."""
        return 2 if self.mixed_precision == "bf16" else FP32

    def tokens(self, layout: Layout) -> int:
        """Tokens one rank holds in a micro-step: its samples' share of the sequence under cp x sp."""
        return self.micro_batch * self.seq_len // layout.seq_split


def mlp_tile_tokens(hidden: int, tokens: int, tile: int | None = None) -> int:
    """Tokens per tile of a tiled MLP (`ndparallel.parallel.memory.tiled_mlp`: `tile`, by default the library's
    `default_tile`), at most the sequence: the sequence cut into ceil(tokens / tile) equal tiles."""
    tile = tile or default_tile(hidden)
    return math.ceil(tokens / math.ceil(tokens / tile))


def local_shape(shape: tuple[int, ...], tp_dim: int | None, tp: int) -> tuple[int, ...]:
    """A weight's shape on one tensor-parallel rank."""
    if tp_dim is None or tp == 1:
        return shape
    return tuple(n // tp if d == tp_dim else n for d, n in enumerate(shape))


def shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements one rank holds of a tensor FSDP2 shards over `shards` ranks: dim 0 padded to a multiple of it."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / shards) * rest


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
