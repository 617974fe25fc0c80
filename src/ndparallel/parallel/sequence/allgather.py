"""All-gather context-parallel attention: K and V all-gathered over ``cp``, their gradients reduce-scattered back.

Each local query chunk ``[start, end)`` attends to the keys it may see: under a causal mask the keys before the
chunk in full and the chunk itself causally; otherwise the whole sequence. The partial results are merged by
log-sum-exp (`kernels.merge`). K/V are gathered again in backward rather than kept, so a layer saves only this
rank's shard; the full K/V exist transiently, once per layer and pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .collectives import gather_pair, reduce_scatter_pair
from .kernels import acc_dtype, block_backward, block_forward, merge
from .layout import SequenceLayout


def _key_blocks(layout: SequenceLayout, causal: bool) -> list[list[tuple[int, int, bool]]]:
    """Per local chunk, the key ranges ``(start, end, causal)`` it attends to: under a causal mask the keys before
    the chunk (full) and the chunk itself (causal); else the whole sequence."""
    if not causal:
        return [[(0, layout.seq_len, False)] for _ in layout.chunks()]
    return [[(0, s, False)] * (s > 0) + [(s, e, True)] for s, e in layout.chunks()]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SequenceLayout,
                group: dist.ProcessGroup, causal: bool, scale: float) -> torch.Tensor:
        full_k, full_v = gather_pair(key, value, layout, group)
        n, outs, lses = layout.chunk_len, [], []
        for j, blocks in enumerate(_key_blocks(layout, causal)):
            out = lse = None
            for s, e, diagonal in blocks:
                o, l = block_forward(query[:, :, j * n:(j + 1) * n], full_k[:, :, s:e], full_v[:, :, s:e], scale,
                                     diagonal)
                out, lse = merge(out, lse, o, l)
            outs.append(out)
            lses.append(lse)
        result, lse_all = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, result, lse_all)
        ctx.layout, ctx.group, ctx.causal, ctx.scale = layout, group, causal, scale
        return result.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        layout: SequenceLayout = ctx.layout
        n, acc = layout.chunk_len, acc_dtype(query)
        full_k, full_v = gather_pair(key, value, layout, ctx.group)
        dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        dk = torch.zeros(full_k.shape, dtype=acc, device=query.device)
        dv = torch.zeros(full_v.shape, dtype=acc, device=query.device)
        for j, blocks in enumerate(_key_blocks(layout, ctx.causal)):
            rows = slice(j * n, (j + 1) * n)
            for s, e, diagonal in blocks:
                g = block_backward(grad_out[:, :, rows], query[:, :, rows], full_k[:, :, s:e], full_v[:, :, s:e],
                                   out[:, :, rows], lse[:, :, rows], ctx.scale, diagonal)
                dq[:, :, rows] += g[0]
                dk[:, :, s:e] += g[1]
                dv[:, :, s:e] += g[2]
        dk, dv = reduce_scatter_pair(dk, dv, layout, ctx.group)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None


def allgather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SequenceLayout,
                        group: dist.ProcessGroup, is_causal: bool, scale: float) -> torch.Tensor:
    """Exact attention of the local queries over the whole sequence, K/V all-gathered over `group`.

    ``[batch, heads, local_len, head_dim]`` tensors (K/V may have fewer heads: GQA); shapes are checked by the caller
    (`ndparallel.parallel.sequence.attention`).
    """
    return _AllGatherAttention.apply(query, key, value, layout, group, bool(is_causal), float(scale))
