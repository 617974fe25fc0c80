"""The layout: the axes of the world, their sizes and the views by purpose -- declared once, here.

Everything that needs the layout computes from this module: the mesh (`ndparallel.distributed.mesh` builds one process
group per view), the config's checks (`ndparallel.configuration.parallelism.ParallelismConfig`), the data path and the
checkpoint resharding (through the mesh's views) and the planner (`ndparallel.planner`, which has no mesh). It imports
nothing of the package and no torch.

Axes, outermost first: ``pp, dp_replicate, dp_shard, cp, sp, tp`` (pipeline stages outermost: they span the slowest
links with the least traffic; TP innermost: it needs the fastest). Their product is the world size. Views by purpose:

- ``batch`` = dp_replicate x dp_shard: ranks that receive different samples;
- ``fsdp``  = dp_shard x cp x sp: ranks across which FSDP2 shards parameters (CP/SP ranks work on other tokens of the
  same samples, so their gradients are reduced anyway and sharding across them is free);
- ``loss``  = dp_replicate x dp_shard x cp x sp: ranks whose token losses add up to the global loss, and the ranks
  over which the data-parallel wrapper averages gradients;
- Accelerate's flattened names, kept for compatibility: ``dp`` (= batch), ``dp_shard_cp``, ``dp_cp``;
- the single axes;
- ``ep`` and ``expert_shard`` (expert parallelism, ``ep_size``): the ``fsdp`` ranks cut into consecutive groups of ep
  (`EXPERT_VIEWS`). ep is carved out of ranks that already hold different tokens, so it is no axis and no factor of
  the world size.

Facts that follow from the sizes are declared here too: the mesh FSDP2 wraps over (`DATA_PARALLEL`,
`Layout.data_parallel_views`: HSDP's two dimensions when there are replicas), Accelerate's ranks that receive the same
samples (`SAME_SAMPLES`), and what a sequence length must be a multiple of to split over cp x sp (`sequence_divisor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# Mesh axes, outermost first.
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
# Flattened views: name -> the axes they span (contiguous, outermost first).
VIEWS: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp", "sp"),
    "loss": ("dp_replicate", "dp_shard", "cp", "sp"),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# Views carved out of ``fsdp`` by ep (not whole axes): name -> its size given (fsdp size, ep).
EXPERT_VIEWS: dict[str, Callable[[int, int], int]] = {
    "ep": lambda fsdp, ep: ep,
    "expert_shard": lambda fsdp, ep: fsdp // ep,
}

# The meshes FSDP2 wraps over, outermost first: HSDP replicates over dp_replicate (outside) and shards over the inner
# view -- ``fsdp`` for the dense parameters, ``expert_shard`` for the experts under expert parallelism. Without
# replicas, the inner view alone (`Layout.data_parallel_views`).
DATA_PARALLEL: dict[str, tuple[str, ...]] = {
    "dense": ("dp_replicate", "fsdp"),
    "experts": ("dp_replicate", "expert_shard"),
}
# Axes whose ranks receive the same samples (Accelerate's ``non_dp_dim_names``, in its order).
SAME_SAMPLES: tuple[str, ...] = ("tp", "cp", "sp")


def load_balanced_chunks(cp: int, load_balance: bool = True) -> int:
    """The equal chunks context parallelism cuts each sequence into: 2 x cp load-balanced (rank r holds chunks r and
    2cp - 1 - r), else cp."""
    return 2 * cp if load_balance else cp


def sequence_divisor(cp: int, sp: int, load_balance: bool = True) -> int:
    """What a sequence length must be a multiple of to split over cp x sp: each of cp's chunks
    (`load_balanced_chunks`) is split again over the sp ranks."""
    return load_balanced_chunks(cp, load_balance) * sp


def view_axes(name: str) -> tuple[str, ...]:
    """The axes view `name` spans (an expert view spans those of ``fsdp``, which it cuts)."""
    if name in AXES:
        return (name,)
    if name in VIEWS:
        return VIEWS[name]
    if name in EXPERT_VIEWS:
        return VIEWS["fsdp"]
    raise KeyError(f"no mesh view named {name!r}; valid names: {', '.join((*AXES, *VIEWS, *EXPERT_VIEWS))}")


@dataclass(frozen=True)
class Layout:
    """The sizes of the axes and ep; every view's size and rank group follows from them.

    A size of -1 (a config not yet resolved against the world size) is kept as it is; the sizes it enters are then
    negative, as the product of the raw sizes would be."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1  # last, so that positional construction keeps its meaning; outermost in the mesh (AXES)
    ep: int = 1  # experts split over ep of the fsdp ranks (no axis: not in `sizes`, no factor of the world)

    def size(self, name: str) -> int:
        """The number of ranks in view (or axis) `name`."""
        if name in EXPERT_VIEWS:
            return EXPERT_VIEWS[name](self.size("fsdp"), self.ep)
        return math.prod(getattr(self, axis) for axis in view_axes(name))

    @property
    def world(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def batch(self) -> int:
        """Ranks that receive different samples (the ``batch`` view)."""
        return self.size("batch")

    @property
    def fsdp(self) -> int:
        """Ranks FSDP2 shards parameters over (the ``fsdp`` view: dp_shard x cp x sp)."""
        return self.size("fsdp")

    @property
    def seq_split(self) -> int:
        """Ranks that hold different tokens of the same samples: cp x sp."""
        return self.cp * self.sp

    @property
    def sequence_divisor(self) -> int:
        """What a sequence length must be a multiple of to split over cp x sp, load-balanced: 2 x cp x sp."""
        return sequence_divisor(self.cp, self.sp)

    @property
    def same_samples(self) -> int:
        """Ranks that receive the same samples (Accelerate's ``non_data_parallel_size``): tp x cp x sp."""
        return math.prod(getattr(self, axis) for axis in SAME_SAMPLES)

    def data_parallel_views(self, experts: bool = False) -> tuple[str, ...]:
        """The views of the mesh FSDP2 wraps over (`DATA_PARALLEL`), outermost first: (dp_replicate, fsdp) for HSDP
        when dp_replicate > 1, else (fsdp,); with `experts`, expert_shard in fsdp's place."""
        views = DATA_PARALLEL["experts" if experts else "dense"]
        return views if self.dp_replicate > 1 else views[1:]

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP2 shards each expert over: what ep leaves of fsdp."""
        return self.size("expert_shard")

    def sizes(self) -> dict[str, int]:
        """Axis -> size, outermost first (ep is no axis)."""
        return {axis: getattr(self, axis) for axis in AXES}

    def all_sizes(self) -> dict[str, int]:
        """The axes' sizes, and ep where it is used."""
        return {**self.sizes(), **({"ep": self.ep} if self.ep > 1 else {})}

    @property
    def name(self) -> str:
        """Compact name, the sizes other than 1: ``dp_shard=4,tp=2``, ``dp_shard=8,ep=4`` (``single`` for one GPU)."""
        return ",".join(f"{a}={s}" for a, s in self.all_sizes().items() if s > 1) or "single"

    def config_kwargs(self) -> dict[str, int]:
        """``ParallelismConfig`` keyword arguments (every size, explicit)."""
        return {f"{axis}_size": size for axis, size in {**self.sizes(), "ep": self.ep}.items()}

    def config_line(self) -> str:
        args = ", ".join(f"{axis}_size={size}" for axis, size in self.all_sizes().items() if size > 1)
        return f"ParallelismConfig({args})"

    def group(self, name: str, rank: int = 0) -> list[int]:
        """Global ranks of view (or axis) `name`'s group that contains `rank` (ranks laid out in mesh order; an
        expert view cuts its ``fsdp`` group as `EXPERT_VIEWS` says: ``ep`` is consecutive runs of ep, ``expert_shard``
        one rank of each)."""
        if name in EXPERT_VIEWS:
            fsdp = self.group("fsdp", rank)
            at = fsdp.index(rank)
            start = at - at % self.ep
            return fsdp[start:start + self.ep] if name == "ep" else fsdp[at % self.ep::self.ep]
        sizes = self.sizes()
        strides, stride = {}, 1
        for axis in reversed(AXES):
            strides[axis] = stride
            stride *= sizes[axis]
        axes = view_axes(name)
        base = rank
        for axis in axes:
            base -= ((rank // strides[axis]) % sizes[axis]) * strides[axis]
        ranks = [base]
        for axis in axes:
            ranks = [r + i * strides[axis] for r in ranks for i in range(sizes[axis])]
        return sorted(ranks)
