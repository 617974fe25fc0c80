"""``ndparallel plan`` / ``estimate-memory`` and the cost model behind them (`ndparallel.planner`).

The model's memory and bytes are checked against the library itself: every layout of benchmarks/run.py runs on
forked gloo ranks on a tiny Llama, and the planner's model states per rank (within 1%), bytes per collective (within
2%, and the number of calls exactly) and activations saved for backward (within 15%) must match what the run
measures. Other expected numbers are hand arithmetic written out here, never the planner's own output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from planner_check import CASES, predict, run_case  # noqa: E402  (measures the library on forked ranks)
from ndparallel.cli import main  # noqa: E402
from ndparallel.configuration.parallelism import ParallelismConfig  # noqa: E402
from ndparallel.launch.launcher import read_config_file  # noqa: E402
from ndparallel.planner import Layout, Request, Recipe, get_hardware, load_model  # noqa: E402
from ndparallel.planner.comm import by_kind, by_link, transfers  # noqa: E402
from ndparallel.planner.layouts import Constraints, all_layouts, valid_layouts  # noqa: E402
from ndparallel.planner.footprint import estimate  # noqa: E402
from ndparallel.planner.search import evaluate  # noqa: E402

GiB = 2**30


# ---- measured on forked ranks ---------------------------------------------------------------------------------
# vocab 258: the embedding and head rows do not split evenly over 4 FSDP2 ranks (cp_sp), so padding is counted too.
TINY = SimpleNamespace(hidden=64, layers=2, vocab=258, seq=32, batch=2, warmup=1, steps=1, repeats=1, cpu=True)


@pytest.fixture(scope="module")
def measured() -> dict:
    return {case: run_case(TINY, case) for case in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-x{c[2]}{'-ac' if c[3] else ''}")
def test_planner_matches_the_library_on_every_benchmark_layout(measured, case):
    memory, items = predict(TINY, *case)
    ranks = measured[case]
    for rank in ranks:  # model states: params, grads, AdamW's moments, each within 1%
        for part in ("params", "grads", "optimizer"):
            assert rank["states"][part] == pytest.approx(memory[part], rel=0.01), (part, rank["states"])
    counted = ranks[0]
    predicted = by_kind(items)
    assert set(predicted) == {kind for kind, value in counted["bytes"].items() if value or kind in predicted}
    for kind, value in predicted.items():  # bytes per collective within 2%, and the same number of calls
        assert counted["bytes"][kind] == pytest.approx(value, rel=0.02), (kind, counted["bytes"])
        calls = sum(item.calls for item in items if item.kind == kind)
        assert counted["calls"][kind] == calls, (kind, counted["calls"])
    if case[3]:
        return  # checkpointed layers keep their inputs inside torch's checkpoint, out of reach of the hooks above
    for rank in ranks:  # saved for backward within 15%
        assert rank["saved"] == pytest.approx(memory["activations"], rel=0.15), (rank["saved"], memory["activations"])


# ---- hand arithmetic ------------------------------------------------------------------------------------------
def _llama_counts(h, layers, heads, kv, inter, vocab, head_dim):
    """(weights split by tp, weights replicated over tp) of an untied Llama, by hand."""
    layer_split = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * inter
    return layers * layer_split + vocab * h, vocab * h + layers * 2 * h + h


def test_llama_3_1_8b_has_its_published_parameter_count():
    model = load_model("llama-3.1-8b")
    split, replicated = _llama_counts(4096, 32, 32, 8, 14336, 128256, 128)
    assert model.num_parameters() == split + replicated == 8_030_261_248  # "8.03B" on the model card


@pytest.mark.parametrize("name, billions", [("llama-3.1-70b", "70.6"), ("llama-3.1-405b", "406"),
                                            ("qwen2.5-7b", "7.62"), ("qwen2.5-72b", "72.7"), ("mistral-7b", "7.25")])
def test_builtin_configs_have_their_published_sizes(name, billions):
    """Model cards' sizes (Qwen2.5-7B's card: 7.61B, i.e. 7,615,616,512, which rounds to 7.62)."""
    digits = len(billions.split(".")[1]) if "." in billions else 0
    assert f"{load_model(name).num_parameters() / 1e9:.{digits}f}" == billions


def test_states_of_70b_on_fsdp_times_tp_by_hand():
    model = load_model("llama-3.1-70b")
    split, replicated = _llama_counts(8192, 80, 64, 8, 28672, 128256, 128)
    per_rank = (split // 8 + replicated) // 8  # every dimension divides: no padding
    memory = estimate(model, Layout(dp_shard=8, tp=8), Recipe(4096, 1))
    assert (memory["params"], memory["grads"], memory["optimizer"]) == (4 * per_rank, 4 * per_rank, 8 * per_rank)


def test_hsdp_over_two_nodes_sends_the_replica_all_reduce_across_nodes():
    model = load_model("llama-3.1-8b")
    n = model.num_parameters()
    items = transfers(model, Layout(dp_replicate=2, dp_shard=8), Recipe(8192, 1, 1, "bf16"), gpus_per_node=8)
    kinds, links = by_kind(items), by_link(items)
    shard = n / 8
    root = (2 * model.vocab * model.hidden + model.hidden) / 8  # untied embedding and head, final norm
    # bf16 parameters, forward and backward; the root unit once (kept gathered from forward into backward)
    assert kinds["all_gather"] == 7 * (2 * shard - root) * 2
    assert kinds["reduce_scatter"] == 7 * shard * 4  # fp32 gradients
    assert kinds["all_reduce"] == pytest.approx(2 * (1 / 2) * shard * 4 + 2 * (15 / 16) * 8)  # + the token count
    assert links["intra"] == 7 * (2 * shard - root) * 2 + 7 * shard * 4
    assert links["inter"] == pytest.approx(shard * 4 + 15)


def test_a_pipeline_stage_holds_its_layers_and_the_larger_end_and_pays_the_bubble():
    """pp 2 of Llama 3.1 8B (32 layers, untied): the busiest stage holds 16 layers and the head with the final norm
    (the larger end); its micro-step's activations cross to the next stage and come back as gradients (each stage
    sends one of them); with the default one micro-batch per stage its compute is 1.5x that of two replicas."""
    model = load_model("llama-3.1-8b")
    h, inter, vocab = 4096, 14336, 128256
    layer = 2 * h * 4096 + 2 * h * 1024 + 3 * h * inter + 2 * h  # attention, MLP, two norms
    held = 16 * layer + vocab * h + h  # + head and final norm
    recipe = Recipe(4096, 2, 1, "bf16")
    memory = estimate(model, Layout(pp=2), recipe)
    assert (memory["params"], memory["optimizer"]) == (4 * held, 8 * held)
    items = transfers(model, Layout(pp=2), recipe, gpus_per_node=8)
    # each stage an end: one direction (the first sends activations, the last their gradients), 2 samples x 4096
    # tokens, bf16 (measured: test_planner_pipeline_traffic.py); and the last stage's fp32 loss to the other
    assert by_kind(items)["send_recv"] == (2 * 4096) * h * 2 and by_kind(items)["broadcast"] == 4
    hw = get_hardware("h100")
    free = dataclasses.replace(hw, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, intra_node_latency_s=0.0,
                               inter_node_latency_s=0.0)
    request = Request(model, free, 1, 2, 4096, 4096 * 4, checkpointing="off")
    stages, replicas = (evaluate(request, layout, recipe) for layout in (Layout(pp=2), Layout(dp_replicate=2)))
    assert stages.timing.compute_s == pytest.approx(1.5 * replicas.timing.compute_s, rel=1e-12)


def test_compute_time_is_flops_over_achievable_peak():
    """With links that cost nothing, the step is the documented compute term plus the optimizer's memory traffic."""
    model = load_model("llama-3.1-8b")
    hw = get_hardware("h100")
    free = dataclasses.replace(hw, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, intra_node_latency_s=0.0,
                               inter_node_latency_s=0.0)
    request = Request(model, free, 1, 8, 8192, 8192 * 16, checkpointing="off")
    row = evaluate(request, Layout(dp_shard=8), Recipe(8192, 2, 1, "bf16"))
    h, L, S = 4096, 32, 8192
    matmul = L * (2 * h * 4096 + 2 * h * 1024 + 3 * h * 14336) + h * 128256
    flops = 8192 * 16 * (6 * matmul + 6 * L * 4096 * S) / 8  # causal attention: half of 12 L d S
    compute = flops / (989e12 * hw.compute_efficiency)
    optimizer = model.num_parameters() / 8 * 28 / hw.hbm_bandwidth
    assert row.timing.step_s == pytest.approx(compute + optimizer, rel=1e-9)
    assert row.timing.tokens_per_s_per_gpu == pytest.approx(8192 * 16 / (compute + optimizer) / 8)


def test_every_factorisation_is_enumerated_and_refusals_name_the_reason():
    assert len(all_layouts(8)) == math.comb(3 + 5, 5)  # 2^3 over 6 axes: compositions of 3 into 6 parts
    qwen = load_model("qwen2.5-7b")  # 28 heads, 4 KV heads
    ok, refused = valid_layouts(8, Constraints(qwen, 4096, 16, gpus_per_node=8))
    assert {layout.tp for layout in ok} == {1, 2, 4}
    assert any("tp=8 does not divide num_attention_heads=28" in why for why in refused[Layout(tp=8)])
    assert any("sp=8 does not divide num_attention_heads=28" in why for why in refused[Layout(sp=8)])
    _, refused = valid_layouts(16, Constraints(load_model("llama-3.1-8b"), 4096, 16, gpus_per_node=8))
    assert any("span nodes" in why for why in refused[Layout(tp=16)])
    # pipeline stages: every stage needs a layer; tied embeddings are refused; rows split into pp micro-batches
    tiny = dataclasses.replace(qwen, layers=2)
    _, refused = valid_layouts(4, Constraints(tiny, 4096, 16, gpus_per_node=8))
    assert refused[Layout(pp=4)] == ["pp=4 stages for 2 decoder layers (every stage needs one)"]
    ok, refused = valid_layouts(4, Constraints(dataclasses.replace(qwen, tied=True), 4096, 16, gpus_per_node=8))
    assert {Layout(pp=2, dp_shard=2), Layout(pp=4), Layout(pp=2, tp=2)} <= set(ok)  # tied weights: two copies
    _, refused = valid_layouts(8, Constraints(qwen, 4096, 6, gpus_per_node=8))
    assert "pp=4: 3 samples per data-parallel rank do not split into 4 micro-batches" in refused[Layout(pp=4,
                                                                                                      dp_shard=2)]


# ---- the command --------------------------------------------------------------------------------------------
def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


PLAN_8B = ("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "8192", "--global-batch-tokens", "131072")


def test_plan_prints_a_ranked_table_and_a_config_that_launch_reads(capsys, tmp_path):
    code, out, _ = _run(capsys, *PLAN_8B, "--write-config", str(tmp_path / "plan.yaml"))
    assert code == 0 and "tok/s/GPU" in out and "ParallelismConfig(" in out and "parallelism:" in out
    code, text, _ = _run(capsys, *PLAN_8B, "--json", "--top", "100")
    data = json.loads(text)
    fitting = [row for row in data["rows"] if row["fits"]]
    speeds = [row["tokens_per_s_per_gpu"] for row in fitting]
    assert speeds == sorted(speeds, reverse=True) and data["rows"][:len(fitting)] == fitting
    best = data["rows"][0]
    assert best["fits"] and best["memory_bytes"]["peak"] <= data["request"]["budget_bytes"]
    # The file is what `ndparallel config` writes for the same settings, and `launch --config-file` accepts it.
    translated = read_config_file(tmp_path / "plan.yaml")
    # (the planner does not model pipeline stages yet: its layouts have pp_size 1)
    assert translated.sizes == {"pp_size": 1, **{f"{axis}_size": size for axis, size in best["layout"].items()}}
    sizes = [arg for axis, size in best["layout"].items() for arg in (f"--{axis.replace('_', '-')}-size", str(size))]
    assert main(["config", "--config-file", str(tmp_path / "config.yaml"), *sizes, "--nproc-per-node", "8",
                 "--mixed-precision", "bf16", "--gradient-accumulation-steps",
                 str(best["gradient_accumulation_steps"])]) == 0
    capsys.readouterr()
    planned, written = ((tmp_path / name).read_text() for name in ("plan.yaml", "config.yaml"))
    assert yaml.safe_load(planned) == yaml.safe_load(written)
    assert ParallelismConfig.from_yaml(tmp_path / "plan.yaml").sizes() == {"pp": 1, **best["layout"]}


def test_explain_breaks_a_row_down(capsys):
    code, out, _ = _run(capsys, *PLAN_8B, "--explain", "dp_shard=8")
    assert code == 0
    for part in ("memory per GPU", "activations", "communication per GPU per step", "FSDP2 parameter all-gather",
                 "time per step", "tokens/s per GPU"):
        assert part in out
    code, by_row, _ = _run(capsys, *PLAN_8B, "--explain", "1")
    assert code == 0 and by_row.startswith("layout ")


def test_estimate_memory_for_one_layout(capsys):
    code, out, _ = _run(capsys, "estimate-memory", "--model", "llama-3.1-8b", "--seq-len", "4096", "--dp-shard-size",
                        "8", "--json")
    data = json.loads(out)
    n = 8_030_261_248
    assert code == 0 and data["memory_bytes"]["params"] == n / 8 * 4 and data["memory_bytes"]["optimizer"] == n
    code, out, _ = _run(capsys, "estimate-memory", "--model", "llama-3.1-8b", "--seq-len", "4096", "--gpu", "a100-40g")
    assert code == 0 and "misses 37.0 GiB by" in out  # 16 bytes x 8 B parameters alone are 120 GiB


# ---- bad input ----------------------------------------------------------------------------------------------
def _config(tmp_path: Path, **fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(tmp_path)  # a model directory


def test_a_world_with_no_valid_layout_says_why_per_axis(capsys, tmp_path):
    model = _config(tmp_path, model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=128, vocab_size=256)
    code, _, err = _run(capsys, "plan", "--model", model, "--gpu", "h100", "--gpus-per-node", "7", "--seq-len", "100",
                        "--global-batch-tokens", "200")
    assert code == 2 and "no layout of 7 GPUs is valid" in err
    assert "tp: refused: 7 (tp=7 does not divide num_attention_heads=4" in err
    assert "sp: refused: 7 (sp=7 does not divide num_attention_heads=4; seq_len=100 does not split" in err
    assert "cp: refused: 7 (seq_len=100 is not a multiple of 2 x cp = 14" in err
    assert "dp_replicate / dp_shard: refused: 7 (2 samples per step do not split" in err


def test_a_config_missing_fields_names_them(capsys, tmp_path):
    model = _config(tmp_path, model_type="llama", num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    code, _, err = _run(capsys, "plan", "--model", model, "--gpu", "h100", "--seq-len", "128",
                        "--global-batch-tokens", "1024")
    assert code == 2 and "the config lacks hidden_size, vocab_size" in err


def test_an_unknown_gpu_lists_the_known_ones(capsys):
    code, _, err = _run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "tpu-v9", "--seq-len", "128",
                        "--global-batch-tokens", "1024")
    assert code == 2 and "unknown GPU 'tpu-v9'; known: a100-40g, a100-80g, h100, h200" in err


def test_a_budget_nothing_fits_gives_the_smallest_peak_and_the_miss(capsys):
    args = ("plan", "--model", "llama-3.1-405b", "--gpu", "a100-40g", "--seq-len", "4096",
            "--global-batch-tokens", "65536")
    code, text, err = _run(capsys, *args, "--json", "--top", "1000")
    assert code == 2 and "no layout fits in 37.0 GiB per GPU" in err
    rows = json.loads(text)["rows"]
    smallest = min(row["memory_bytes"]["peak"] for row in rows)
    assert not any(row["fits"] for row in rows)
    assert f"the smallest peak is {smallest / GiB:.2f} GiB" in err
    assert f"{(smallest - 37 * GiB) / GiB:.2f} GiB over" in err


@pytest.mark.parametrize("argv, message", [
    (("--seq-len", "4096", "--global-batch-tokens", "5000"), "not a multiple of --seq-len 4096"),
    (("--seq-len", "4096", "--global-batch-tokens", "65536", "--explain", "tp=3,dp_shard=2"), "!= world size 8"),
    (("--seq-len", "100", "--global-batch-tokens", "800", "--explain", "cp=8"), "not a multiple of 2 x cp = 16"),
    (("--seq-len", "4096", "--global-batch-tokens", "65536", "--memory-gib", "2"), "leaves nothing"),
])
def test_plan_rejects_bad_settings(capsys, argv, message):
    code, _, err = _run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100", *argv)
    assert code == 2 and message in err


def test_hardware_file_with_missing_fields_names_them(capsys, tmp_path):
    (tmp_path / "hw.json").write_text(json.dumps({"name": "mygpu", "peak_bf16_flops": 1e15}))
    code, _, err = _run(capsys, "plan", "--model", "llama-3.1-8b", "--hardware", str(tmp_path / "hw.json"),
                        "--seq-len", "4096", "--global-batch-tokens", "65536")
    assert code == 2 and "profile 'mygpu' lacks peak_fp32_flops, memory_gib" in err


def test_a_hardware_file_of_ones_own(capsys, tmp_path):
    profile = {"name": "mygpu", "peak_bf16_flops": 500e12, "peak_fp32_flops": 50e12, "memory_gib": 48,
               "hbm_bandwidth": 1e12, "intra_node_bandwidth": 50e9, "inter_node_bandwidth": 10e9, "gpus_per_node": 4}
    (tmp_path / "one.json").write_text(json.dumps(profile))
    (tmp_path / "many.json").write_text(json.dumps({"profiles": {"mygpu": profile}}))
    for argv in (("--hardware", str(tmp_path / "one.json")), ("--hardware", str(tmp_path / "many.json"), "--gpu",
                                                               "MyGPU")):
        code, text, _ = _run(capsys, "plan", "--model", "mistral-7b", *argv, "--seq-len", "4096",
                             "--global-batch-tokens", "65536", "--json")
        data = json.loads(text)
        assert code == 0 and data["request"]["gpu"] == "mygpu" and data["request"]["gpus_per_node"] == 4
        assert data["request"]["budget_bytes"] == (48 - 3.0) * GiB  # the default memory_reserve_gib
