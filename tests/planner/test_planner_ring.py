"""The ring context-parallel attention's buffers (`ring.forward_bytes` / `backward_bytes`, the library's counts that the
planner uses for ``cp_comm_strategy="ring"``) against the bytes the kernel allocates on the CPU (`LiveBytes`), on
cp 2 (fp32 and bf16) and cp 4 (fp32): to the byte on the busiest rank."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from ndparallel.parallel.sequence import SequenceShards, ring, sequence_parallel_attention
from ndparallel.test_utils.memory import LiveBytes

SEQ, HEADS, KV_HEADS, HEAD_DIM = 4096, 16, 4, 32


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
    report: dict[str, int] = {}
    for _ in range(3):
        gc.collect()
        leaves = [t.clone().requires_grad_() for t in inputs]
        with LiveBytes() as live:
            out = sequence_parallel_attention(*leaves, shards, cp_group=dist.group.WORLD, strategy="ring")
            forward_peak, forward_live = live.peak, live.live
            live.peak = live.live
            out.backward(grad)
            backward_peak = live.peak
            del out
        got = {"forward": forward_peak, "backward": backward_peak - forward_live}
        report = {k: min(report.get(k, v), v) for k, v in got.items()}
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
