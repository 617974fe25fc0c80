"""All-gather context-parallel attention: K and V all-gathered over ``cp``, their gradients reduce-scattered back.

Each local query chunk ``[start, end)`` attends to the keys it may see: under a causal mask the keys before the
chunk in full and the chunk itself causally; otherwise the whole sequence. The partial results are merged by
log-sum-exp (`kernels.accumulate`). K/V are gathered again in backward rather than kept, so a layer saves only this
rank's shard; the full K/V exist transiently, once per layer and pass.

What that costs in memory, beyond the inputs, the output and what is saved (`forward_bytes`, `backward_bytes`: the
planner counts them, `ndparallel.planner.footprint.attention_backward`): in forward the gather -- this rank's K and V
concatenated, every rank's received, and those put in global order (two copies of the whole sequence's K/V for a
moment); in backward the whole sequence's K/V gathered again, their gradients in fp32 over the whole sequence and one
block's gradients, then, the gathered K/V let go, the reduce-scatter's copy of the gradients cut into one contiguous
part per rank. The ring (`ring`) holds one circulating block instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...distributed.layout import load_balanced_chunks
from .communication import gather_pair, reduce_scatter_pair
from .kernels import accumulate, acc_dtype, block_backward, block_forward, finish, fused_gradients
from .positions import SequenceChunking
from .masking import DocumentMask, plan_block


def _key_blocks(chunking: SequenceChunking, causal: bool, doc: DocumentMask | None,
                device: torch.device) -> list[list[tuple[int, int, list]]]:
    """Per local chunk, the key ranges ``(start, end, pieces)`` it attends to: under a causal mask the keys before
    the chunk (full) and the chunk itself (causal); else the whole sequence. With a document mask (padded or packed
    rows) the keys are cut into chunk-sized blocks, and blocks without a visible key are left out. Pieces:
    ``(rows, query range, key range, kernel's causal flag, mask or None)`` (`masking.plan_block`)."""
    blocks = []
    for s, e in chunking.chunks():
        if doc is None or doc.trivial:
            ranges = [(0, s, False), (s, e, True)] if causal else [(0, chunking.seq_len, False)]
        else:
            n, stop = chunking.chunk_len, e if causal else chunking.seq_len
            ranges = [(a, min(a + n, stop), causal and a == s) for a in range(0, stop, n)]
        planned = [(a, b, plan_block(doc, slice(s, e), slice(a, b), diagonal, causal, device))
                   for a, b, diagonal in ranges if b > a]
        blocks.append([(a, b, pieces) for a, b, pieces in planned if pieces])
    return blocks


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunking: SequenceChunking,
                group: dist.ProcessGroup, causal: bool, scale: float, doc: DocumentMask | None) -> torch.Tensor:
        full_k, full_v = gather_pair(key, value, chunking, group)
        n, lses = chunking.chunk_len, []
        result = query.new_empty((*query.shape[:3], value.shape[-1]))  # each chunk written here once merged
        for j, blocks in enumerate(_key_blocks(chunking, causal, doc, query.device)):
            state = None
            qj = query[:, :, j * n:(j + 1) * n]
            for s, e, pieces in blocks:
                kb, vb = full_k[:, :, s:e], full_v[:, :, s:e]
                for rows, qs, ks, diagonal, mask in pieces:
                    o, l = block_forward(qj[rows, :, qs], kb[rows, :, ks], vb[rows, :, ks], scale, diagonal, mask)
                    state = accumulate(state, rows, qs, o, l, (*qj.shape[:3], value.shape[-1]))
                    del o, l
            # a chunk whose queries see no key at all (padding only): output 0, lse -inf
            out, lse = finish(state, (*qj.shape[:3], value.shape[-1]), query)
            result[:, :, j * n:(j + 1) * n].copy_(out)
            lses.append(lse)
            del state, out
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
        full_k, full_v = gather_pair(key, value, chunking, ctx.group)
        # A query chunk gets at most two blocks' gradients (the keys before it, and its diagonal); so do the keys on
        # one rank. Such sums of the fused kernels' gradients run in the inputs' dtype -- computed in fp32, rounded
        # once, as an fp32 accumulator would round them -- in buffers of the gradients' own size; the keys' sums over
        # several ranks' chunks, and the math kernel's fp32 gradients, in fp32.
        fused, acc = fused_gradients(query, value, ctx.doc), acc_dtype(query)
        dq = torch.zeros(query.shape, dtype=query.dtype if fused else acc, device=query.device)
        kv_dtype = query.dtype if fused and chunking.size == 1 else acc
        dk = torch.zeros(full_k.shape, dtype=kv_dtype, device=query.device)
        dv = torch.zeros(full_v.shape, dtype=kv_dtype, device=query.device)
        for j, blocks in enumerate(_key_blocks(chunking, ctx.causal, ctx.doc, query.device)):
            chunk = slice(j * n, (j + 1) * n)
            for s, e, pieces in blocks:
                for rows, qs, ks, diagonal, mask in pieces:
                    g = block_backward(*(t[:, :, chunk][rows, :, qs] for t in (grad_out, query)),
                                       *(t[:, :, s:e][rows, :, ks] for t in (full_k, full_v)),
                                       out[:, :, chunk][rows, :, qs], lse[:, :, chunk][rows, :, qs], ctx.scale,
                                       diagonal, mask)
                    dq[:, :, chunk][rows, :, qs] += g[0]
                    dk[:, :, s:e][rows, :, ks] += g[1]
                    dv[:, :, s:e][rows, :, ks] += g[2]
                    del g  # before the next block's: one block's gradients at a time
        del full_k, full_v  # before the reduce-scatter, whose parts take their place
        dk, dv = reduce_scatter_pair(dk, dv, chunking, ctx.group)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None, None


def allgather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunking: SequenceChunking,
                        group: dist.ProcessGroup, is_causal: bool, scale: float,
                        doc: DocumentMask | None = None) -> torch.Tensor:
    """Exact attention of the local queries over the whole sequence, K/V all-gathered over `group`.

    ``[batch, heads, local_len, head_dim]`` tensors (K/V may have fewer heads: GQA); shapes are checked by the caller
    (`ndparallel.parallel.sequence.attention`). `doc`: which keys each query sees in a padded or packed batch
    (`masking.DocumentMask`).
    """
    return _AllGatherAttention.apply(query, key, value, chunking, group, bool(is_causal), float(scale), doc)


def kv_elements(kv_heads: int, seq_len: int, batch: int, head_dim: int, value_head_dim: int | None = None) -> int:
    """Elements of the whole sequence's key and value for `kv_heads` heads (``batch x seq_len`` positions)."""
    return batch * kv_heads * seq_len * (head_dim + (value_head_dim or head_dim))


def forward_bytes(kv_heads: int, seq_len: int, batch: int, head_dim: int, element_size: int, cp_size: int,
                  value_head_dim: int | None = None) -> int:
    """Bytes `_AllGatherAttention.forward`'s gather allocates at its peak on one rank (`gather_pair`): this rank's K
    and V concatenated (1/cp of the whole sequence's), every rank's received and the whole sequence's in global order
    (``kv_heads`` key/value heads of `seq_len` positions, `element_size` bytes). Not counted: the output (the
    caller's) and one query chunk's merge buffers, which are query-sized."""
    whole = kv_elements(kv_heads, seq_len, batch, head_dim, value_head_dim) * element_size
    return 2 * whole + whole // cp_size


def backward_bytes(heads: int, kv_heads: int, seq_len: int, batch: int, head_dim: int, element_size: int,
                   cp_size: int, value_head_dim: int | None = None, fused: bool = True) -> int:
    """Bytes `_AllGatherAttention.backward` allocates at its peak on one rank beyond what forward saved and the
    gradients it returns (the query's, and this rank's share of the key's and value's, which are the caller's), for
    `heads` query heads under a causal mask in the load-balanced layout, the larger of its two phases:

    - the blocks: the whole sequence's K and V gathered again (`element_size`), their gradients (fp32:
      `kernels.acc_dtype`), and one block's gradients -- the longest key block's K and V (the keys before the last of
      the 2 x cp chunks, on the rank that holds it) and its query chunk's -- in the inputs' dtype from a fused kernel
      (`fused`, `kernels.fused_gradients`), else fp32;
    - the reduce-scatter (`reduce_scatter_pair`), once the gathered K/V are let go: the gradients and their copy cut
      into one contiguous part per rank."""
    acc = max(element_size, 4)  # `acc_dtype`: fp32, or the inputs' own when wider
    whole = kv_elements(kv_heads, seq_len, batch, head_dim, value_head_dim)
    chunks = load_balanced_chunks(cp_size)
    block = whole * (chunks - 1) // chunks + batch * heads * (seq_len // chunks) * head_dim
    blocks = whole * (element_size + acc) + block * (element_size if fused else acc)
    return max(blocks, 2 * whole * acc)
