"""Ulysses attention alone (and Ulysses inside context parallelism) against full attention on one process.

Every rank builds the same full query/key/value and output gradient, computes full attention and its gradients with
`scaled_dot_product_attention`, then runs the sharded attention on its own shard (`SequenceShards`) and compares its
shard of the output and of the query/key/value gradients. Cases: sp 2 and 4; MHA, GQA, MQA, including fewer
key/value heads than sp (each repeated; the repeats' gradients must sum back); causal and full; and cp 2 x sp 2 with
both context-parallel strategies.

Tolerances: fp64, so results differ only by summation order (1e-10): the all-to-alls move data without arithmetic.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_ranks
from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention
from ndparallel.parallel.sequence.communication import heads_to_seq, seq_to_heads
from ndparallel.parallel.sequence.ulysses import check_heads, kv_repeats

HEADS = {2: [(4, 4), (4, 2), (6, 1)], 4: [(8, 8), (8, 4), (8, 2), (4, 1)]}  # (query, key/value heads)
TOLERANCE = 1e-10


def _compare(cp: int, strategy: str, load_balance: bool) -> dict[str, float]:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = world // cp
    cp_rank, sp_rank = divmod(rank, sp)  # sp innermost, as in the mesh
    sp_groups = [dist.new_group(list(range(c * sp, (c + 1) * sp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(s, world, sp))) for s in range(sp)]
    sp_group, cp_group = sp_groups[cp_rank], cp_groups[sp_rank]
    errors: dict[str, float] = {}
    lengths = [8, 24] if cp == 1 else [16]
    for seq, (hq, hkv), causal in itertools.product(lengths, HEADS[sp], (True, False)):
        g = torch.Generator().manual_seed(seq * 100 + hq * 10 + hkv)
        q = torch.randn(2, hq, seq, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, hkv, seq, 8, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, hkv, seq, 8, generator=g, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(2, hq, seq, 8, generator=g, dtype=torch.float64)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        full.backward(dout)

        shards = SequenceShards.of(seq, cp, cp_rank, load_balance, sp, sp_rank)
        local = [shards.shard(t.detach(), 2).clone().requires_grad_() for t in (q, k, v)]
        out = sequence_parallel_attention(*local, shards, cp_group=cp_group, sp_group=sp_group, strategy=strategy,
                                          is_causal=causal)
        out.backward(shards.shard(dout, 2))
        diffs = [out - shards.shard(full, 2)] + [t.grad - shards.shard(r.grad, 2) for t, r in zip(local, (q, k, v))]
        errors[f"seq={seq} heads={hq}/{hkv} causal={causal}"] = max(d.abs().max().item() for d in diffs)
    dist.destroy_process_group()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("cp,world,strategy,load_balance", [
    (1, 2, "allgather", True), (1, 4, "allgather", True),
    (2, 4, "allgather", True), (2, 4, "ring", True), (2, 4, "ring", False),
], ids=["sp2", "sp4", "cp2_sp2_allgather", "cp2_sp2_ring", "cp2_sp2_ring_contiguous"])
def test_ulysses_attention_matches_full_attention(cp, world, strategy, load_balance):
    results = run_ranks(_compare, world, cp, strategy, load_balance, timeout=120)
    sp = world // cp
    assert len(results[0]) == (2 if cp == 1 else 1) * len(HEADS[sp]) * 2
    worst = {case: max(r[case] for r in results) for case in results[0]}
    bad = {case: err for case, err in worst.items() if not err <= TOLERANCE}
    assert not bad, f"cp={cp} sp={sp} {strategy}: {bad}"


def _round_trip() -> list[torch.Tensor]:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(2 * 4 * 3 * 2, dtype=torch.float32).view(2, 4, 3, 2) + 1000 * rank  # [B, H, L/sp, D]
    heads = seq_to_heads(x, dist.group.WORLD, size)
    back = heads_to_seq(heads, dist.group.WORLD, size)
    dist.destroy_process_group()
    return [x, heads, back]


def test_all_to_all_moves_heads_and_sequence():
    """seq_to_heads: rank s gets heads [s*H/sp, (s+1)*H/sp) of every rank's piece, pieces in rank order;
    heads_to_seq undoes it exactly."""
    results = run_ranks(_round_trip, 2, timeout=60)
    full = torch.cat([r[0] for r in results], dim=2)  # the whole sequence, all heads
    for s, (x, heads, back) in enumerate(results):
        assert torch.equal(heads, full[:, 2 * s:2 * (s + 1)])
        assert torch.equal(back, x)


def test_sequence_shards_layout():
    """cp 2 x sp 2, load-balanced, 16 tokens: cp rank c holds chunks c and 3-c (of 4); its sp ranks split that shard
    contiguously, so sp piece order is the cp shard's order. Every token is held exactly once."""
    seq = torch.arange(16).view(1, 16)
    shards = {(c, s): SequenceShards.of(16, 2, c, True, 2, s) for c in range(2) for s in range(2)}
    assert shards[0, 0].positions().tolist() == [0, 1, 2, 3]
    assert shards[0, 1].positions().tolist() == [12, 13, 14, 15]
    assert shards[1, 0].positions().tolist() == [4, 5, 6, 7]
    assert shards[1, 1].positions().tolist() == [8, 9, 10, 11]
    for (c, s), lay in shards.items():
        assert lay.shard(seq, 1).tolist() == [lay.positions().tolist()]
        assert lay.cp.positions().tolist() == shards[c, 0].positions().tolist() + shards[c, 1].positions().tolist()
    plain = [SequenceShards.of(16, 1, 0, True, 4, s) for s in range(4)]
    assert [lay.positions().tolist() for lay in plain] == [list(range(4 * s, 4 * s + 4)) for s in range(4)]
    assert sorted(sum((lay.positions().tolist() for lay in shards.values()), [])) == list(range(16))


@pytest.mark.parametrize("seq,cp,sp,load_balance,match", [
    (20, 2, 4, True, r"sequence length 20 does not split over cp_size=2 x sp_size=4: each cp rank's 10 tokens .* "
                     r"multiple of 8"),
    (6, 1, 4, True, r"sequence length 6 does not split over cp_size=1 x sp_size=4: .* multiple of 4"),
    (18, 2, 2, True, r"sequence length 18 is not divisible by 2 \* cp_size = 4"),
])
def test_sequence_shards_refuse_uneven_lengths(seq, cp, sp, load_balance, match):
    with pytest.raises(ValueError, match=match):
        SequenceShards.of(seq, cp, 0, load_balance, sp, 0)


def test_kv_repeats_and_head_checks():
    assert kv_repeats(8, 4, 2) == 1
    assert kv_repeats(8, 2, 4) == 2  # 2 KV heads -> 4, one per sp rank
    assert kv_repeats(4, 1, 4) == 4  # MQA
    assert kv_repeats(12, 4, 6) == 3  # 4 KV heads -> 12 = lcm(4, 6)
    with pytest.raises(ValueError, match=r"6 query heads .* cannot be split over sp_size=4"):
        kv_repeats(6, 1, 4)
    check_heads(8, 4, sp_size=4, tp_size=2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: sp_size=4 x tp_size=2 does not divide "
                                         r"num_attention_heads=4: .* sp sizes that work: \[1, 2\]"):
        check_heads(4, 4, sp_size=4, tp_size=2, where="LlamaForCausalLM")
