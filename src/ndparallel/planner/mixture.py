"""The mixture-of-experts part of a model for ``ndparallel plan``: what a sparse decoder layer holds besides its
routed experts (`experts.ExpertSpec`), read from a Hugging Face config.

- **layers**: ``dense_layers`` decoder layers keep a dense MLP of ``intermediate_size`` (DeepSeek-V3's first
  ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``); the others hold attention, the router
  (``mlp.gate`` / gpt-oss's ``mlp.router``: experts x hidden, with a bias for gpt-oss), the shared experts where the
  family has them (DeepSeek-V3's ``shared_experts``, ``n_shared_experts x moe_intermediate_size`` wide; Qwen2-MoE's
  ``shared_expert`` and its 1 x hidden ``shared_expert_gate``) and the routed experts.
- **tensor parallelism** follows each family's own plan (transformers'): the experts and the router stay whole on
  every tp rank, so their compute is repeated on each; attention and dense MLPs are split as Megatron does for
  Mixtral and Qwen-MoE, DeepSeek-V3's shared experts are split, Qwen2-MoE's are not. DeepSeek-V3 (its MLA attention
  is left whole) and gpt-oss (only the embedding and head are split) are planned without tp (`TP_NOT_MODELLED`).

Which module is the router, where the shared experts are and which config fields give them: the family table
(`ndparallel.models.families`: `Experts`, `Shared`, `Planned`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.families import (USUAL_EXPERTS, Shared, expert_entries, expert_types, experts_of, planned,
                               planned_types)
from .experts import ExpertSpec, expert_spec

# The families the library splits experts of (an `Experts` entry in its family table): ep > 1 is refused for others.
EP_TYPES = expert_types()
# Families whose tensor-parallel plan the planner does not model, and why.
TP_NOT_MODELLED = {name: why for name in planned_types() if (why := planned(name).tp_not_modelled)}


@dataclass(frozen=True)
class MoESpec:
    """What a mixture-of-experts config adds to the decoder layers (module docstring)."""

    routed: ExpertSpec
    dense_layers: int  # decoder layers with a dense MLP (intermediate_size) instead of experts
    shared_intermediate: int = 0  # the shared experts' width; 0: none
    shared: Shared | None = None  # the family's shared experts (their modules, gate, whether tp splits them)
    router: str = USUAL_EXPERTS.router  # the router module under a decoder layer
    router_bias: bool = False
    tp_not_modelled: str | None = None  # why the planner does not model tp for this family

    @property
    def shared_gate(self) -> bool:
        """Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert."""
        return self.shared is not None and self.shared.gate is not None

    @property
    def shared_split(self) -> bool:
        """The family's tp plan splits the shared experts."""
        return self.shared is None or self.shared.split

    @property
    def sparse_layers(self) -> int:
        return self.routed.sparse_layers

    @property
    def expert_matmul(self) -> int:
        """Matrix-multiply weights of one expert (gate/up and down)."""
        e = self.routed
        return ((2 if e.gated else 1) + 1) * e.hidden * e.intermediate

    @property
    def active_matmul(self) -> int:
        """Routed-expert weights in matrix multiplies per token: the k experts each token goes to, in every sparse
        layer."""
        return self.sparse_layers * self.routed.top_k * self.expert_matmul

    def sparse_layer_parameters(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """A sparse layer's weights besides attention, norms and the routed experts: (name, shape, tp_dim)."""
        e, h, i = self.routed.experts, self.routed.hidden, self.shared_intermediate
        out: list[tuple[str, tuple[int, ...], int | None]] = [(f"{self.router}.weight", (e, h), None)]
        if self.router_bias:
            out.append((f"{self.router}.bias", (e,), None))
        if i and self.shared is not None:
            name = self.shared.modules
            col, row = (0, 1) if self.shared_split else (None, None)
            out += [(f"{name}.gate_proj.weight", (i, h), col), (f"{name}.up_proj.weight", (i, h), col),
                    (f"{name}.down_proj.weight", (h, i), row)]
        if self.shared is not None and self.shared.gate:
            out.append((f"{self.shared.gate}.weight", (1, h), None))
        return out


def moe_spec(data: dict[str, Any], source: str = "config") -> MoESpec | None:
    """The mixture-of-experts part of a Hugging Face config dict (None for a dense model)."""
    routed = expert_spec(data, source)
    if routed is None:
        return None
    model_type = data.get("model_type")
    own = experts_of(model_type) or USUAL_EXPERTS  # a family the table lacks: transformers' usual router
    shared, found = 0, None
    for entry in expert_entries():  # each shared-experts field read from the first family naming it
        named = entry.shared
        if named is not None and named.count and data.get(named.count):  # DeepSeek-V3: n x one expert's width
            shared, found = data[named.count] * (data.get(entry.width) or routed.intermediate), named
            break
        if named is not None and named.width and data.get(named.width):  # Qwen2-MoE: their own width
            shared, found = data[named.width], named
            break
    return MoESpec(routed, data["num_hidden_layers"] - routed.sparse_layers, shared, found, router=own.router,
                   router_bias=own.router_bias, tp_not_modelled=TP_NOT_MODELLED.get(str(model_type)))
