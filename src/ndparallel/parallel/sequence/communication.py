"""The collectives of context and sequence parallelism, over the ``cp`` or ``sp`` group they are given.

- all-gather CP: `gather_pair` (every rank's K and V shards, in global sequence order) and its adjoint
  `reduce_scatter_pair` (the K/V gradients summed, each rank receiving its own shard);
- ring CP: `Ring`, a point-to-point exchange with the next and previous rank;
- Ulysses SP: `seq_to_heads` / `heads_to_seq`, the two all-to-alls between sequence and head sharding, and their
  differentiable forms `SeqToHeads` / `HeadsToSeq` (each one's gradient is the other).

Attention tensors are ``[batch, heads, seq, head_dim]``; the sequence is dim 2.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .positions import SequenceChunking

SEQ_DIM = 2


# ---- all-gather / reduce-scatter along the sequence ------------------------------------------------------------------
def gather_sequence(x: torch.Tensor, chunking: SequenceChunking, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's shard of `x` concatenated in global order (not differentiable)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(chunking.size)]
    dist.all_gather(parts, x, group=group)
    return chunking.unshard(parts, dim=SEQ_DIM)


def reduce_scatter_sequence(x: torch.Tensor, chunking: SequenceChunking, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of every rank's full-sequence `x`, each rank receiving its own shard of the sum."""
    return _reduce_scatter_parts([x], chunking, group)


def _rank_part(tensors: list[torch.Tensor], chunking: SequenceChunking, rank: int) -> torch.Tensor:
    """`rank`'s shard of each of `tensors` (full-sequence, the same shape), one after the other along the sequence
    dimension: its chunks of the first tensor, then of the second... One new tensor of the part's size, made by one
    ``cat`` of views (no copy in between, and few ops: the default cp step's op count is tested)."""
    n = chunking.chunk_len
    return torch.cat([t.narrow(SEQ_DIM, start, n) for t in tensors for start, _ in chunking.chunks(rank)], SEQ_DIM)


def _reduce_scatter_parts(tensors: list[torch.Tensor], chunking: SequenceChunking,
                          group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of `tensors`' shards, this rank receiving its own: its shard of each, one after the other
    along the sequence dimension (`_rank_part`); every rank's part built straight from `tensors` (one copy of them in
    all, no whole-sequence concatenation first)."""
    parts = [_rank_part(tensors, chunking, r) for r in range(chunking.size)]
    out = torch.empty_like(parts[chunking.rank])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


def gather_pair(a: torch.Tensor, b: torch.Tensor, chunking: SequenceChunking,
                group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_sequence` of two tensors (K and V) with one collective when their shapes allow: one rendezvous per
    layer instead of two, the same bytes. On one rank: the tensors themselves (nothing to gather or copy)."""
    if chunking.size == 1:
        return a, b
    if a.shape != b.shape or a.dtype != b.dtype:
        return gather_sequence(a, chunking, group), gather_sequence(b, chunking, group)
    return gather_sequence(torch.cat([a, b], dim=1), chunking, group).chunk(2, dim=1)


def reduce_scatter_pair(a: torch.Tensor, b: torch.Tensor, chunking: SequenceChunking,
                        group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """`reduce_scatter_sequence` of two tensors (the K and V gradients), with one collective when shapes allow. On one
    rank: the tensors themselves."""
    if chunking.size == 1:
        return a, b
    if a.shape != b.shape or a.dtype != b.dtype:
        return reduce_scatter_sequence(a, chunking, group), reduce_scatter_sequence(b, chunking, group)
    return _reduce_scatter_parts([a, b], chunking, group).split(chunking.local_len, dim=SEQ_DIM)


# ---- the ring ------------------------------------------------------------------------------------------------------
class Ring:
    """Point-to-point exchange with the next and previous rank of a group's ring."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensors: list[torch.Tensor], tag: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Send `tensors` to the next rank and receive the previous rank's (same shapes); returns the receive
        buffers and the requests to wait on."""
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in recv]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[list[torch.Tensor], list[Any]]) -> list[torch.Tensor]:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


# ---- Ulysses all-to-alls -------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x[t]`` (first dim = group size) goes to rank t; returns what every rank sent here, ``out[t]`` from rank t."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_from_parts(parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[size, B, h, L, D]`` (``parts[t]``: this rank's piece of the sequence for rank t's h heads) ->
    ``[B, h, size*L, D]``: this rank's h heads over every rank's piece, in rank order."""
    size, b, h, n, d = parts.shape
    return _all_to_all(parts, group).permute(1, 2, 0, 3, 4).reshape(b, h, size * n, d)


def parts_from_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[B, h, size*L, D]`` -> ``[size, B, h, L, D]``: the inverse of `heads_from_parts`."""
    b, h, n, d = x.shape
    return _all_to_all(x.reshape(b, h, size, n // size, d).permute(2, 0, 1, 3, 4), group)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[B, H, L, D]`` (this rank's piece of the sequence, all heads) -> ``[B, H/size, size*L, D]``: rank s keeps
    heads ``[s*H/size, (s+1)*H/size)`` of every rank's piece, the pieces concatenated in rank order."""
    b, h, n, d = x.shape
    return heads_from_parts(x.reshape(b, size, h // size, n, d).transpose(0, 1), group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[B, H/size, size*L, D]`` -> ``[B, H, L, D]``: the inverse of `seq_to_heads`."""
    parts = parts_from_heads(x, group, size)  # [size, B, H/size, L, D]
    size, b, h, n, d = parts.shape
    return parts.transpose(0, 1).reshape(b, size * h, n, d)


class SeqToHeads(torch.autograd.Function):
    """`seq_to_heads`, differentiable: its backward is `heads_to_seq`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return heads_to_seq(grad, ctx.group, ctx.size), None, None


class HeadsToSeq(torch.autograd.Function):
    """`heads_to_seq`, differentiable: its backward is `seq_to_heads`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return seq_to_heads(grad, ctx.group, ctx.size), None, None
