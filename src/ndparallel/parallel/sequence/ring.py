"""Ring attention: exact attention over a sequence sharded on a process group, with K/V passed around the ring.

Forward, on each of the `size` ranks, for t = 0 .. size-1: the rank holds the K/V block of rank (rank - t) and,
while sending it on to rank+1 and receiving the next one from rank-1 (point-to-point), attends its local query
chunks to that block's key chunks (`kernels`), merging partial outputs by their
log-sum-exp. Under a causal mask, chunk pairs above the diagonal are skipped and diagonal pairs are causal blocks;
with the load-balanced layout every rank computes the same number of pairs.

Backward: the K/V blocks travel the ring again together with their gradient accumulators; each rank adds its
queries' share (from the final output and log-sum-exp saved by forward); after `size` hops every accumulator is
back with the rank that owns the block. Saved between forward and backward: the local q, k, v, output and
log-sum-exp -- 1/cp of the sequence, nothing of size seq x seq.

What that costs in memory on one rank, beyond the inputs (`forward_bytes`, `backward_bytes`: the planner counts them,
`ndparallel.planner.footprint.ring_kv`): at most two K/V blocks of 1/cp of the sequence (the one attended
and the one arriving), never the whole sequence's as the all-gather (`allgather`) holds; in forward every local
query chunk's merge buffer (accumulator dtype) for all the hops; in backward the query's gradient in the accumulator
dtype and the travelling key/value gradient accumulators, two of them while one pair is passed on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...distributed.layout import load_balanced_chunks
from .communication import Ring
from .kernels import accumulate, acc_dtype, block_backward, block_forward, finish, fused_gradients
from .positions import SequenceChunking
from .masking import DocumentMask, plan_block

_KV_TAG, _GRAD_TAG = 7, 8  # P2P tags: K/V blocks and their gradients may be in flight between the same peers


def pairs(chunking: SequenceChunking, owner: int, causal: bool, doc: DocumentMask | None = None,
          device: torch.device | None = None):
    """(local query chunk j, key chunk i of `owner`, pieces) for every chunk pair with a visible key: under a causal
    mask, pairs above the diagonal are skipped; with a document mask (padded or packed rows) also the pairs whose
    queries see none of the keys. Pieces: ``(rows, query range, key range, kernel's causal flag, mask or None)``
    within the chunks (`masking.plan_block`)."""
    n = chunking.chunk_len
    for j, qc in enumerate(chunking.chunk_ids()):
        for i, kc in enumerate(chunking.chunk_ids(owner)):
            if causal and kc > qc:  # a key chunk after the query chunk is masked entirely
                continue
            pieces = plan_block(doc, slice(qc * n, (qc + 1) * n), slice(kc * n, (kc + 1) * n), causal and kc == qc,
                                causal, device)
            if pieces:
                yield j, i, pieces


def _chunk(x: torch.Tensor, j: int, n: int) -> torch.Tensor:
    return x[:, :, j * n:(j + 1) * n]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunking: SequenceChunking,
                group: dist.ProcessGroup | None, causal: bool, scale: float, doc: DocumentMask | None) -> torch.Tensor:
        n, chunks = chunking.chunk_len, len(chunking.chunk_ids())
        ring = Ring(group, chunking.size, chunking.rank) if chunking.size > 1 else None
        out: list[Any] = [None] * chunks
        block, owner = [key.contiguous(), value.contiguous()], chunking.rank
        for t in range(chunking.size):
            pending = ring.start(block, _KV_TAG) if t < chunking.size - 1 else None
            k, v = block
            for j, i, pieces in pairs(chunking, owner, causal, doc, query.device):
                qj, ki, vi = _chunk(query, j, n), _chunk(k, i, n), _chunk(v, i, n)
                for rows, qs, ks, diagonal, mask in pieces:
                    o, l = block_forward(qj[rows, :, qs], ki[rows, :, ks], vi[rows, :, ks], scale, diagonal, mask)
                    out[j] = accumulate(out[j], rows, qs, o, l, (*qj.shape[:3], value.shape[-1]))
                    del o, l  # a block's output lives on in its chunk's merge buffer or not at all
            k = v = ki = vi = None  # this block (and views of it) goes when the next one arrives, not one hop later
            if pending is not None:
                block, owner = Ring.finish(pending), (owner - 1) % chunking.size
        del block  # the last block received, before the output's buffer
        # A chunk whose queries saw no key at all (padding only) gets output 0, lse -inf. Each chunk is written
        # into the one output buffer (rounded to the inputs' dtype there) and let go.
        result = query.new_empty((*query.shape[:3], value.shape[-1]))
        lses = []
        for j in range(chunks):
            o, lse = finish(out[j], (*query.shape[:2], n, value.shape[-1]), query)
            out[j] = None
            _chunk(result, j, n).copy_(o)
            lses.append(lse)
            del o
        lse_all = torch.cat(lses, dim=2)
        # The output is kept as returned (the inputs' dtype, as SDPA keeps its own); the lse in fp32.
        ctx.save_for_backward(query, key, value, result, lse_all)
        ctx.chunking, ctx.group, ctx.causal, ctx.scale, ctx.doc = chunking, group, causal, scale, doc
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        chunking: SequenceChunking = ctx.chunking
        n = chunking.chunk_len
        ring = Ring(ctx.group, chunking.size, chunking.rank) if chunking.size > 1 else None
        # On one rank no element gets more than two blocks' gradients (a causal chunk pair: the diagonal block and
        # the one before it), so the fused kernels' gradients add up in the inputs' dtype -- their sum computed in
        # fp32 and rounded once, as an fp32 accumulator would round it -- in buffers of the gradients' own size.
        # Otherwise (blocks of many ranks, the math kernel's fp32 gradients) the sums run in fp32.
        acc = query.dtype if chunking.size == 1 and fused_gradients(query, value, ctx.doc) else acc_dtype(query)
        dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        block, owner = [key.contiguous(), value.contiguous()], chunking.rank
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in block]
        for t in range(chunking.size):
            pending = ring.start(block, _KV_TAG) if t < chunking.size - 1 else None
            (k, v), (dk, dv) = block, grads
            for j, i, pieces in pairs(chunking, owner, ctx.causal, ctx.doc, query.device):
                for rows, qs, ks, diagonal, mask in pieces:
                    g = block_backward(*(_chunk(t, j, n)[rows, :, qs] for t in (grad_out, query)),
                                       *(_chunk(t, i, n)[rows, :, ks] for t in (k, v)), _chunk(out, j, n)[rows, :, qs],
                                       _chunk(lse, j, n)[rows, :, qs], ctx.scale, diagonal, mask)
                    _chunk(dq, j, n)[rows, :, qs] += g[0]
                    _chunk(dk, i, n)[rows, :, ks] += g[1]
                    _chunk(dv, i, n)[rows, :, ks] += g[2]
                    del g  # before the next block's: one block's gradients at a time
            del k, v, dk, dv  # the block and the accumulators go when their successors arrive, not one hop later
            # The accumulators follow their block: after `size` hops they are back with the block's owner (on a
            # one-rank group, where they never left).
            if ring is not None:
                grads = Ring.finish(ring.start(grads, _GRAD_TAG))
            if pending is not None:
                block, owner = Ring.finish(pending), (owner - 1) % chunking.size
        del block  # the last block received, before the gradients are cast
        return dq.to(query.dtype), grads[0].to(key.dtype), grads[1].to(value.dtype), None, None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunking: SequenceChunking,
                   group: dist.ProcessGroup | None, is_causal: bool, scale: float,
                   doc: DocumentMask | None = None) -> torch.Tensor:
    """Exact attention of the local queries over the sequence sharded on `group` (see the module docstring).

    ``[batch, heads, local_len, head_dim]`` tensors (K/V may have fewer heads: GQA); shapes are checked by the caller
    (`ndparallel.parallel.sequence.attention`). `doc`: which keys each query sees in a padded or packed batch
    (`masking.DocumentMask`). `group` may be None on a one-rank layout.
    """
    return _RingAttention.apply(query, key, value, chunking, group, bool(is_causal), float(scale), doc)


def _block_elements(kv_heads: int, seq_len: int, batch: int, head_dim: int, value_head_dim: int | None,
                    cp_size: int) -> int:
    """Elements of one rank's key and value block (``seq_len / cp_size`` positions of `kv_heads` heads)."""
    return batch * kv_heads * (seq_len // cp_size) * (head_dim + (value_head_dim or head_dim))


def forward_bytes(heads: int, kv_heads: int, seq_len: int, batch: int, head_dim: int, element_size: int,
                  cp_size: int, value_head_dim: int | None = None) -> int:
    """Bytes `_RingAttention.forward` allocates at its peak on the busiest rank (cp > 1), for `heads` query heads
    under a causal mask in the load-balanced layout (2 x cp chunks, two per rank), `element_size` the inputs': the
    K/V blocks in flight (the one attended, received, and the next arriving: one on cp 2, two from cp 3), every
    local query chunk's merge buffer -- output and log-sum-exp in the accumulator dtype (`kernels.acc_dtype`) -- and,
    as a chunk's first block output is copied into its buffer to merge the second (`kernels.accumulate`), that
    output, the new block's output and log-sum-exp, and merge's four log-sum-exp-sized temporaries
    (`kernels.merge_into`). The output itself is allocated after the hops, beside the merge buffers: not counted
    (the caller's); the busiest rank's hops hold more than that phase."""
    acc = max(element_size, 4)  # `acc_dtype`: fp32, or the inputs' own when wider
    v_dim = value_head_dim or head_dim
    block = _block_elements(kv_heads, seq_len, batch, head_dim, value_head_dim, cp_size) * element_size
    local, chunk = seq_len // cp_size, seq_len // load_balanced_chunks(cp_size)
    merge = batch * heads * local * (v_dim + 1) * acc  # every chunk's output and log-sum-exp
    outputs = 2 * batch * heads * chunk * v_dim * element_size  # a chunk's first block output, the new block's
    lses = 5 * batch * heads * chunk * acc  # the new block's log-sum-exp and merge's temporaries
    return min(2, cp_size - 1) * block + merge + outputs + lses


def backward_bytes(heads: int, kv_heads: int, seq_len: int, batch: int, head_dim: int, element_size: int,
                   cp_size: int, value_head_dim: int | None = None, fused: bool = True) -> int:
    """Bytes `_RingAttention.backward` allocates at its peak on one rank (cp > 1) beyond what forward saved and the
    gradients it returns (the query's, and this rank's key's and value's, in the inputs' dtype: the caller's), under
    a causal mask in the load-balanced layout, the larger of two phases:

    - the hops: the query's gradient in the accumulator dtype (fp32: `kernels.acc_dtype`) less the returned one, the
      K/V blocks in flight (one on cp 2, two from cp 3), the key/value gradient accumulators (fp32) and either one
      block's gradients -- a query chunk's and a key chunk's, in the inputs' dtype from a fused kernel (`fused`,
      `kernels.fused_gradients`), else fp32 -- or, while the accumulators are passed on, the ones arriving;
    - the end, where the accumulators are cast to the inputs' dtype (none where that is fp32): the query's gradient
      and the key/value accumulators in fp32."""
    acc = max(element_size, 4)
    kv = _block_elements(kv_heads, seq_len, batch, head_dim, value_head_dim, cp_size)
    local, chunk = seq_len // cp_size, seq_len // load_balanced_chunks(cp_size)
    grads = kv * acc
    one_block = batch * chunk * (heads * head_dim + kv_heads * (head_dim + (value_head_dim or head_dim)))
    one_block *= element_size if fused else acc
    dq = batch * heads * local * head_dim
    hops = dq * (acc - element_size) + min(2, cp_size - 1) * kv * element_size + grads + max(one_block, grads)
    end = dq * acc + grads if acc != element_size else 0
    return max(hops, end)
