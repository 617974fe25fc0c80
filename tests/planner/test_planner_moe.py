"""``ndparallel plan`` over mixtures of experts (`ndparallel.planner.moe`): the model spec against the models
transformers builds, expert parallelism as a searched axis, and the predictions against what the library measures.

The measured check runs benchmarks/planner_check_moe.py's cases -- a Qwen3-MoE with a dense layer and sparse ones,
without ep, under ep over every fsdp rank, ep with the experts sharded further, HSDP x ep in bf16 with accumulation,
tp x ep, cp x ep, ep with activation checkpointing -- on forked gloo ranks: model states per rank, bytes per
collective (the all-to-alls: their mean over the ranks, which the routing does not change) and calls, and the
activations saved for backward must match the planner. Other expected numbers are hand arithmetic written out here,
never the planner's own output.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import planner_check_moe as bench  # noqa: E402  (measures the library on forked ranks)
from ndparallel.cli import main  # noqa: E402
from ndparallel.planner import Layout, Request, Recipe, get_hardware, load_model, spec_from_config  # noqa: E402
from ndparallel.planner.comm import by_kind, transfers  # noqa: E402
from ndparallel.planner.layouts import Constraints, valid_layouts  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.planner.mixture import EP_TYPES, TP_NOT_MODELLED  # noqa: E402
from ndparallel.planner.search import evaluate  # noqa: E402

# ---- the spec against the real models ----------------------------------------------------------------------------
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], head_dim=8),
    "qwen3_moe_every_2nd": dict(model_type="qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=2, attention_bias=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                        first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=8,
                        qk_nope_head_dim=8, n_group=2, topk_group=1, num_key_value_heads=4),
    "deepseek_v3_no_q_lora": dict(model_type="deepseek_v3", moe_intermediate_size=16, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2, kv_lora_rank=8,
                                  q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=2,
                                  topk_group=1, num_key_value_heads=4, attention_bias=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8),
    "qwen2_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=24),
}


def _generic(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name.removeprefix("model."))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_spec_counts_every_weight_of_the_model_transformers_builds(family):
    """Every weight, by name (layer indices aside), element count and first dimension (what FSDP2 pads), and the
    total: exactly those of transformers' model built from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[family])
    config = AutoConfig.for_model(extra.pop("model_type", family), **{**COMMON, **extra})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    spec = spec_from_config(json.loads(config.to_json_string()), family)
    assert spec.moe is not None
    real = collections.Counter((_generic(n), p.numel(), p.shape[0]) for n, p in model.named_parameters())
    planned = collections.Counter((_generic(p.name), math.prod(p.shape), p.shape[0]) for p in spec.parameters())
    assert planned == real
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", "30.5", "3.3"), ("mixtral-8x7b", "46.7", "12.9")])
def test_builtin_mixtures_have_their_published_sizes(name, total, active):
    """The model cards' sizes, to their rounding (0.05 B either way): Qwen3-30B-A3B "30.5B in total and 3.3B
    activated" (3.35 B here: the card truncates), Mixtral 8x7B 46.7B with 12.9B used per token."""
    model = load_model(name)
    assert model.num_parameters() / 1e9 == pytest.approx(float(total), abs=0.055)
    assert model.active_parameters() / 1e9 == pytest.approx(float(active), abs=0.055)


def test_the_families_planned_with_ep_are_those_the_library_splits():
    """EP_TYPES is read from the library's family table (no copy to keep in step): every family built above is in
    it, and the families planned without tp are among them."""
    assert {spec.get("model_type", name) for name, spec in FAMILIES.items()} <= set(EP_TYPES)
    assert set(TP_NOT_MODELLED) <= set(EP_TYPES)


# ---- by hand -----------------------------------------------------------------------------------------------------
def _tiny_mixtral(**extra):
    return spec_from_config({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 32,
                             "vocab_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2, **extra}, "tiny")


def test_states_and_bytes_of_ep_with_sharded_experts_by_hand():
    """dp_shard 4, ep 2 (expert_shard 2), fp32, 32 tokens per rank: the experts' E / ep, then / expert_shard; the
    tokens' all-to-alls; FSDP2 over fsdp for the rest and over expert_shard for the experts."""
    model = _tiny_mixtral()
    layer = 2 * 64 + 64 * 64 * 2 + 32 * 64 * 2 + 4 * 64  # norms, q and o, k and v, router
    root = 256 * 64 * 2 + 64  # embedding, head, final norm
    held = (2 * layer + root) // 4  # every first dimension divides 4: no padding
    experts = 2 * (4 * 64 * 64 + 4 * 64 * 32) // 2 // 2  # 2 layers of gate_up (E, 2I, h) and down (E, h, I)
    recipe = Recipe(32, 1, 1, "fp32")
    layout = Layout(dp_shard=4, ep=2)
    memory = estimate(model, layout, recipe)
    assert (memory["params"], memory["optimizer"]) == (4 * (held + experts), 8 * (held + experts))
    items = {item.purpose: item for item in transfers(model, layout, recipe, gpus_per_node=8)}
    tokens = items["expert all-to-all: tokens"]
    # 2 layers x (forward + backward) x 2 directions x 32 tokens x top-2 x 64 x 4 B, half of it leaving the rank
    assert (tokens.bytes, tokens.calls, tokens.group_size) == (2 * 2 * 2 * 32 * 2 * 64 * 4 / 2, 8, 2)
    assert items["expert all-to-all: routing counts"].bytes == 2 * 4 * 8 / 2
    assert items["FSDP2 expert all-gather"].bytes == 1 * 2 * experts * 4  # (2-1) ranks, forward and backward
    assert items["FSDP2 expert gradient reduce-scatter"].bytes == experts * 4
    assert items["FSDP2 parameter all-gather"].bytes == 3 * (2 * held - root // 4) * 4
    without = {item.purpose: item for item in transfers(model, Layout(dp_shard=4), recipe, gpus_per_node=8)}
    assert "expert all-to-all: tokens" not in without  # no ep: the experts are gathered with their layer
    # E / fsdp experts each, as many as E / ep / expert_shard above, now gathered with their layer over fsdp
    assert without["FSDP2 parameter all-gather"].bytes == 3 * (2 * (held + experts) - root // 4) * 4


def test_compute_counts_the_active_experts_only():
    """With links that cost nothing, the step is compute over the FLOPs of the top-k experts (not all E) plus the
    optimizer; under tp 2 the experts and routers, whole on each tp rank, are multiplied twice."""
    model = _tiny_mixtral()
    hw = get_hardware("h100")
    free = dataclasses.replace(hw, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, intra_node_latency_s=0.0,
                               inter_node_latency_s=0.0)
    split = 2 * (64 * 64 * 2 + 32 * 64 * 2) + 64 * 256  # attention and head
    whole = 2 * 4 * 64 + 2 * 2 * 3 * 64 * 32  # routers, and 2 of the 4 experts (gate, up, down) in each layer
    attention = 2 * 2 * (64 + 64) * 16  # forward QK and AV, 16 keys on average under the causal mask
    for tp in (1, 2):
        request = Request(model, free, 1, 4, 32, 32 * 16, checkpointing="off")
        row = evaluate(request, Layout(dp_shard=4 // tp, tp=tp), Recipe(32, 16 // (4 // tp), 1, "bf16"))
        flops = 32 * 16 * (6 * (split + tp * whole) + 3 * attention) / 4
        optimizer_s = row.timing.optimizer_s
        assert row.timing.step_s == pytest.approx(flops / (989e12 * hw.compute_efficiency) + optimizer_s, rel=1e-9)
    assert model.flops_per_token(32) == 6 * (split + whole) + 6 * 2 * (64 + 64) * 32  # MFU: the whole score matrix


def test_ep_is_searched_with_the_other_axes():
    model = _tiny_mixtral()
    ok, refused = valid_layouts(8, Constraints(model, 32, 16, gpus_per_node=8))
    eps = collections.defaultdict(set)
    for layout in ok:
        eps[dataclasses.replace(layout, ep=1)].add(layout.ep)
    assert eps[Layout(dp_shard=8)] == {1, 2, 4}  # divisors of 8 that divide the 4 experts
    assert eps[Layout(dp_shard=2, tp=4)] == {1, 2} and eps[Layout(dp_replicate=2, tp=4)] == {1}  # fsdp 1: no ep
    assert all(layout.pp == 1 for layout in ok)
    assert any("pipeline stages of a mixture of experts are not modelled" in w for w in refused[Layout(pp=2,
                                                                                                       dp_shard=4)])
    ok, refused = valid_layouts(8, Constraints(model, 32, 16, gpus_per_node=8, ep=4))
    assert ok and all(layout.ep == 4 and layout.fsdp % 4 == 0 for layout in ok)
    assert "ep_size=4 must divide the ranks the experts are split over, dp_shard(2) * cp(1) * sp(1) = 2" in \
        refused[Layout(dp_shard=2, tp=4, ep=4)]
    deepseek = spec_from_config({**COMMON, **FAMILIES["deepseek_v3"], "model_type": "deepseek_v3"}, "deepseek")
    _, refused = valid_layouts(2, Constraints(deepseek, 32, 2, gpus_per_node=8))
    assert refused[Layout(tp=2)] == ["tp=2: not modelled for deepseek_v3 (its plan leaves the multi-head latent "
                                     "attention whole on every tp rank; the library runs it)"]


# ---- the command -------------------------------------------------------------------------------------------------
def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def tiny_moe(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(bench.moe_config(bench.options()).to_dict()))
    return str(tmp_path)


PLAN = ("plan", "--gpu", "h100", "--gpus-per-node", "4", "--seq-len", "32", "--global-batch-tokens", "256")


def test_plan_ranks_ep_layouts_and_their_figures_are_estimate_memorys(capsys, tiny_moe):
    code, out, _ = _run(capsys, *PLAN, "--model", tiny_moe, "--top", "100")
    assert code == 0 and "top-2 of 4 experts in 2 of 3 layers" in out
    assert re.search(r"^\s*\d+\s+dp_shard=4,ep=2\s", out, re.M) and re.search(r"^\s*\d+\s+dp_shard=4\s", out, re.M)
    code, text, _ = _run(capsys, *PLAN, "--model", tiny_moe, "--json", "--top", "100", "--ep-size", "2")
    rows = json.loads(text)["rows"]
    assert code == 0 and rows and all(row["ep"] == 2 and "ep_size=2" in row["parallelism_config"] for row in rows)
    row = next(r for r in rows if r["layout"]["dp_shard"] == 4)
    code, text, _ = _run(capsys, "estimate-memory", "--model", tiny_moe, "--seq-len", "32", "--dp-shard-size", "4",
                         "--ep-size", "2", "--micro-batch-size", str(row["micro_batch"]),
                         "--gradient-accumulation-steps", str(row["gradient_accumulation_steps"]),
                         "--activation-checkpointing", "on" if row["activation_checkpointing"] else "off",
                         "--chunked-loss", "on" if row["chunked_loss"] else "off",
                         *(["--tiled-mlp"] if row["tiled_mlp"] else []), *(["--offload"] if row["offload"] else []),
                         "--json")
    estimated = json.loads(text)
    assert code == 0 and estimated["experts"] == row["experts"]
    assert {k: estimated["memory_bytes"][k] for k in ("params", "grads", "optimizer", "activations")} == \
        {k: row["memory_bytes"][k] for k in ("params", "grads", "optimizer", "activations")}


def test_plan_writes_ep_into_the_config_file(capsys, tiny_moe, tmp_path):
    from ndparallel.configuration.parallelism import ParallelismConfig

    code, _, _ = _run(capsys, *PLAN, "--model", tiny_moe, "--ep-size", "4", "--write-config",
                      str(tmp_path / "plan.yaml"))
    assert code == 0 and ParallelismConfig.from_yaml(tmp_path / "plan.yaml").ep_size == 4


@pytest.mark.parametrize("argv, message", [
    (("--ep-size", "3"), "--ep-size 3 must divide the experts of tiny-moe: its 8 experts cannot be split over 3 "
                         "ranks; use an ep_size in [1, 2, 4, 8]"),
    (("--ep-size", "8"), "ep: --ep-size 8 needs dp_shard x cp x sp to be a multiple of 8"),  # 4 GPUs
    (("--ep-size", "0"), "--ep-size must be a positive integer, got 0"),
])
def test_plan_refuses_an_ep_that_cannot_split_the_experts(capsys, tmp_path, argv, message):
    config = bench.moe_config(bench.options(experts=8)).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "_name": "tiny-moe"}))
    code, _, err = _run(capsys, *PLAN, "--model", str(tmp_path), *argv)
    assert code == 2 and message in err


def test_plan_refuses_ep_for_a_dense_model(capsys):
    code, _, err = _run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "4096",
                        "--global-batch-tokens", "65536", "--ep-size", "2")
    assert code == 2 and "--ep-size 2: meta-llama/Llama-3.1-8B is not a mixture of experts" in err


# ---- measured on forked ranks ------------------------------------------------------------------------------------
ARGS = bench.options()


@pytest.fixture(scope="module")
def measured() -> dict:
    return {case[0]: bench.run_case(ARGS, case) for case in bench.CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case", bench.CASES, ids=bench.CASE_NAMES)
def test_planner_matches_the_library_on_mixture_of_experts_layouts(measured, case):
    memory, items = bench.predict(ARGS, case)
    ranks = measured[case[0]]
    for rank in ranks:  # model states: params, grads, AdamW's moments (the experts' included), each within 1%
        for part in ("params", "grads", "optimizer"):
            assert rank["states"][part] == pytest.approx(memory[part], rel=0.01), (part, rank["states"])
    predicted = by_kind(items)
    assert set(predicted) == {kind for kind, value in ranks[0]["bytes"].items() if value or kind in predicted}
    for kind, value in predicted.items():  # bytes per collective within 2% (mean over ranks), calls exactly
        mean = sum(r["bytes"][kind] for r in ranks) / len(ranks)
        assert mean == pytest.approx(value, rel=0.02), (kind, [r["bytes"] for r in ranks])
        calls = sum(item.calls for item in items if item.kind == kind)
        assert all(r["calls"][kind] == calls for r in ranks), (kind, [r["calls"] for r in ranks])
    if case[5]:
        return  # checkpointed layers keep their inputs inside torch's checkpoint, out of reach of the hooks
    saved = sum(r["saved"] for r in ranks) / len(ranks)  # the experts' rows depend on the routing: the mean
    assert saved == pytest.approx(memory["activations"], rel=0.05), (saved, memory["activations"])
