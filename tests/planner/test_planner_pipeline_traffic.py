"""The planner's pipeline-parallel traffic (`comm.transfers` with pp > 1) against what the library sends between its
stages (`CollectiveCounter`: kind ``send_recv`` the bytes a rank sends, one call per tensor, a receive nothing;
``broadcast`` its bytes on every rank of the group)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ndparallel.planner.comm import by_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from planner_check import CASE_LAYOUTS, PP_CASES, predict, run_case  # noqa: E402  (measures the library on ranks)

TINY = SimpleNamespace(hidden=64, layers=2, vocab=258, seq=32, batch=2, warmup=1, steps=1, repeats=1, cpu=True)


@pytest.mark.parametrize("case,sizes", PP_CASES,
                         ids=[f"{c[0]}-{c[1]}-x{c[2]}{'-ac' if c[3] else ''}" for c, _ in PP_CASES])
def test_the_pipelines_traffic_is_what_the_library_sends(case, sizes):
    """benchmarks/planner_check.py's pipeline cases (the tiny Llama, 64 wide, under the library's default schedule:
    1F1B, pp micro-batches per micro-step) on forked gloo ranks, one counted optimizer step. The planner predicts the
    busiest stage. Measured per rank (stage = rank: pp is the only axis): pp 2 in fp32, 2 x 32 tokens: each stage
    sends 16,384 B in 2 messages (the first its activations, the last their gradients, one per micro-batch); pp 2 in
    bf16 with two micro-steps: 16,384 B in 4; pp 3 (3 x 32 tokens) in bf16 with two micro-steps and checkpointing:
    the middle stage 49,152 B in 12 (both ways), the ends 24,576 B in 6. Every stage also receives the last stage's
    fp32 loss, one broadcast of 4 B per micro-step. Nothing else crosses: no shapes or labels in a counted step."""
    args = SimpleNamespace(**{**vars(TINY), **sizes})
    pp = CASE_LAYOUTS[case[0]].pp
    _, items = predict(args, *case)
    predicted = by_kind(items)
    calls = {kind: sum(item.calls for item in items if item.kind == kind) for kind in predicted}
    assert set(predicted) == {"send_recv", "broadcast"}, predicted
    # what one direction carries, worked out here: m micro-steps x the rank's tokens x hidden x the compute dtype
    m, dtype = case[2], 2 if case[1] == "bf16" else 4
    one_way = m * args.batch * args.seq * args.hidden * dtype
    assert predicted["send_recv"] == (2 if pp > 2 else 1) * one_way
    assert predicted["broadcast"] == m * 4 and calls["broadcast"] == m
    ranks = run_case(args, case)
    assert len(ranks) == pp
    for stage, rank in enumerate(ranks):
        assert {kind for kind, value in rank["bytes"].items() if value} == set(predicted), (stage, rank["bytes"])
        middle = 0 < stage < pp - 1
        share = 1 if middle or pp == 2 else 2  # an end stage of pp > 2 sends one way, the busiest (middle) both
        assert rank["bytes"]["send_recv"] * share == predicted["send_recv"], (stage, rank["bytes"])
        assert rank["calls"]["send_recv"] * share == calls["send_recv"], (stage, rank["calls"])
        assert (rank["bytes"]["broadcast"], rank["calls"]["broadcast"]) == (predicted["broadcast"],
                                                                            calls["broadcast"]), (stage, rank)
    assert max(rank["bytes"]["send_recv"] for rank in ranks) == predicted["send_recv"]
