"""The ring context-parallel attention's buffers (`ring.forward_bytes` / `backward_bytes`, the library's counts that the
planner uses for ``cp_comm_strategy="ring"``) against the bytes the kernel allocates on the CPU (`LiveBytes`), on
cp 2 (fp32 and bf16) and cp 4 (fp32): to the byte on the busiest rank. The planner with the ring: its attention
buffers, and its point-to-point traffic against what the library sends (`CollectiveCounter`)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from ndparallel.parallel.sequence import SequenceShards, ring, sequence_parallel_attention
from ndparallel.planner.comm import by_kind
from ndparallel.test_utils.memory import LiveBytes, least_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from planner_check import RING_CASES, predict, run_case  # noqa: E402  (measures the library on forked ranks)

SEQ, HEADS, KV_HEADS, HEAD_DIM = 4096, 16, 4, 32
TINY = SimpleNamespace(hidden=64, layers=2, vocab=258, seq=32, batch=2, warmup=1, steps=1, repeats=1, cpu=True)


def _kernel(cp: int, dtype: torch.dtype) -> dict:
    """The ring attention alone (q/k/v given): the peak of its forward beyond its inputs, and of its backward beyond
    what forward left alive (the output and what it saved), the least of 3 runs (as the all-gather's test)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    shards = SequenceShards.of(SEQ, cp, rank, True, 1, 0)
    g = torch.Generator().manual_seed(rank)
    n = shards.local_len
    inputs = [torch.randn(1, h, n, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad = torch.randn(1, HEADS, n, HEAD_DIM, generator=g).to(dtype)

    def measure() -> dict[str, int]:
        leaves = [t.clone().requires_grad_() for t in inputs]
        with LiveBytes() as live:
            out = sequence_parallel_attention(*leaves, shards, cp_group=dist.group.WORLD, strategy="ring")
            forward_peak, forward_live = live.peak, live.live
            live.peak = live.live
            out.backward(grad)
            backward_peak = live.peak
            del out
        return {"forward": forward_peak, "backward": backward_peak - forward_live}

    report = least_of(measure)
    dist.destroy_process_group()
    return report


# (cp, dtype, forward and backward in u = the whole sequence's K and V in the inputs' dtype), worked out by hand from
# the kernel's buffers: q = the rank's query (16 heads x 4096/cp tokens), c = one query chunk (half of it), b = one
# K/V block (u/cp), l = one chunk's log-sum-exp (fp32), g = one block's gradients (c + a key chunk's, b/2).
# fp32, cp 2 (u = q = 4 MiB, b = c = u/2, l = u/64): forward 1 block in flight + the merge buffers q + 2 l + two
#   block outputs 2c + 5 l = 2.5u + 7/64 u; backward 1 block + the fp32 accumulators b + g (c + b/2) = 1.75u.
# bf16, cp 2 (u = q = 2 MiB, b = c = u/2, l = u/32): forward b + fp32 merge buffers 2q + 2 l + 2c + 5 l = 3.5u + 7/32 u;
#   backward: the fp32 query gradient 2q less the returned q, b, two pairs of fp32 accumulators (2b each) = 3.5u.
# fp32, cp 4 (u = 4 MiB, q = u/2, b = c = u/4, l = u/128): forward 2 blocks + q + 2 l + 2c + 5 l = 1.5u + 7/128 u;
#   backward 2 blocks + b + g (c + b/2) = 1.125u.
CASES = [(2, torch.float32, 2.5 + 7 / 64, 1.75), (2, torch.bfloat16, 3.5 + 7 / 32, 3.5),
         (4, torch.float32, 1.5 + 7 / 128, 1.125)]


@pytest.mark.parametrize("cp,dtype,forward_u,backward_u", CASES, ids=["cp2-fp32", "cp2-bf16", "cp4-fp32"])
def test_the_rings_counts_are_what_it_allocates(cp, dtype, forward_u, backward_u):
    """Forward: the busiest rank's peak is `forward_bytes` to the byte (rank 0 holds less: its first chunk sees one
    block, whose output is never copied into an fp32 buffer; in fp32 that costs nothing). Backward: every rank's peak
    beyond what forward left is the query's gradient (the caller's, in the inputs' dtype) + `backward_bytes`, to the
    byte. Without the blocks in flight, the accumulators or the merge buffers the counts would be 0.25u-2u under."""
    e = torch.tensor([], dtype=dtype).element_size()
    u = 2 * KV_HEADS * SEQ * HEAD_DIM * e
    q = HEADS * (SEQ // cp) * HEAD_DIM * e
    forward = ring.forward_bytes(HEADS, KV_HEADS, SEQ, 1, HEAD_DIM, e, cp)
    backward = ring.backward_bytes(HEADS, KV_HEADS, SEQ, 1, HEAD_DIM, e, cp)
    assert (forward, backward) == (int(forward_u * u), int(backward_u * u))
    reports = run_ranks(functools.partial(_kernel, cp, dtype), cp, timeout=300)
    print([{k: v / u for k, v in r.items()} for r in reports])
    assert max(r["forward"] for r in reports) == forward
    assert all(r["forward"] <= forward for r in reports)
    assert all(r["backward"] == q + backward for r in reports)


# ---- the planner with the ring ---------------------------------------------------------------------------------
def test_the_planners_attention_buffers_under_the_ring():
    """Llama-3.1-8B-shaped, cp 4 x sp 2 at 4,521,984 tokens over 16 head chunks (as test_planner_attention's all-gather
    case): one chunk is 1 query head and 1 key/value head over 1,130,496 local tokens; the chunked block's buffer
    takes the ring's terms, worked out here from the kernel's buffers, instead of the all-gather's whole-sequence
    key/value."""
    from ndparallel.parallel.sequence import allgather, block
    from ndparallel.planner import Layout, Recipe
    from ndparallel.planner.footprint import attention_backward, cp_kv, gathered_kv, ring_kv
    from ndparallel.planner.model import spec_from_config

    spec = spec_from_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 1,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                             "vocab_size": 128256}, "test")
    layout, seq = Layout(cp=4, sp=2), 4_521_984
    ring_recipe = Recipe(seq, 1, 1, "bf16", True, head_chunks=True, cp_strategy="ring")
    gather_recipe = Recipe(seq, 1, 1, "bf16", True, head_chunks=True)
    local, chunk, d = seq // 4, seq // 8, 128
    # forward: two K/V blocks in flight (bf16), the fp32 merge buffers of the local queries (output and lse), two
    # chunks' block outputs (bf16), five chunk-sized lse (fp32)
    forward = 2 * local * 2 * d * 2 + local * (d + 1) * 4 + 2 * chunk * d * 2 + 5 * chunk * 4
    # backward: the fp32 query gradient less the returned bf16 one, two blocks in flight, the fp32 accumulators, and
    # the larger of one block's bf16 gradients (a query chunk's and a key/value chunk's) and the arriving accumulators
    grads = local * 2 * d * 4
    backward = local * d * (4 - 2) + 2 * local * 2 * d * 2 + grads + max(chunk * 3 * d * 2, grads)
    assert ring_kv(spec, layout, ring_recipe, 16)[:2] == (forward, backward)
    assert cp_kv(spec, layout, ring_recipe, 16) == ring_kv(spec, layout, ring_recipe, 16)
    assert cp_kv(spec, layout, gather_recipe, 16) == gathered_kv(spec, layout, gather_recipe, 16)
    shape = (32, 8, 2, 16, local, local // 2, 1, d)
    lse = local * 32 // 32 * 4
    held = attention_backward(spec, layout, ring_recipe)[0]
    assert held == max(block.forward_bytes(*shape, 2) + forward, block.backward_bytes(*shape, 4096, 2) + lse + backward)
    # against the all-gather's one chunk of key/value over the whole sequence: 0.41 of it on cp 4 (the ring's blocks
    # are 1/cp of the sequence, its fp32 query gradient and merge buffers are not)
    whole = allgather.backward_bytes(1, 1, seq, 1, d, 2, 4)
    assert backward < 0.45 * whole and held < attention_backward(spec, layout, gather_recipe)[0]


def test_the_rings_traffic_is_point_to_point():
    """Llama-3.1-8B on cp 4 (one node), 65,536 tokens (16,384 per rank), no checkpointing: forward and backward each
    pass the K/V blocks (8 key/value heads x 128 x 2, bf16) over 3 hops; backward passes the fp32 gradient
    accumulators over 4 hops (back to their owner), K and V (and their accumulators) two messages a hop; no all-gather
    or reduce-scatter of K/V."""
    from ndparallel.planner import Layout, Recipe, load_model
    from ndparallel.planner.comm import transfers

    model = load_model("llama-3.1-8b")
    items = {t.purpose: t for t in transfers(model, Layout(cp=4), Recipe(65536, 1, 1, "bf16", cp_strategy="ring"), 8)}
    n, kv = 16384, 2 * 1024
    blocks, grads = items["CP ring K/V blocks (forward + backward)"], items["CP ring K/V gradient accumulators"]
    assert (blocks.kind, blocks.bytes, blocks.calls) == ("send_recv", 2 * 32 * 3 * n * kv * 2, 2 * 32 * 3 * 2)
    assert (grads.kind, grads.bytes, grads.calls) == ("send_recv", 32 * 4 * n * kv * 4, 32 * 4 * 2)
    assert not [p for p in items if p.startswith("CP K/V")]
    gathered = {t.purpose: t for t in transfers(model, Layout(cp=4), Recipe(65536, 1, 1, "bf16"), 8)}
    assert gathered["CP K/V all-gather (forward + backward)"].bytes == blocks.bytes  # the same K/V bytes
    assert not [p for p in gathered if p.startswith("CP ring")]


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"{c[0]}-{c[1]}-x{c[2]}{'-ac' if c[3] else ''}")
def test_the_rings_traffic_is_what_the_library_sends(case):
    """benchmarks/planner_check.py's ring cases (the tiny Llama with ``cp_comm_strategy="ring"``: cp 2 in fp32; cp 4
    in bf16, two micro-steps, every layer checkpointed; cp 2 x sp 2 in bf16, two micro-steps) on forked gloo ranks, one
    counted optimizer step: every rank sends the K/V blocks and their fp32 gradient accumulators the planner predicts,
    to the byte, in as many messages (measured: 65,536 B in 16 messages on cp 2; 139,264 B in 104 on cp 4 -- 73,728 B
    of bf16 blocks over 3 passes x 3 hops, 65,536 B of fp32 accumulators over 4 hops; 49,152 B in 32 on cp 2 x sp 2);
    the other collectives as test_planner.py checks them (within 2%, calls exact), and no K/V all-gather."""
    _, items = predict(TINY, *case, cp_strategy="ring")
    predicted = by_kind(items)
    assert predicted["send_recv"] > 0 and not [i for i in items if i.purpose.startswith("CP K/V")]
    for rank in run_case(TINY, case, "ring"):
        assert {kind for kind, value in rank["bytes"].items() if value} == set(predicted), rank["bytes"]
        for kind, value in predicted.items():
            calls = sum(item.calls for item in items if item.kind == kind)
            assert rank["calls"][kind] == calls, (kind, rank["calls"])
            if kind == "send_recv":
                assert rank["bytes"][kind] == value
            else:
                assert rank["bytes"][kind] == pytest.approx(value, rel=0.02), (kind, rank["bytes"])


def test_plan_takes_the_ring_where_only_it_fits():
    """Llama-3.1-8B, one sequence of 16,777,216 tokens on 32 H100s: with the all-gather alone nothing fits (its
    whole-sequence key/value of a head chunk); with both strategies the best row runs the ring, and the printed
    recipe names it. At 1,048,576 tokens every cp row fits with the all-gather, which the model finds faster (the
    ring's fp32 gradients travel one hop more), so none takes the ring."""
    from ndparallel.planner import Request, get_hardware, load_model, plan
    from ndparallel.planner.report import recommendation

    model, hardware = load_model("llama-3.1-8b"), get_hardware("h100")
    assert plan(Request(model, hardware, 4, 8, 2**24, 2**24, cp_strategy="allgather")).best is None
    best = plan(Request(model, hardware, 4, 8, 2**24, 2**24)).best
    assert best is not None and best.layout.cp > 1 and best.recipe.cp_strategy == "ring"
    assert 'cp_handler=TorchContextParallelConfig(cp_comm_strategy="ring"))' in recommendation(best, "")
    short = plan(Request(model, hardware, 4, 8, 2**20, 2**20))
    assert all(row.recipe.cp_strategy == "allgather" for row in short.rows if row.fits)
    assert sum(row.fits and row.layout.cp > 1 for row in short.rows) >= 3
    with pytest.raises(ValueError, match="cp_strategy 'alltoall'"):
        Request(model, hardware, 1, 8, 4096, 4096, cp_strategy="alltoall")


def test_the_planners_cp_attention_with_the_ring_is_what_the_library_holds():
    """The layer-level check of test_planner_context_parallel.py with the ring (cp 2, fp32, all heads at once and
    over 2, 4, 8 head chunks): the planner's attention bytes are at least what each rank holds at its peak and within
    9% of the busiest rank's (measured: 8% over with all heads at once, 2-4% over with chunks), and without the
    ring's own terms (`footprint.ring_kv`) they would be under it (measured: 5-20% under)."""
    from test_planner_context_parallel import BUDGETS, CP, _peaks, _predicted

    peaks = run_ranks(functools.partial(_peaks, "ring"), CP, timeout=600)
    for chunks in BUDGETS:
        predicted, term = _predicted(chunks, strategy="ring")
        busiest = max(report[chunks] for report in peaks)
        print(chunks, busiest, predicted, term)
        assert all(report[chunks] <= predicted for report in peaks), (chunks, peaks, predicted)
        assert predicted <= 1.09 * busiest, (chunks, busiest, predicted)
        assert predicted - term < busiest, (chunks, busiest, predicted - term)


def test_the_planners_chunked_block_with_the_ring_is_what_the_block_allocates():
    """Llama's chunked block under cp 2 alone with the ring, 4 and 8 head chunks (test_planner_context_parallel.py's
    all-gather check): the planner's forward and backward (the block's counts with `ring_kv`'s) are what the block
    allocates on every rank, to the byte. They were 16-21% over in forward and 10-13% in backward while the block's
    counts took a chunk's q/k/v/o twice in forward (a send buffer and an arrival, which cp alone does not have) and
    four times in backward; the backward also kept one chunk's value projection and its gradient into the next
    chunk (loop names, now let go)."""
    from test_planner_context_parallel import (B_BUDGETS, B_DIM, B_HEADS, B_HIDDEN, B_KV, CP, _block_memory,
                                               _block_terms)

    params = (2 * B_HEADS + 2 * B_KV) * B_DIM * B_HIDDEN * 4  # the four weights' gradients, fp32
    reports = run_ranks(functools.partial(_block_memory, "ring"), CP, timeout=300)
    for chunks in B_BUDGETS:
        terms = _block_terms(chunks, "ring")
        assert terms["held"] == max(terms["forward"], terms["backward"])
        for phase in ("forward", "backward"):
            measured = [r[chunks][phase] - (params if phase == "backward" else 0) for r in reports]
            assert measured == [terms[phase]] * CP, (chunks, phase, measured, terms)  # every rank holds as much
