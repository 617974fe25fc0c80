"""The model families ndparallel knows, by ``config.model_type``: one `Family` entry each, as data.

Every reader asks this table and nothing else names a model type or an expert config field
(tests/core/test_families_table.py fails on one outside ``ndparallel.models``): tensor parallelism (the plan, fused
layers: `ndparallel.parallel.tensor`), expert parallelism (the experts, their router and count:
`ndparallel.parallel.experts`), pipeline stages (the routers of the load-balancing loss), checkpoints (Hub per-expert
names: `ndparallel.checkpoint.per_expert`), metrics (FLOPs per token) and ``ndparallel plan`` (`Planned`: what it
models of a family; `expert_entries`: the fields it reads a mixture of experts with). Adding a family is one entry
here plus its tests: docs/architecture.md, "Adding a model family".

Tensor parallelism: a family needs at most a plan (where the model carries none, or where ndparallel's splits more
than the model's own), and the names of its fused layers -- layers whose weight packs several projections along its
output features (Phi-3's ``qkv_proj`` and ``gate_up_proj``, GPT-2's ``c_attn``). Tied input/output embeddings,
per-head q/k norms and mixtures of experts need no entry: the plan resolution handles them for every model
(`ndparallel.parallel.tensor`).

Fused layers ("packed_colwise", `styles.PackedColwise`): each rank ends up with its slice of every projection
packed in the layer -- its heads of q, of k and of v; its part of gate and of up -- so the model's own slicing and
attention run on this rank's heads alone, and the layer after it is an ordinary "rowwise" one. The weight itself is
split as one matrix (contiguous rows) and the layer's output re-laid per projection by one all-to-all over tp: a
weight split per projection cannot be stored by ``torch.distributed.checkpoint``, whose shards must be single blocks
(it refuses such a DTensor with "overlapping chunks"), so this keeps checkpoints, exports and resharding exactly as
for any colwise layer. The all-to-all moves (tp-1)/tp of the layer's local output at most -- less than the
all-gather of the whole output that transformers' own Phi-3 plan ("colwise_gather_output") needs before every rank
computes all heads. A model whose attention slices q/k/v by its global sizes is told its local ones (`Fused.local`:
attributes of the layer's parent divided by tp; a dotted name is read through the parent's config, which gets a
view of its own). A plan that leaves a fused layer's output split as one matrix ("colwise") is refused: rank 0 would
hold all of gate, rank 1 all of up, and the model's slicing would pair the wrong halves.

Expert parallelism (``ep_size``, `ndparallel.parallel.experts`): a mixture-of-experts family names its routed experts
and its router (`Experts`). Only the experts module is replaced: its call -- hidden states, each token's top-k expert
indices and weights, as the model's own router chose them -- sends each token to the ranks holding its experts and
back; the router, shared experts and dense layers run as in one process. A family the table has no `Experts` entry
for is refused under ep_size > 1.

This module imports nothing of ndparallel nor torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_DECODER_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
# OLMo 2 and OLMoE normalise q and k over the whole projection; transformers' plans all-gather q, k and v for that, so
# every rank computes attention over all heads. Here the norms run split (their mean all-reduced) instead.
_OLMO_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.q_norm": "sharded_norm",
    "layers.*.self_attn.k_norm": "sharded_norm",
    "layers.*.self_attn.o_proj": "rowwise",
}
_OLMO_REASON = ("it splits the attention heads: the q/k norms over the whole projection run on split features "
                "('sharded_norm') where transformers' plan all-gathers q, k and v")


@dataclass(frozen=True)
class Fused:
    """A layer packing several projections along its output features."""

    what: str  # the projections, for messages ("q, k and v")
    parts: Callable[[Any], tuple[int, ...]]  # config -> their relative sizes, in order (q, k, v: heads, kv, kv)
    local: tuple[str, ...] = ()  # attributes of the layer's parent (or "config.<field>") that count them globally


@dataclass(frozen=True)
class PerExpertNames:
    """How a Hub checkpoint stores a family's routed experts: one (out, in) weight per expert and projection,
    ``...layers.<L>.<experts module>.<N>.<projection>.weight``, where the model stacks them. As transformers' own
    conversion (``transformers.conversion_mapping``, which ``from_pretrained`` applies): each stacked parameter is its
    projections' per-expert weights stacked along a new dimension 0 (the experts) and concatenated, in the order
    given, along dimension 1 (output features) -- ``gate_up_proj`` (E, 2 x intermediate, hidden) holds gate's rows,
    then up's -- with no transpose. `renamed` turns the checkpoint's names into the model's (every tensor's, the
    router's included) before the experts are matched. Read by ``cpu_ram_efficient_loading``
    (`ndparallel.checkpoint.per_expert`)."""

    stacked: Mapping[str, tuple[str, ...]]  # stacked parameter -> the per-expert projections it concatenates
    renamed: Mapping[str, str] = field(default_factory=dict)  # checkpoint name fragment -> the model's


# Qwen2/3-MoE, DeepSeek-V3 and OLMoE (transformers' "qwen2_moe" conversion, which the others share).
_GATE_UP_DOWN = PerExpertNames({"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
# Mixtral: w1 is the gate, w3 up, w2 down, under ``block_sparse_moe`` (transformers' "mixtral" conversion).
_MIXTRAL = PerExpertNames({"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}, renamed={".block_sparse_moe.": ".mlp."})


@dataclass(frozen=True)
class Shared:
    """Experts every token goes through beside its routed ones (dense, as in one process)."""

    what: str  # for messages and the README
    modules: str  # their module under a decoder layer (gate_proj, up_proj, down_proj)
    count: str | None = None  # the config field: how many, each as wide as a routed expert (DeepSeek-V3)
    width: str | None = None  # the config field: their intermediate size (Qwen2-MoE)
    gate: str | None = None  # a module under a decoder layer scaling their output by a sigmoid (Qwen2-MoE)
    split: bool = True  # the family's tensor-parallel plan splits them (else they stay whole on every tp rank)


@dataclass(frozen=True)
class Experts:
    """Where a mixture-of-experts family keeps its routed experts and router, the config fields that shape them, and
    what routes (for messages and the README). The experts module is transformers' stacked layout: one parameter per
    projection with the experts along dimension 0 (``gate_up_proj``: (experts, 2 x intermediate, hidden), ...),
    called as ``experts(hidden_states, top_k_index, top_k_weights)``."""

    count: str  # the config field holding the number of routed experts
    routing: str  # how the router picks each token's experts (what the README says)
    modules: str = "mlp.experts"  # the experts module under a decoder layer (sparse layers only)
    router: str = "mlp.gate"  # the router module under a decoder layer
    shared: Shared | None = None  # what runs beside the routed experts on every token
    balancing: str = "load-balancing loss over the global batch"  # the router's auxiliary loss, or its absence
    per_expert: PerExpertNames | None = None  # the Hub checkpoints' per-expert names (None: none known)
    top_k: str = "num_experts_per_tok"  # the config field: experts per token
    width: str = "moe_intermediate_size"  # the config field: one expert's intermediate size (absent: intermediate_size)
    first_dense: str | None = None  # the config field: the first k decoder layers are dense (DeepSeek-V3)
    dense_listed: str | None = None  # the config field listing dense decoder layers (Qwen-MoE)
    sparse_step: str | None = None  # the config field: every k-th decoder layer is sparse (Qwen-MoE)
    bias: bool = False  # the experts have biases (gpt-oss)
    router_bias: bool = False  # the router has a bias (gpt-oss)


@dataclass(frozen=True)
class RouterLoss:
    """How transformers' mixture-of-experts causal LMs (every family above) add their load-balancing loss:
    ``coefficient * load_balancing_loss_func(router_logits, experts, top_k)`` when the config's `switch` is on; the
    three arguments are attributes of the causal LM (`ndparallel.parallel.moe`, pipeline stages' `balancing`)."""

    switch: str = "output_router_logits"  # config field
    experts: str = "num_experts"  # model attributes, from here on
    top_k: str = "num_experts_per_tok"
    coefficient: str = "router_aux_loss_coef"

    def on(self, config: Any) -> bool:
        return bool(getattr(config, self.switch, False))

    def declared(self, config: Any) -> bool:
        """Whether `config` has the switch at all (on or off): a mixture of experts that can add the loss."""
        return getattr(config, self.switch, None) is not None

    def attributes(self) -> tuple[str, str, str]:
        return self.experts, self.top_k, self.coefficient

    def arguments(self, model: Any) -> tuple[int, int, float]:
        """(experts, top_k, coefficient) of a causal LM."""
        return getattr(model, self.experts), getattr(model, self.top_k), float(getattr(model, self.coefficient))


ROUTER_LOSS = RouterLoss()


@dataclass(frozen=True)
class ConfigNames:
    """The config fields through which a family gives its size, where they are not transformers' usual names (a
    transformers config maps them by its ``attribute_map``; a dict or another object need the family's own)."""

    hidden: str = "hidden_size"
    layers: str = "num_hidden_layers"
    heads: str = "num_attention_heads"


@dataclass(frozen=True)
class Planned:
    """What ``ndparallel plan`` models of a family (`ndparallel.planner.model`): the Llama shape -- q/k/v/o attention,
    a gated MLP, Megatron's tensor-parallel split, the experts of `Experts` -- with these differences. A family
    without one is modelled as a Llama-style decoder, with a warning."""

    qkv_bias: bool = False  # biases on q, k and v and none on o, whatever attention_bias says (Qwen2)
    qkv_bias_field: str | None = None  # the config field that turns those biases off (Qwen2-MoE; absent: on)
    qk_norm: bool = False  # per-head RMSNorms of q and k (Qwen3-MoE)
    sinks: bool = False  # a learned attention logit per head (gpt-oss)
    tp_not_modelled: str | None = None  # why the planner does not model the family's tensor-parallel plan


@dataclass(frozen=True)
class Family:
    """Facts about one family of models: tensor-parallel (plan, fused layers), expert-parallel (experts), its config
    fields, and what the planner models of it."""

    plan: Mapping[str, str] | None = None  # ndparallel's plan; None: the model's own (config.base_model_tp_plan)
    replaces_own_plan: str | None = None  # why `plan` is used even when the model has a plan of its own
    fused: Mapping[str, Fused] = field(default_factory=dict)  # layer pattern (under a block) -> what it packs
    experts: Experts | None = None  # a mixture of experts: where its experts and router are
    names: ConfigNames = ConfigNames()
    planned: Planned | None = None  # what ``ndparallel plan`` models of it; None: a Llama-style decoder, with a warning
    # its attention class whose forward head-chunked attention blocks reproduce op for op (`parallel.sequence.block`)
    chunked_attention: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(plan=_DECODER_PLAN, planned=Planned(), chunked_attention="LlamaAttention"),
    "mistral": Family(plan=_DECODER_PLAN, planned=Planned()),
    "qwen2": Family(plan=_DECODER_PLAN, planned=Planned(qkv_bias=True)),
    # transformers has no plan for GPT-2. Its attention splits c_attn's output into q, k and v by `split_size`.
    "gpt2": Family(
        plan={
            "wte": "embedding_rowwise",
            "h.*.attn.c_attn": "packed_colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        fused={"attn.c_attn": Fused("q, k and v", lambda config: (1, 1, 1), local=("split_size",))},
        names=ConfigNames(hidden="n_embd", layers="n_layer", heads="n_head"),
    ),
    # Phi-3 slices q from qkv_proj's output by config.num_attention_heads, k and v by its num_key_value_heads.
    "phi3": Family(
        plan={
            "layers.*.self_attn.qkv_proj": "packed_colwise",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_up_proj": "packed_colwise",
            "layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        replaces_own_plan="it splits the attention heads and the MLP per projection ('packed_colwise') where "
                          "transformers' plan all-gathers qkv_proj's and gate_up_proj's outputs",
        fused={
            "self_attn.qkv_proj": Fused(
                "q, k and v", lambda c: (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads),
                local=("num_key_value_heads", "config.num_attention_heads")),
            "mlp.gate_up_proj": Fused("gate and up", lambda config: (1, 1)),
        },
    ),
    "olmo2": Family(
        plan={**_OLMO_ATTENTION, "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
              "layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather_output"},
        replaces_own_plan=_OLMO_REASON,
    ),
    # Mixtures of experts: transformers' own plans (attention and dense layers split, experts whole on every tp rank).
    "qwen3_moe": Family(
        experts=Experts("num_experts", "softmax over the experts, top-k (renormalised with norm_topk_prob)",
                        per_expert=_GATE_UP_DOWN, dense_listed="mlp_only_layers", sparse_step="decoder_sparse_step"),
        planned=Planned(qk_norm=True)),
    "qwen2_moe": Family(
        experts=Experts("num_experts", "softmax over the experts, top-k (renormalised with norm_topk_prob)",
                        shared=Shared("shared_expert, scaled by sigmoid(shared_expert_gate)", "mlp.shared_expert",
                                      width="shared_expert_intermediate_size", gate="mlp.shared_expert_gate",
                                      split=False),  # transformers' plan does not name them
                        per_expert=_GATE_UP_DOWN, dense_listed="mlp_only_layers", sparse_step="decoder_sparse_step"),
        planned=Planned(qkv_bias=True, qkv_bias_field="qkv_bias")),
    "mixtral": Family(experts=Experts("num_local_experts", "softmax over the experts, top-k, renormalised",
                                      per_expert=_MIXTRAL), planned=Planned()),
    # No auxiliary loss: a score-correction bias (a buffer) steers the routing instead; the first
    # first_k_dense_replace layers are dense. Its plan is the one transformers gave it up to 5.24: the dense and shared
    # MLPs split, attention whole. 5.25's splits multi-head latent attention with a style of its own
    # ('mla_kv_a_proj': the rotary keys' gradient summed over tp), which ndparallel does not apply yet.
    "deepseek_v3": Family(
        plan={
            "layers.*.mlp.shared_experts.gate_proj": "colwise",
            "layers.*.mlp.shared_experts.up_proj": "colwise",
            "layers.*.mlp.shared_experts.down_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
        replaces_own_plan="transformers 5.25's plan splits multi-head latent attention with 'mla_kv_a_proj', a style "
                          "ndparallel does not apply yet: attention stays whole on every tp rank, as with the plan "
                          "transformers gave DeepSeek-V3 up to 5.24",
        experts=Experts("n_routed_experts", "sigmoid scores, top groups (n_group, topk_group), top-k with the "
                                            "score-correction bias, scaled",
                        shared=Shared("shared_experts", "mlp.shared_experts", count="n_shared_experts"),
                        balancing="none (score-correction bias)", per_expert=_GATE_UP_DOWN,
                        first_dense="first_k_dense_replace"),
        planned=Planned(tp_not_modelled="its plan leaves the multi-head latent attention whole on every tp rank"),
    ),
    # Experts with biases and a clamped SwiGLU; the router has a bias and takes a softmax over its top-k logits. Its Hub
    # checkpoints store the experts stacked (no per-expert names).
    "gpt_oss": Family(experts=Experts("num_local_experts", "top-k of the logits (with a bias), softmax over those k",
                                      router="mlp.router", bias=True, router_bias=True),
                      planned=Planned(sinks=True, tp_not_modelled="its plan splits only the embedding and the head")),
    # OLMoE: every layer sparse, q/k norms over the whole projection as OLMo 2 (split the same way: the plan carries
    # no MLP entries, its experts and router stay whole on every tp rank). Not modelled by the planner (its q/k norms).
    "olmoe": Family(
        plan={**_OLMO_ATTENTION, "lm_head": "colwise_gather_output"},
        replaces_own_plan=_OLMO_REASON,
        experts=Experts("num_experts", "softmax over the experts, top-k (renormalised with norm_topk_prob)",
                        per_expert=_GATE_UP_DOWN),
    ),
}

# The built-in plans by model type (llama, mistral, qwen2, gpt2, olmo2, ...).
BUILTIN_PLANS: dict[str, dict[str, str]] = {name: dict(f.plan) for name, f in FAMILIES.items() if f.plan}
# What a family the table lacks is read as: transformers' usual experts (mlp.experts, router mlp.gate, no biases).
USUAL_EXPERTS = Experts(count="", routing="")


# ---- asking the table ---------------------------------------------------------------------------------------------
def family(model_type: str | None) -> Family | None:
    """The entry for `model_type`, or None."""
    return FAMILIES.get(model_type)  # type: ignore[arg-type]


def experts_of(model_type: str | None) -> Experts | None:
    """The `Experts` entry of `model_type`'s family (None: not a mixture of experts the table knows)."""
    entry = family(model_type)
    return entry.experts if entry is not None else None


def expert_types() -> tuple[str, ...]:
    """The families whose experts expert parallelism splits (an `Experts` entry)."""
    return tuple(name for name, entry in FAMILIES.items() if entry.experts is not None)


def planned_types() -> tuple[str, ...]:
    """The families ``ndparallel plan`` models (a `Planned` entry)."""
    return tuple(name for name, entry in FAMILIES.items() if entry.planned is not None)


def chunked_attention_types() -> dict[str, str]:
    """Model type -> its attention class, for the families whose attention blocks run over head chunks whole
    (`Family.chunked_attention`)."""
    return {name: entry.chunked_attention for name, entry in FAMILIES.items() if entry.chunked_attention}


def planned(model_type: str | None) -> Planned | None:
    """What ``ndparallel plan`` models of `model_type`'s family (None: not modelled, a Llama-style decoder)."""
    entry = family(model_type)
    return entry.planned if entry is not None else None


def expert_count_fields() -> tuple[str, ...]:
    """Every config field through which a family gives its number of routed experts, in table order."""
    return tuple(dict.fromkeys(e.count for e in expert_entries()))


def config_names(quantity: str) -> tuple[str, ...]:
    """Every config field a family gives `quantity` ("hidden", "layers", "heads") by, the usual name first."""
    return tuple(dict.fromkeys([getattr(ConfigNames(), quantity)]
                               + [getattr(entry.names, quantity) for entry in FAMILIES.values()]))


def _value(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def expert_counts(config: Any) -> dict[str, int]:
    """The expert-count fields (of any family) that `config` -- a config object or a config dict -- sets to an int."""
    found = {name: _value(config, name) for name in expert_count_fields()}
    return {name: value for name, value in found.items() if isinstance(value, int)}


def expert_entries() -> list[Experts]:
    """Every family's `Experts` entry, in table order: a config dict is read with all their fields (each from the
    first entry naming one the dict sets), whatever its model type, because a writer may spell a field by another
    family's name -- transformers 5.25 saves Qwen3-MoE's count as ``num_local_experts`` (its ``attribute_map``), the
    Hub's config.json as ``num_experts`` -- and a new mixture is read by the fields it shares with the known ones."""
    return [entry.experts for entry in FAMILIES.values() if entry.experts is not None]
