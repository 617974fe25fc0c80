"""FSDP2's CPU offload (``FullyShardedDataParallelPlugin(cpu_offload=True)``): what it keeps in host memory, what
it still needs on the GPU, and the host-device traffic of a step.

What the library runs (`parallel.data_parallel.apply_fsdp`): torch's ``CPUOffloadPolicy`` on every FSDP2 unit,
pinned on CUDA. What torch then does (``torch/distributed/fsdp/_fully_shard``, read for torch 2.13):

- **host**: each parameter's padded fp32 shard (pinned), its fp32 gradient shard (copied from the GPU after the
  reduce-scatter, into pinned memory on the first micro-step that reduces), and the optimizer's states (created like
  the parameter, on the host, not pinned: AdamW 2 fp32 moments); the optimizer steps on the host, where torch's
  AdamW takes its single-tensor path (no foreach kernels on the CPU): two temporaries the size of the parameter
  it is updating (``exp_avg_sq.sqrt() / ...``), counted for the largest shard.
- **pinned blocks**: torch's caching host allocator rounds every pinned block up to a power of two
  (``CachingHostAllocator.h``, with the default ``pinned_max_round_threshold``), so a shard of 224 MiB holds 256 MiB;
  counted tensor by tensor where the memory is pinned (on a GPU; a CPU-only run pins nothing). Not the offloaded
  activations: the library's host pool (`parallel.memory.host_pool`) pins its blocks itself, at their bytes.
- **GPU**: none of the model states. Each all-gather first copies the unit's fp32 shard to the GPU and casts it (the
  ``offload_staging`` term in backward: one unit's reduced gradient waiting for its copy to the host, and the
  shards on their way in for backward's gathers -- two units' where a group of s > 1 ranks prefetches, one where a
  one-rank group gathers in the unit's own pre-hook); gradients accumulated between micro-steps stay there unsharded
  (as without offload). Every group reshards after forward under offload, a one-rank shard group (dp_shard x cp x sp
  = 1) too (`parallel.gathered.reshards_after_forward`): between a unit's forward and backward its parameters are
  only in host memory, and the GPU holds the unit it computes (one layer at a time) and the root unit.
- **traffic per optimizer step**, m micro-steps: host -> device, every unit's fp32 shard at each of its all-gathers,
  m x (g P_layers + P_root) x 4 with g = 2 (forward, backward) or pp + 1 under pipeline stages, a one-rank group
  included (it reshards after forward too); device -> host, the fp32 gradient shard once per
  step (m times with ``sync_each_batch``, the only case where the reduce happens every micro-step).
- **time** (`timing.py`): the copies run on the copy engines at the profile's ``host_bandwidth``, together with
  activation offloading's, hidden behind up to ``overlap`` x compute; the optimizer step runs on the host: 28 B per
  parameter (as on the GPU) at ``host_optimizer_bandwidth``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..distributed.layout import Layout
from .recipe import FP32, OPTIMIZER_STATES, Recipe, local_shape, shard_numel

Params = Iterable[tuple[str, tuple[int, ...], int | None]]  # (name, shape, tensor-parallel dim) per weight


def pinned(nbytes: int, pin: bool = True) -> int:
    """Bytes a pinned block of `nbytes` holds: the next power of two (torch's caching host allocator)."""
    return 1 << max(0, (nbytes - 1).bit_length()) if pin and nbytes > 0 else nbytes


def shard_sizes(groups: Iterable[tuple[int, Params]], layout: Layout) -> list[tuple[int, int]]:
    """(count, elements of one rank's padded shard) per weight: each split over tp, then over FSDP2's s ranks."""
    return [(count, shard_numel(local_shape(shape, dim, layout.tp), layout.fsdp))
            for count, params in groups for _, shape, dim in params]


def host_states(groups: Iterable[tuple[int, Params]], layout: Layout, recipe: Recipe, experts_held: int = 0,
                pin: bool = True) -> list[tuple[str, float, str]]:
    """The host memory terms of one rank: (name, bytes, how) for its parameters, gradients, optimizer state and
    the optimizer step's temporaries. `groups`: (count, weights) of the rank's stage, the root unit with count 1;
    `experts_held`: a mixture's routed-expert elements on the rank (counted without the power-of-two rounding: the
    planner does not split them into tensors); `pin`: whether the parameters and gradients are pinned (on CUDA)."""
    sizes = shard_sizes(groups, layout)
    plain = sum(count * n for count, n in sizes) + experts_held
    held = sum(count * pinned(n * FP32, pin) for count, n in sizes) + experts_held * FP32
    states = OPTIMIZER_STATES[recipe.optimizer]
    largest = max((n for _, n in sizes), default=0)
    rounding = (f", pinned blocks rounded up to powers of two: {held - plain * FP32:,} B more" if pin and held
                != plain * FP32 else "") + (" (the routed experts' unrounded)" if experts_held and pin else "")
    return [
        ("host_params", held, f"{plain:,} fp32 parameters (after tp={layout.tp}, fsdp={layout.fsdp}, padding) x 4 B "
                              f"in host memory{rounding}"),
        ("host_grads", held, f"their fp32 gradients, copied to host memory after the reduce-scatter{rounding}"),
        ("host_optimizer", plain * FP32 * states, f"{plain:,} x {states} states x 4 B ({recipe.optimizer}), on "
                                                  "the host"),
        ("host_optimizer_step", 2 * largest * FP32, f"2 temporaries of the largest shard ({largest:,} x 4 B): torch's "
                                                    "single-tensor AdamW on the host"),
    ]


def staging(layer_elements: int, layout: Layout) -> tuple[float, str]:
    """GPU bytes the offload adds to FSDP2's buffers in backward: one unit's reduced fp32 gradient shard waiting for
    its copy to the host, and the fp32 shards backward gathers again (the units reshard after forward), copied in
    before their cast: two units' where s > 1 ranks prefetch one, one where a one-rank group gathers in the unit's
    own pre-hook."""
    shard = math.ceil(layer_elements / layout.fsdp)
    inbound = 2 if layout.fsdp > 1 else 1
    coming = "two layers' fp32 shards" if inbound > 1 else "one layer's fp32 shard"
    return (inbound + 1) * shard * FP32, (f"{inbound + 1} x {shard:,} x 4 B ({coming} on the way in, one layer's "
                                          "gradient shard on its way out)")


def gathers_per_micro_step(layout: Layout) -> int:
    """All-gathers of a decoder layer's unit per micro-step under the library's resharding with offload (`comm.py`
    for s > 1): a one-rank group reshards after forward too (`parallel.gathered.reshards_after_forward`)."""
    return layout.pp + 1 if layout.pp > 1 else 2


def host_traffic(layers_held: int, root_held: int, layout: Layout, recipe: Recipe) -> tuple[float, float, str]:
    """(host -> device, device -> host bytes per optimizer step, how) of one rank; `layers_held` and `root_held`:
    its shard elements of the decoder layers (the routed experts included) and of the root unit."""
    m = recipe.accumulation
    g = gathers_per_micro_step(layout)
    h2d = m * (g * layers_held + root_held) * FP32
    reduces = m if recipe.sync_each_batch else 1
    d2h = reduces * (layers_held + root_held) * FP32
    return h2d, d2h, (f"in: {m} x ({g} x {layers_held:,} + {root_held:,}) x 4 B; out: {reduces} x "
                      f"{layers_held + root_held:,} x 4 B")


HOST_TERMS = ("host_params", "host_grads", "host_optimizer", "host_optimizer_step", "host_offload")


def host_bytes(memory) -> float:
    """One rank's host memory at its peak (`memory`: a `memory.Memory`): the offloaded states, the optimizer's
    temporaries and the offloaded layer inputs (activation offloading) -- the optimizer steps after backward has
    taken the layer inputs back, but the offload's host pool keeps their blocks for the next step, so they all
    count."""
    return sum(memory[name] for name in HOST_TERMS)
