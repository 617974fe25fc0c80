"""The terms a mixture of experts adds to a plan's memory, bytes and FLOPs, per layout: the routed experts' figures
(`experts.expert_figures` -- the figures ``estimate-memory --ep-size`` prints and benchmarks/experts.py measures) and
the rest of the sparse layers (`mixture.MoESpec`).

- **memory** per token of a sparse layer's block, what autograd keeps (checked against the library:
  benchmarks/planner_check_moe.py): the router's fp32 softmax over the experts (E x 4) and its top-k indices (k x 8);
  per (token, slot) pair -- k of them per token, spread over the ranks of ep, as many arrive as leave when the routing
  is uniform --
  the hidden state sent to the expert, the gate/up output, the activation, their product and the expert's output
  ((2 h + 4 I) x c), the routing weight (c) and the int64 indices that sort the pairs and put them back (3 x 8
  without ep, 4 x 8 with it); the shared experts as a dense MLP (4 I_s / t x c), Qwen2-MoE's shared gate (h + 2) x c.
- **bytes**: the all-to-alls of `experts.expert_figures` (tokens: (ep - 1) / ep of the payload leaves the rank under
  uniform routing, the ring formula of every other all-to-all; and the routing counts), and FSDP2 over the experts:
  under ep each sparse layer's experts are an FSDP2 unit of their own over expert_shard (all-gathered forward and
  backward, gradients reduce-scattered), replicated over dp_replicate; without ep they are part of the layer's unit
  over fsdp. With expert_shard = 1 nothing is gathered: the experts stay whole on the rank (their compute-dtype copy
  is kept through the step, as for any FSDP2 unit on one rank).
- **FLOPs**: only the k routed experts a token goes to, the shared experts and the router count.
"""

from __future__ import annotations

import functools
import math

from ..distributed.layout import Layout
from .experts import ExpertFigures, expert_figures
from .model import ModelSpec
from .recipe import Recipe

INDEX_BYTES = 8  # the int64 indices that sort the (token, slot) pairs by expert and put them back


def figures(model: ModelSpec, layout: Layout, recipe: Recipe) -> ExpertFigures:
    """`experts.expert_figures` of `layout` (ep carved out of its fsdp ranks) running `setting`."""
    assert model.moe is not None
    return expert_figures(model.moe.routed, layout.fsdp, layout.ep, recipe.tokens(layout), recipe.accumulation,
                          recipe.compute_bytes, recipe.checkpointing, recipe.optimizer)


def local_expert_elements(model: ModelSpec, layout: Layout) -> int:
    """Elements of the experts one rank computes with in one sparse layer, unsharded: E / ep experts."""
    assert model.moe is not None
    routed = model.moe.routed
    return sum(math.prod(shape) for _, shape in routed.stacked()) // layout.ep


def gathered_expert_elements(model: ModelSpec, layout: Layout) -> int:
    """One sparse layer's experts FSDP2 all-gathers for compute: E / ep of them (all E without ep); none when their
    shard group (expert_shard = fsdp / ep) has one rank: they stay whole on it."""
    return local_expert_elements(model, layout) if layout.expert_shard > 1 else 0


@functools.lru_cache(maxsize=4096)
def expert_elements(model: ModelSpec, layout: Layout) -> tuple[int, int]:
    """(routed-expert elements one rank holds -- `experts.expert_figures`' count --, those it computes with,
    unsharded, over all sparse layers); (0, 0) for a dense model."""
    if model.moe is None:
        return 0, 0
    held = expert_figures(model.moe.routed, layout.fsdp, layout.ep, tokens=0).elements
    return held, model.moe.sparse_layers * local_expert_elements(model, layout)


def block_activations(model: ModelSpec, layout: Layout, recipe: Recipe) -> tuple[float, str]:
    """Bytes per token a sparse layer's mixture-of-experts block saves for backward (module docstring)."""
    assert model.moe is not None
    moe, c, t = model.moe, recipe.compute_bytes, layout.tp
    e, k, h, i = moe.routed.experts, moe.routed.top_k, moe.routed.hidden, moe.routed.intermediate
    indices = (4 if layout.ep > 1 else 3) * INDEX_BYTES
    pair = (2 * h + (4 if moe.routed.gated else 2) * i) * c + c + indices
    router = e * 4 + k * INDEX_BYTES
    shared_t = t if moe.shared_split else 1
    shared = 4 * moe.shared_intermediate // shared_t * c + ((h + 2) * c if moe.shared_gate else 0)
    how = (f"router {e}x4 + {k}x8 + {k} pairs x ((2x{h} + 4x{i}) x {c} + {c} + {indices})"
           + (f" + shared experts 4x{moe.shared_intermediate // shared_t}x{c}" if moe.shared_intermediate else "")
           + (f" + shared gate ({h}+2)x{c}" if moe.shared_gate else ""))
    return router + k * pair + shared, how
