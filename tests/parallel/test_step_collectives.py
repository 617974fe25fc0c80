"""What one optimizer step communicates, against hand-written FSDP2 (issue 33): the loop of
benchmarks/hsdp_overhead.py, counted with ndparallel.test_utils.collectives.

The library's step may do exactly one thing plain FSDP2 does not: one all-reduce of the window's loss-token count
over the ``batch`` ranks per optimizer step (the loss is normalised by the global token count,
`ndparallel.training.loss`). Nothing per micro-step, no store operation, and a logged `reduce` costs what plain
``dist.all_reduce`` does. The counts are deterministic (no timing here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import run_ranks  # noqa: E402


def _counted_steps(layout: str, accum: int) -> dict:
    import torch.distributed as dist

    import hsdp_overhead
    from ndparallel.test_utils.collectives import CollectiveCounter, StoreCounter

    args = hsdp_overhead.parse(["count"])
    lib, plain = hsdp_overhead._runs(layout, accum, args, steps=8)
    out = {}
    for log in ("none", "reduce"):
        for name, run in (("library", lib), ("plain", plain)):
            run.step(log)  # the first step builds the optimizer state
            dist.barrier()
            with StoreCounter() as store, CollectiveCounter() as counter:
                run.step(log)
            out[log, name] = {"collectives": dict(counter.by_group), "store": dict(store.calls)}
    return out


@pytest.mark.parametrize("layout, world, accum", [("hsdp", 4, 2), pytest.param("fsdp2", 2, 1, marks=pytest.mark.slow)])
def test_an_optimizer_step_adds_one_token_count_all_reduce_to_plain_fsdp2(layout, world, accum):
    ranks = run_ranks(_counted_steps, world, layout, accum)
    for rank, counted in enumerate(ranks):
        for log in ("none", "reduce"):
            lib, plain = counted[log, "library"], counted[log, "plain"]
            assert lib["store"] == {} and plain["store"] == {}, (rank, log, lib["store"])
            expected = dict(plain["collectives"])
            key = f"all_reduce/{world}"  # the batch view: every rank holds distinct samples here
            expected[key] = expected.get(key, 0) + 1
            assert lib["collectives"] == expected, (rank, log, lib["collectives"], plain["collectives"])
        # Pinned, for the layout's own sake: 2 decoder layers gathered for forward and for backward and the root once
        # per micro-step; one reduce-scatter per FSDP group (3) per optimizer step; the clipping norm's all-reduce
        # over the shard group; under HSDP the replicas' all-reduce per group; the token count over the batch view.
        step = counted["none", "library"]["collectives"]
        if layout == "hsdp":
            assert step == {"all_gather/2": 5 * accum, "reduce_scatter/2": 3, "all_reduce/2": 3 + 1,
                            "all_reduce/4": 1}, (rank, step)
        else:
            assert step == {"all_gather/2": 5 * accum, "reduce_scatter/2": 3, "all_reduce/2": 1 + 1}, (rank, step)
        assert counted["reduce", "library"]["collectives"][f"all_reduce/{world}"] == \
            step[f"all_reduce/{world}"] + accum  # one per logged value
