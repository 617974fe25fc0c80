"""What tensor parallelism needs to know about each causal-LM family, as data (by ``config.model_type``).

A family needs at most: a plan (where the model carries none, or where ndparallel's splits more than the model's
own), and the names of its fused layers -- layers whose weight packs several projections along its output features
(Phi-3's ``qkv_proj`` and ``gate_up_proj``, GPT-2's ``c_attn``). Tied input/output embeddings, per-head q/k norms
and mixtures of experts need no entry: the plan resolution handles them for every model (`ndparallel.parallel.tensor`).

Fused layers are split as one matrix and their output all-gathered ("colwise_gather_output", as transformers' own
Phi-3 plan does); the model then slices q/k/v or gate/up from the whole output by the global sizes it knows, and the
layer after it takes its share of the input ("rowwise_split_input"). A plan that leaves a fused layer's output split
("colwise") is refused: each rank would hold whole projections (rank 0 all of gate, rank 1 all of up) and the model's
slicing would pair the wrong halves. Splitting the weight per projection instead (each rank a slice of q, of k and
of v) cannot be stored by ``torch.distributed.checkpoint``, whose shards must be single blocks (it refuses such a
DTensor with "overlapping chunks"), and FSDP2 composes its own sharding wrongly on the same dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Family:
    """Tensor-parallel facts about one family of models."""

    plan: Mapping[str, str] | None = None  # ndparallel's plan; None: the model's own (config.base_model_tp_plan)
    replaces_own_plan: str | None = None  # why `plan` is used even when the model has a plan of its own
    fused: Mapping[str, str] = field(default_factory=dict)  # layer pattern -> the projections packed in it


FAMILIES: dict[str, Family] = {
    "llama": Family(plan=_DECODER_PLAN),
    "qwen2": Family(plan=_DECODER_PLAN),
    "mistral": Family(plan=_DECODER_PLAN),
    # transformers has no plan for GPT-2. Its attention slices q/k/v from c_attn's output by the whole width.
    "gpt2": Family(
        plan={
            "wte": "embedding_rowwise",
            "h.*.attn.c_attn": "colwise_gather_output",
            "h.*.attn.c_proj": "rowwise_split_input",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        fused={"attn.c_attn": "q, k and v"},
    ),
    # transformers' own Phi-3 plan gathers both fused layers' outputs: used as it is.
    "phi3": Family(fused={"self_attn.qkv_proj": "q, k and v", "mlp.gate_up_proj": "gate and up"}),
    # OLMo 2 normalises q and k over the whole projection; transformers' plan all-gathers q, k and v for that, so
    # every rank computes attention over all heads. Here the norms run split (their mean all-reduced) instead.
    "olmo2": Family(
        plan={
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.q_norm": "sharded_norm",
            "layers.*.self_attn.k_norm": "sharded_norm",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        replaces_own_plan="it splits the attention heads: the q/k norms over the whole projection run on split "
                          "features ('sharded_norm') where transformers' plan all-gathers q, k and v",
    ),
}

# The built-in plans by model type (llama, qwen2, mistral, gpt2, olmo2).
BUILTIN_PLANS: dict[str, dict[str, str]] = {name: dict(f.plan) for name, f in FAMILIES.items() if f.plan}
