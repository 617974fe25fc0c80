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
    busiest stage. Measured per rank: pp 2 in fp32, 2 x 32 tokens: each stage sends 16,384 B in 2 messages (the first
    its activations, the last their gradients, one per micro-batch); pp 2 in bf16 with two micro-steps: 16,384 B in
    4 (also under dp_shard 2 or dp_replicate 2); pp 3 (3 x 32 tokens) in bf16 with two micro-steps and checkpointing:
    the middle stage 49,152 B in 12 (both ways), the ends 24,576 B in 6. Every stage also receives the last stage's
    fp32 loss, one broadcast of 4 B per micro-step. Nothing else crosses: no shapes or labels in a counted step.
    FSDP2 inside the stages: every stage's gathers and reductions within 2% of the busiest's, calls exact (measured:
    bytes exact on the head's stage; e.g. pp 2 x dp_shard 2 in bf16 x2, 310,400 B in 8 gathers and 251,136 B in 4
    reduce-scatters -- each micro-step reduces -- where the planner had 12 gathers and 2 reductions)."""
    args = SimpleNamespace(**{**vars(TINY), **sizes})
    layout = CASE_LAYOUTS[case[0]]
    pp = layout.pp
    _, items = predict(args, *case)
    predicted = by_kind(items)
    calls = {kind: sum(item.calls for item in items if item.kind == kind) for kind in predicted}
    assert {"send_recv", "broadcast"} <= set(predicted), predicted
    # what one direction carries, worked out here: m micro-steps x the rank's tokens x hidden x the compute dtype
    m, dtype = case[2], 2 if case[1] == "bf16" else 4
    one_way = m * args.batch * args.seq * args.hidden * dtype
    assert predicted["send_recv"] == (2 if pp > 2 else 1) * one_way
    assert predicted["broadcast"] == m * 4 and calls["broadcast"] == m
    ranks = run_case(args, case)
    assert len(ranks) == layout.world
    for index, rank in enumerate(ranks):
        stage = index // (layout.world // pp)  # pp is the outermost axis
        assert {kind for kind, value in rank["bytes"].items() if value} == set(predicted), (index, rank["bytes"])
        middle = 0 < stage < pp - 1
        share = 1 if middle or pp == 2 else 2  # an end stage of pp > 2 sends one way, the busiest (middle) both
        assert rank["bytes"]["send_recv"] * share == predicted["send_recv"], (index, rank["bytes"])
        assert rank["calls"]["send_recv"] * share == calls["send_recv"], (index, rank["calls"])
        for kind, value in predicted.items():
            if kind == "send_recv":
                continue
            assert rank["calls"][kind] == calls[kind], (index, kind, rank["calls"])
            if kind == "broadcast":
                assert rank["bytes"][kind] == value, (index, rank["bytes"])
            else:
                assert rank["bytes"][kind] == pytest.approx(value, rel=0.02), (index, kind, rank["bytes"])
    for kind, value in predicted.items():  # the busiest stage's, to the byte
        assert max(rank["bytes"][kind] for rank in ranks) == value, (kind, [rank["bytes"] for rank in ranks])
