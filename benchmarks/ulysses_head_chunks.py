"""Head-chunked Ulysses attention on the CPU: one attention layer's bytes and time, unchunked and over head chunks.

    python benchmarks/ulysses_head_chunks.py [--sp 2 --seq 4096 --heads 32 --kv-heads 8 --head-dim 64
                                              --chunks 1 2 4 8 16 --dtype float32]

Each row: `sequence_parallel_attention` (Ulysses over --sp forked gloo ranks, causal, plain SDPA between the
all-to-alls) forward and backward on rank 0's shard, with ``head_chunks`` = that many groups of heads
(`ndparallel.parallel.sequence.ulysses`). Columns, measured by `ndparallel.test_utils.memory.LiveBytes` (every storage
an op creates while it is on, released when its last tensor dies; the inputs and the output's gradient were there
before and are not counted):

- peak: the most bytes alive at once over forward and backward;
- kept: the bytes of the distinct storages autograd saves for backward (ndparallel.test_utils.memory.kept_bytes:
  unchunked, SDPA's full-sequence q/k/v/o and log-sum-exp; chunked, the sequence-sharded q/k/v);
- time: forward + backward, the median of --repeats (shared cores: compare within one run).

Buffers a kernel allocates inside itself are not seen (the same kernels in every row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402
from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention  # noqa: E402
from ndparallel.test_utils.memory import LiveBytes, kept_bytes  # noqa: E402

MiB = 2**20


def _rank(args: argparse.Namespace) -> list[dict]:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, dtype = dist.get_rank(), getattr(torch, args.dtype)
    shards = SequenceShards.of(args.seq, 1, 0, True, args.sp, rank)
    n = args.seq // args.sp
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(1, args.heads, n, args.head_dim, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=g).to(dtype) for _ in range(2))
    rows = []
    for chunks in args.chunks:
        times, memory = [], None
        for _ in range(args.repeats):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            outs = []

            def forward() -> None:
                outs.append(sequence_parallel_attention(*leaves, shards, sp_group=dist.group.WORLD, head_chunks=chunks))

            with LiveBytes() as memory:
                kept = kept_bytes(forward, [])  # what forward keeps (a chunked backward recomputes and keeps more)
                outs.pop().backward(dout)
            times.append(time.perf_counter() - start)
        rows.append({"chunks": chunks, "peak": memory.peak, "kept": kept, "time": statistics.median(times)})
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = run_ranks(_rank, args.sp, args, timeout=3600)[0]
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    shard = args.heads * (args.seq // args.sp) * args.head_dim * element
    print(f"Ulysses sp={args.sp}, {args.seq} tokens, {args.heads} query / {args.kv_heads} key/value heads of "
          f"{args.head_dim}, {args.dtype}; one sequence-sharded query tensor = {shard / MiB:.1f} MiB")
    print(f"{'chunks':>6} {'peak MiB':>9} {'x unchunked':>11} {'kept MiB':>9} {'time s':>7} {'x unchunked':>11}")
    base = rows[0]
    for r in rows:
        print(f"{r['chunks']:>6} {r['peak'] / MiB:>9.1f} {r['peak'] / base['peak']:>11.2f} {r['kept'] / MiB:>9.1f} "
              f"{r['time']:>7.2f} {r['time'] / base['time']:>11.2f}")
    return rows


if __name__ == "__main__":
    main()
