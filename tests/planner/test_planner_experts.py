"""The planner's expert-parallel figures (`ndparallel.planner.experts`): from configs, by formula, and against what
benchmarks/experts.py counts in a real run (all-to-all bytes from the collectives, expert parameters and optimizer
state held per rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ndparallel.cli import main as cli
from ndparallel.planner.experts import ExpertSpec, expert_figures, expert_spec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("config,sparse", [
    ({"num_experts": 8, "num_hidden_layers": 4}, 4),
    ({"num_experts": 8, "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1}, 3),  # Qwen2/3-MoE
    ({"num_experts": 8, "num_hidden_layers": 4, "decoder_sparse_step": 2}, 2),
    ({"n_routed_experts": 8, "num_hidden_layers": 4, "first_k_dense_replace": 1}, 3),  # DeepSeek-V3
])
def test_sparse_layers_are_read_as_each_family_places_them(config, sparse):
    spec = expert_spec({**config, "num_experts_per_tok": 2, "hidden_size": 16, "moe_intermediate_size": 8})
    assert spec.sparse_layers == sparse and spec.experts == 8
    assert expert_spec({"hidden_size": 16, "num_hidden_layers": 2}) is None  # dense


def test_figures_by_formula():
    spec = ExpertSpec(experts=8, top_k=2, hidden=16, intermediate=8, sparse_layers=3)
    per_expert = 2 * 8 * 16 + 16 * 8  # gate_up (2I x H) and down (H x I)
    alone = expert_figures(spec, fsdp=4, ep=1, tokens=10, compute_bytes=4)
    ep2 = expert_figures(spec, fsdp=4, ep=2, tokens=10, compute_bytes=4)
    assert alone.elements == ep2.elements == 3 * 8 * per_expert // 4  # E / ep experts, then / (fsdp / ep)
    assert ep2.gathered_bytes == alone.gathered_bytes // 2 == 4 * per_expert * 4
    assert alone.payload_bytes == 0 and ep2.payload_bytes == 3 * 2 * 2 * 10 * 2 * 16 * 4  # layers, fwd+bwd, 2 ways
    assert ep2.optimizer_bytes == 2 * ep2.params_bytes  # AdamW's two fp32 moments
    checkpointed = expert_figures(spec, fsdp=4, ep=2, tokens=10, compute_bytes=4, checkpointing=True)
    assert checkpointed.payload_bytes == 3 * ep2.payload_bytes // 2  # the forward's all-to-alls again in backward
    padded = expert_figures(spec, fsdp=8, ep=2, tokens=10)  # 4 local experts over 4 ranks; 3 over 2 pads to 4
    assert padded.elements == 3 * per_expert
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard x cp x sp = 4 and the 8 experts"):
        expert_figures(spec, fsdp=4, ep=3, tokens=10)


def test_estimate_memory_prints_the_expert_figures(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
        "intermediate_size": 64, "moe_intermediate_size": 32, "vocab_size": 96, "num_experts": 4,
        "num_experts_per_tok": 2}))
    args = ["estimate-memory", "--model", str(tmp_path), "--seq-len", "16", "--dp-shard-size", "4", "--ep-size", "2",
            "--micro-batch-size", "2", "--mixed-precision", "fp32"]
    assert cli([*args, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["experts"]
    assert (figures["ep"], figures["expert_shard"], figures["elements"]) == (2, 2, 2 * 4 * 3 * 32 * 32 // 4)
    assert figures["payload_bytes"] == 2 * 2 * 2 * 32 * 2 * 32 * 4
    assert cli(args) == 0 and "expert parameters per rank: 6,144" in capsys.readouterr().out
    assert cli(["estimate-memory", "--model", "llama-3.1-8b", "--seq-len", "16", "--dp-shard-size", "2",
                "--ep-size", "2"]) == 2
    assert "--ep-size 2: built-in meta-llama/Llama-3.1-8B is not a mixture of experts" in capsys.readouterr().err


@pytest.mark.slow
def test_the_benchmark_counts_what_the_planner_predicts():
    """benchmarks/experts.py on a small Qwen3-MoE over 2 ranks: the all-to-all payload counted from the collectives
    averages to the planner's figure exactly (each rank sends its own pairs out, and returns what it received), the
    routing counts and every rank's expert parameters and optimizer state equal the prediction, for ep 2 and for
    FSDP2 alone (no all-to-all)."""
    sys.path.insert(0, str(BENCH))
    import experts as bench

    options = bench.parse(["--world", "2", "--ep", "2", "--experts", "4", "--hidden", "32", "--intermediate", "32",
                           "--seq", "16", "--steps", "1", "--repeats", "1"])
    out = bench.run(options)
    for name, r in out.items():
        p, tokens = r["predicted"], [x.get("tokens", 0) for x in r["a2a"]]
        assert sum(tokens) == len(tokens) * p.payload_bytes == len(tokens) * r["analytic_payload"], name
        assert (p.payload_bytes > 0) == (r["ep"] > 1)
        assert all(x.get("counts", 0) == p.count_bytes for x in r["a2a"]), name
        assert r["expert_elements"] == [p.elements] * 2 and r["expert_optimizer_bytes"] == [p.optimizer_bytes] * 2
    assert "ep / FSDP2 alone: step time x" in bench.report(options, out)
