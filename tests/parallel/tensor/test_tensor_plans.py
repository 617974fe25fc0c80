"""Tier 1 (no processes): where tensor-parallel plans come from, how patterns match modules, what the
Megatron-SP form adds, and the checks that run before any collective."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from ndparallel import TorchTensorParallelConfig
from ndparallel.parallel.tensor import (
    BUILTIN_PLANS,
    STYLES,
    check_plan,
    choose_plan,
    hf_plan,
    resolve_plan,
    tensor_parallel_styles,
    with_sequence_parallel,
)
from tiny_models import PLAIN_PLAN, build_model


def test_hf_model_plan_is_prefixed_with_the_base_model_and_includes_the_head():
    plan = hf_plan(build_model("llama"))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"


def test_plan_sources_in_order_user_argument_config_model_builtin():
    model = build_model("llama")
    assert choose_plan(model, {"lm_head": "colwise"}, {"lm_head": "rowwise"}) == \
        ({"lm_head": "colwise"}, "prepare(tp_plan=...)")
    assert choose_plan(model, None, {"lm_head": "rowwise"})[1] == "TorchTensorParallelConfig(plan=...)"
    assert choose_plan(model, None, None)[1] == "LlamaForCausalLM's own plan (config.base_model_tp_plan)"
    model.config.base_model_tp_plan = None
    plan, source = choose_plan(model, None, None)
    assert source == "ndparallel's built-in plan for 'llama'" and plan == BUILTIN_PLANS["llama"]


def test_patterns_match_one_segment_per_star_by_suffix_and_first_match_wins():
    model = build_model("llama")
    resolved = resolve_plan(model, {"layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.up_proj": "rowwise",
                                    "model.layers.*.self_attn.o_proj": "rowwise", "lm_head": "colwise_rep"})
    assert resolved == {
        "model.layers.0.mlp.up_proj": "colwise",  # the first pattern wins over the later, more specific one
        "model.layers.1.mlp.up_proj": "colwise",
        "model.layers.0.self_attn.o_proj": "rowwise",
        "model.layers.1.self_attn.o_proj": "rowwise",
        "lm_head": "colwise_gather_output",  # Hugging Face's name for it
    }
    # "*" is one whole segment, and a suffix must start at a segment boundary.
    with pytest.raises(ValueError, match="matches no module"):
        resolve_plan(model, {"layers.*.up_proj": "colwise"})  # would need "*" to span "0.mlp"
    with pytest.raises(ValueError, match="matches no module"):
        resolve_plan(model, {"p_proj": "colwise"})


def test_every_documented_style_builds():
    model = build_model("plain")
    for style in STYLES:
        assert style in ("sequence_parallel", "gather_sequence", "replicate") or _resolves(model, style)


def _resolves(model, style):
    return resolve_plan(model, {"head": style}) == {"head": style}


def test_styles_map_to_torch_layouts_with_and_without_sequence_parallel():
    model = build_model("llama")
    plain = tensor_parallel_styles(model, 2, TorchTensorParallelConfig())
    q, o = plain["model.layers.0.self_attn.q_proj"], plain["model.layers.0.self_attn.o_proj"]
    assert isinstance(q, ColwiseParallel) and q.input_layouts == (Replicate(),)
    assert isinstance(o, RowwiseParallel) and o.output_layouts == (Replicate(),)
    assert "model.norm" not in plain and all(s.src_data_rank is None for s in plain.values())

    sp = tensor_parallel_styles(model, 2, TorchTensorParallelConfig(sequence_parallel=True))
    assert isinstance(sp["model.norm"], SequenceParallel)
    assert isinstance(sp["model.layers.0.input_layernorm"], SequenceParallel)
    assert sp["model.layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)
    # q/k/v sit in a block that gathers the sequence once; the LM head gathers for itself.
    assert sp["model.layers.0.self_attn.q_proj"].input_layouts == (Replicate(),)
    assert "model.layers.0.self_attn" in sp and "model.layers.0.mlp" in sp
    assert sp["lm_head"].input_layouts == (Shard(1),) and sp["lm_head"].output_layouts == (Replicate(),)
    assert "model.embed_tokens" in sp  # not in the plan: it hands the SP region sequence shards


def test_sequence_parallel_on_a_plain_model_gathers_per_layer():
    model = build_model("plain")
    resolved = with_sequence_parallel(model, resolve_plan(model, PLAIN_PLAN))
    assert resolved["blocks.0.norm1"] == resolved["norm"] == "sequence_parallel"
    assert "blocks.0.attn" not in resolved  # no Hugging Face block convention to rely on
    styles = tensor_parallel_styles(model, 2, TorchTensorParallelConfig(plan=PLAIN_PLAN, sequence_parallel=True))
    assert styles["blocks.0.attn.q"].input_layouts == (Shard(1),)
    assert styles["embed"].output_layouts == (Shard(1),)


@pytest.mark.parametrize("tp,ok", [(2, True), (4, True), (8, False)])
def test_heads_must_divide(tp, ok):
    model = build_model("mistral")  # 8 heads, 4 KV heads
    resolved = resolve_plan(model, hf_plan(model))
    if ok:
        check_plan(model, resolved, tp)
    else:
        with pytest.raises(ValueError, match=r"tp_size=8 does not divide num_key_value_heads=4 of "
                                             r"MistralForCausalLM.*tp sizes that work: \[1, 2, 4\]"):
            check_plan(model, resolved, tp)


def test_embedding_rowwise_applies_to_embeddings_only():
    with pytest.raises(ValueError, match=r"'embedding_rowwise' applies to nn.Embedding, but 'head' is a Linear"):
        check_plan(build_model("plain"), {"head": "embedding_rowwise"}, 2)
    check_plan(build_model("plain"), {"embed": "embedding_rowwise"}, 2)
    with pytest.raises(ValueError, match=r"splits embed.num_embeddings=96 over tp_size=5"):
        check_plan(nn.ModuleDict({"embed": nn.Embedding(96, 4)}), {"embed": "embedding_rowwise"}, 5)
