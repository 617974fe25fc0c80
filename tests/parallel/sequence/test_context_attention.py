"""Context-parallel attention alone against full attention on one process.

Every rank builds the same full query/key/value and output gradient, computes full attention and its gradients with
`scaled_dot_product_attention`, then runs the sharded attention on its own shard and compares its shard of the
output and of the query/key/value gradients. Cases: several sequence lengths, head counts (MHA, GQA, MQA), causal and
full, both strategies, both layouts, cp 2 and 4, and both block backends (the CPU fused kernel, and the tiled matmul
implementation other devices use, here with tiles of a few rows).

Tolerances: fp64 results differ only by the summation order of the blockwise softmax and the reduce-scatter (1e-10);
fp32 by float rounding of the same (1e-5).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_ranks
from ndparallel.parallel.sequence import SequenceChunking, SequenceShards, kernels, sequence_parallel_attention

HEADS = [(4, 4), (4, 2), (6, 1)]  # (query heads, key/value heads): MHA, GQA, MQA
LENGTHS = {2: [4, 12, 24], 4: [8, 24]}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _compare(strategy: str, load_balance: bool, dtype: torch.dtype, backend: str) -> dict[str, float]:
    kernels.BACKEND = backend
    kernels.TILE_ELEMENTS = 64  # several row tiles per block, even at these sizes
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    errors: dict[str, float] = {}
    for seq, (hq, hkv), causal in itertools.product(LENGTHS[cp], HEADS, (True, False)):
        g = torch.Generator().manual_seed(seq * 100 + hq * 10 + hkv)
        q = torch.randn(2, hq, seq, 8, generator=g, dtype=dtype, requires_grad=True)
        k = torch.randn(2, hkv, seq, 8, generator=g, dtype=dtype, requires_grad=True)
        v = torch.randn(2, hkv, seq, 8, generator=g, dtype=dtype, requires_grad=True)
        dout = torch.randn(2, hq, seq, 8, generator=g, dtype=dtype)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        full.backward(dout)

        chunking = SequenceChunking(seq, cp, rank, load_balance)
        local = [chunking.shard(t.detach(), 2).clone().requires_grad_() for t in (q, k, v)]
        out = sequence_parallel_attention(*local, SequenceShards(chunking), cp_group=dist.group.WORLD, strategy=strategy,
                                          is_causal=causal)
        out.backward(chunking.shard(dout, 2))
        diffs = [out - chunking.shard(full, 2)] + [t.grad - chunking.shard(r.grad, 2) for t, r in zip(local, (q, k, v))]
        errors[f"seq={seq} heads={hq}/{hkv} causal={causal}"] = max(d.abs().max().item() for d in diffs)
    dist.destroy_process_group()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "math"], ids=["fused_cpu_kernel", "math"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_sharded_attention_matches_full_attention(strategy, load_balance, cp, backend):
    dtype = torch.float64 if cp == 2 else torch.float32
    results = run_ranks(_compare, cp, strategy, load_balance, dtype, backend, timeout=120)
    assert len(results[0]) == len(LENGTHS[cp]) * len(HEADS) * 2
    worst = {case: max(r[case] for r in results) for case in results[0]}
    bad = {case: err for case, err in worst.items() if not err <= TOLERANCE[dtype]}
    assert not bad, f"{strategy}, cp={cp}, load_balance={load_balance}: {bad}"


def test_layout_chunks_and_positions():
    """Rank r of cp holds chunks r and 2cp-1-r (balanced) or chunk r; shard/unshard are inverse."""
    seq = torch.arange(16).view(1, 16)
    balanced = [SequenceChunking(16, 4, r) for r in range(4)]
    assert [lay.chunk_ids() for lay in balanced] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert balanced[1].positions().tolist() == [2, 3, 12, 13]
    assert balanced[1].shard(seq, 1).tolist() == [[2, 3, 12, 13]]
    assert torch.equal(balanced[0].unshard([lay.shard(seq, 1) for lay in balanced], 1), seq)
    plain = [SequenceChunking(16, 4, r, load_balance=False) for r in range(4)]
    assert plain[2].positions().tolist() == [8, 9, 10, 11]
    assert torch.equal(plain[0].unshard([lay.shard(seq, 1) for lay in plain], 1), seq)


@pytest.mark.parametrize("seq,load_balance,match", [
    (18, True, r"sequence length 18 is not divisible by 2 \* cp_size = 4: .*\(load_balance=False\), which needs a "
               r"multiple of 2"),
    (17, False, r"sequence length 17 is not divisible by cp_size = 2: .* multiple of 2"),
])
def test_layout_refuses_uneven_lengths(seq, load_balance, match):
    with pytest.raises(ValueError, match=match):
        SequenceChunking(seq, 2, 0, load_balance)
