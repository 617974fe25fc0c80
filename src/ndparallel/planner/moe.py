"""The mixture-of-experts part of a model for ``ndparallel plan``: what a sparse decoder layer holds besides its
routed experts, and the terms expert parallelism adds to memory, bytes and FLOPs.

The routed experts themselves are `experts.ExpertSpec` (read by `experts.expert_spec`), and what each rank holds of
them, gathers and sends is `experts.expert_figures` -- the figures ``estimate-memory --ep-size`` prints and
benchmarks/experts.py measures; this module puts them into the plan:

- **layers**: ``dense_layers`` decoder layers keep a dense MLP of ``intermediate_size`` (DeepSeek-V3's first
  ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``); the others hold attention, the router
  (``mlp.gate`` / gpt-oss's ``mlp.router``: experts x hidden, with a bias for gpt-oss), the shared experts where the
  family has them (DeepSeek-V3's ``shared_experts``, ``n_shared_experts x moe_intermediate_size`` wide; Qwen2-MoE's
  ``shared_expert`` and its 1 x hidden ``shared_expert_gate``) and the routed experts.
- **tensor parallelism** follows each family's own plan (transformers'): the experts and the router stay whole on
  every tp rank, so their compute is repeated on each; attention and dense MLPs are split as Megatron does for
  Mixtral and Qwen-MoE, DeepSeek-V3's shared experts are split, Qwen2-MoE's are not. DeepSeek-V3 (its MLA attention
  is left whole) and gpt-oss (only the embedding and head are split) are planned without tp (`TP_NOT_MODELLED`).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .experts import ExpertFigures, ExpertSpec, expert_figures, expert_spec

if TYPE_CHECKING:
    from .layouts import Layout
    from .model import ModelSpec
    from .setting import Setting

# The families `ndparallel.parallel.tensor.families.FAMILIES` has an `Experts` entry for (restated: the planner
# imports no torch; tests/planner/test_planner_moe.py checks they agree): ep_size > 1 is refused for the others.
EP_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss")
# Families whose tensor-parallel plan the planner does not model, and why.
TP_NOT_MODELLED = {"deepseek_v3": "its plan leaves the multi-head latent attention whole on every tp rank",
                   "gpt_oss": "its plan splits only the embedding and the head"}
INDEX_BYTES = 8  # the int64 indices that sort the (token, slot) pairs by expert and put them back


@dataclass(frozen=True)
class MoESpec:
    """What a mixture-of-experts config adds to the decoder layers (module docstring)."""

    routed: ExpertSpec
    dense_layers: int  # decoder layers with a dense MLP (intermediate_size) instead of experts
    shared_intermediate: int = 0  # the shared experts' width; 0: none
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert
    shared_split: bool = True  # the family's tp plan splits the shared experts
    router: str = "gate"  # the router module under ``mlp``
    router_bias: bool = False
    tp_not_modelled: str | None = None  # why the planner does not model tp for this family

    @property
    def sparse_layers(self) -> int:
        return self.routed.sparse_layers

    @property
    def expert_matmul(self) -> int:
        """Matrix-multiply weights of one expert (gate/up and down)."""
        e = self.routed
        return ((2 if e.gated else 1) + 1) * e.hidden * e.intermediate

    def sparse_layer_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """A sparse layer's weights besides attention, norms and the routed experts: (name, shape, tp_dim)."""
        e, h, i = self.routed.experts, self.routed.hidden, self.shared_intermediate
        out: list[tuple[str, tuple[int, ...], int | None]] = [(f"mlp.{self.router}.weight", (e, h), None)]
        if self.router_bias:
            out.append((f"mlp.{self.router}.bias", (e,), None))
        if i:
            name = "mlp.shared_expert" if self.shared_gate else "mlp.shared_experts"
            col, row = (0, 1) if self.shared_split else (None, None)
            out += [(f"{name}.gate_proj.weight", (i, h), col), (f"{name}.up_proj.weight", (i, h), col),
                    (f"{name}.down_proj.weight", (h, i), row)]
        if self.shared_gate:
            out.append(("mlp.shared_expert_gate.weight", (1, h), None))
        return out


def moe_spec(data: dict[str, Any], source: str = "config") -> MoESpec | None:
    """The mixture-of-experts part of a Hugging Face config dict (None for a dense model)."""
    routed = expert_spec(data, source)
    if routed is None:
        return None
    model_type = str(data.get("model_type"))
    shared, gate, split = 0, False, True
    if data.get("n_shared_experts"):  # DeepSeek-V3
        shared = data["n_shared_experts"] * (data.get("moe_intermediate_size") or routed.intermediate)
    elif data.get("shared_expert_intermediate_size"):  # Qwen2-MoE: not named by its tp plan, so kept whole
        shared, gate, split = data["shared_expert_intermediate_size"], True, False
    return MoESpec(routed, data["num_hidden_layers"] - routed.sparse_layers, shared, gate, split,
                   router="router" if model_type == "gpt_oss" else "gate", router_bias=model_type == "gpt_oss",
                   tp_not_modelled=TP_NOT_MODELLED.get(model_type))


# ---- per layout -------------------------------------------------------------------------------------------------
def figures(model: ModelSpec, layout: Layout, setting: Setting) -> ExpertFigures:
    """`experts.expert_figures` of `layout` (ep carved out of its fsdp ranks) running `setting`."""
    assert model.moe is not None
    return expert_figures(model.moe.routed, layout.fsdp, layout.ep, setting.tokens(layout), setting.accumulation,
                          setting.compute_bytes, setting.checkpointing, setting.optimizer)


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


def block_activations(model: ModelSpec, layout: Layout, setting: Setting) -> tuple[float, str]:
    """Bytes per token a sparse layer's mixture-of-experts block saves for backward (module docstring)."""
    assert model.moe is not None
    moe, c, t = model.moe, setting.compute_bytes, layout.tp
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


def active_matmul(model: ModelSpec) -> int:
    """Routed-expert weights in matrix multiplies per token: the k experts each token goes to, in every sparse
    layer."""
    assert model.moe is not None
    return model.moe.sparse_layers * model.moe.routed.top_k * model.moe.expert_matmul


def expert_groups(layout: Layout) -> tuple[list[int], list[int]]:
    """Global ranks of rank 0's ep group and of its expert_shard group: the fsdp ranks in their own order (sp
    fastest, then cp, then dp_shard) cut into consecutive groups of ep; expert_shard takes one from each."""
    fsdp = layout.group(("dp_shard", "cp", "sp"))
    return fsdp[:layout.ep], fsdp[::layout.ep]
