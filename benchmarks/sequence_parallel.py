"""Bytes each attention layer sends per training step, counted, under Ulysses (sp), ring and all-gather (cp) attention
at 2 and 4 ranks, next to the formula; plus step times.

    python benchmarks/sequence_parallel.py [--seq-len 4096] [--heads 8] [--kv-heads 4] [--head-dim 64] [--batch 1]

Each configuration runs one causal attention layer (forward + backward, fp32) in freshly forked gloo ranks on the CPU
(one thread each), on query/key/value sharded as ndparallel shards them (`SequenceShards`: Ulysses contiguous,
CP load-balanced). The bytes are *counted*, not estimated: inside each rank, torch.distributed's collectives are
wrapped and every call adds what this rank sends to other ranks:

- ``all_to_all_single``: the input's bytes less the part that stays on this rank ((n-1)/n of it);
- ``all_gather``: the local tensor once per other rank ((n-1) x its bytes);
- ``reduce_scatter``: every part but this rank's own;
- ``batch_isend_irecv``: the bytes of every ``isend``.

Formulas, per rank, per layer and step (forward + backward), n ranks, sequence L, batch B, head dim D, e bytes per
element, H query heads, K key/value heads (Ulysses: K' = K repeated to a multiple of n when K < n):

- Ulysses: 4 all-to-alls forward (q, k, v, out) and 4 backward (their gradients): 2 (2H + 2K') B (L/n) D e (n-1)/n
- all-gather: K/V gathered forward, again backward, and their gradients reduce-scattered: 6 K B (L/n) D e (n-1)
- ring: K/V pass n-1 hops forward and n-1 backward, their gradient accumulators n hops: 2 K B (L/n) D e (3n-2)

Step time is the median of five steps, the largest over ranks. With fewer cores than ranks (the default CI box has
two) ranks share cores and gloo runs over loopback, so times compare strategies at one rank count, not scaling.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

MiB = 2**20


def _count_collectives(sent: list[int]) -> None:
    """Wrap torch.distributed's collectives in this process so each call adds the bytes this rank sends."""
    a2a, gather, scatter, p2p = dist.all_to_all_single, dist.all_gather, dist.reduce_scatter, dist.batch_isend_irecv
    isend = dist.isend

    def all_to_all_single(output, input, *args, group=None, **kwargs):
        n = dist.get_world_size(group)
        sent[0] += input.nbytes * (n - 1) // n
        return a2a(output, input, *args, group=group, **kwargs)

    def all_gather(tensor_list, tensor, group=None, **kwargs):
        sent[0] += tensor.nbytes * (dist.get_world_size(group) - 1)
        return gather(tensor_list, tensor, group=group, **kwargs)

    def reduce_scatter(output, input_list, *args, group=None, **kwargs):
        me = dist.get_rank(group)
        sent[0] += sum(t.nbytes for i, t in enumerate(input_list) if i != me)
        return scatter(output, input_list, *args, group=group, **kwargs)

    def batch_isend_irecv(ops):
        sent[0] += sum(op.tensor.nbytes for op in ops if op.op is isend)
        return p2p(ops)

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
    dist.reduce_scatter, dist.batch_isend_irecv = reduce_scatter, batch_isend_irecv


def _measure(strategy: str, args: argparse.Namespace, steps: int) -> dict:
    from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention

    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    if strategy == "ulysses":
        shards = SequenceShards.of(args.seq_len, 1, 0, True, n, rank)
    else:
        shards = SequenceShards.of(args.seq_len, n, rank, True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, heads, shards.local_len, args.head_dim, generator=g, requires_grad=True)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    dout = torch.randn(args.batch, args.heads, shards.local_len, args.head_dim, generator=g)

    def step() -> None:
        if strategy == "ulysses":
            out = sequence_parallel_attention(q, k, v, shards, sp_group=dist.group.WORLD, is_causal=True)
        else:
            out = sequence_parallel_attention(q, k, v, shards, cp_group=dist.group.WORLD, strategy=strategy,
                                              is_causal=True)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    step()  # warm-up
    sent = [0]
    _count_collectives(sent)
    step()
    counted = sent[0]
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"sent": counted, "time": statistics.median(times)}


def formula(strategy: str, n: int, args: argparse.Namespace) -> int:
    unit = args.batch * (args.seq_len // n) * args.head_dim * 4  # one head of one rank's shard, fp32
    kv = args.kv_heads
    if strategy == "ulysses":
        kv = kv * (n // math.gcd(kv, n))  # repeated to a multiple of n
        return 2 * (2 * args.heads + 2 * kv) * unit * (n - 1) // n
    if strategy == "allgather":
        return 6 * kv * unit * (n - 1)
    return 2 * kv * unit * (3 * n - 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"one causal attention layer, forward + backward, fp32, CPU + gloo: batch {args.batch}, sequence "
          f"{args.seq_len}, {args.heads} query / {args.kv_heads} key-value heads, head dim {args.head_dim}\n")
    print(f"{'ranks':>5} {'strategy':>10} {'sent per rank (counted)':>24} {'formula':>12} {'step time':>10}")
    for n in (2, 4):
        for strategy in ("ulysses", "ring", "allgather"):
            ranks = run_ranks(_measure, n, strategy, args, args.steps, timeout=1800)
            sent = {r["sent"] for r in ranks}
            expected = formula(strategy, n, args)
            label = f"{max(sent) / MiB:.2f} MiB" + ("" if len(sent) == 1 else " (max)")
            print(f"{n:>5} {strategy:>10} {label:>24} {expected / MiB:>8.2f} MiB "
                  f"{max(r['time'] for r in ranks) * 1e3:>7.1f} ms", flush=True)
            if max(sent) != expected:
                print(f"      counted {max(sent)} bytes, formula {expected}", flush=True)


if __name__ == "__main__":
    main()
