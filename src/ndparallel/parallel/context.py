"""Context parallelism: each rank of ``cp`` holds 1/cp of every sequence and attention stays exact.

Layout (`SequenceLayout`). A sequence of S tokens is cut into equal chunks:
- load-balanced (default): 2*cp chunks of S/(2*cp); rank r holds chunks r and 2*cp-1-r, in that order. Under a
  causal mask, chunk c attends to c+1 chunks' worth of keys, so every rank gets the same amount of work
  (r+1 + 2*cp-r = 2*cp+1 chunk pairs);
- contiguous: cp chunks of S/cp; rank r holds chunk r (the last rank does cp times the work of the first).
A rank's local rows are its chunks concatenated; `SequenceLayout.positions` gives their global positions.
With Ulysses sequence parallelism as well (cp x sp), `SequenceShards` cuts each cp rank's shard into sp contiguous
pieces (`ndparallel.parallel.ulysses`); the attention below then sees the cp rank's whole shard.

Attention over the shards, two strategies (both exact, both differentiable, any device and backend), built from
the blockwise attention of `ndparallel.parallel.blockwise` (a block's output and log-sum-exp; partial results over
disjoint keys merged exactly):
- ``"allgather"`` (`allgather_attention`): all-gather K and V over ``cp``, attend each local chunk to the keys it
  may see, reduce-scatter the K/V gradients in backward. K/V are gathered again in backward rather than kept, so
  only this rank's shard is saved; the full K/V exist transiently, once per layer.
- ``"ring"`` (`ndparallel.parallel.ring.ring_attention`): K/V blocks travel around the ring with point-to-point
  sends while each rank attends to the block it holds; its backward passes the K/V gradients around the ring too.
  A rank holds at most two K/V blocks (in backward, with their gradients); cp-1 sequential hops per pass.

Model integration (which attention calls these) lives in `ndparallel.attention`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..loss import IGNORE_INDEX
from .blockwise import acc_dtype, block_backward, block_forward, merge

STRATEGIES = ("allgather", "ring")


@dataclass(frozen=True)
class SequenceLayout:
    """How one sequence of `seq_len` tokens is split over the `size` ranks of a group; `rank` is this rank's index.

    Raises ValueError when `seq_len` does not split into equal chunks, before anything is communicated.
    """

    seq_len: int
    size: int
    rank: int
    load_balance: bool = True

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.seq_len < 1:
            raise ValueError(f"context parallelism needs sequences of at least one token, got length {self.seq_len}")
        if self.seq_len % self.num_chunks:
            if self.load_balance:
                raise ValueError(
                    f"sequence length {self.seq_len} is not divisible by 2 * cp_size = {self.num_chunks}: the "
                    f"load-balanced context-parallel layout cuts each sequence into {self.num_chunks} equal chunks. "
                    f"Pad or cut sequences to a multiple of {self.num_chunks}, or use "
                    f"TorchContextParallelConfig(load_balance=False), which needs a multiple of {self.size}"
                )
            raise ValueError(
                f"sequence length {self.seq_len} is not divisible by cp_size = {self.size}: context parallelism "
                f"gives each rank an equal share. Pad or cut sequences to a multiple of {self.size}"
            )

    @property
    def num_chunks(self) -> int:
        return 2 * self.size if self.load_balance else self.size

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """Global indices of the chunks `rank` (default: this rank) holds, in local order."""
        r = self.rank if rank is None else rank
        return (r, self.num_chunks - 1 - r) if self.load_balance else (r,)

    def chunks(self, rank: int | None = None) -> list[tuple[int, int]]:
        """Global ``[start, end)`` of each chunk `rank` holds, in local order."""
        n = self.chunk_len
        return [(c * n, (c + 1) * n) for c in self.chunk_ids(rank)]

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's local rows (a LongTensor of `local_len`)."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.chunks()])

    def shard(self, x: torch.Tensor, dim: int, rank: int | None = None) -> torch.Tensor:
        """`rank`'s part of a full-sequence tensor along `dim` (a new tensor when there are several chunks)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} positions along dim {dim}, got shape {tuple(x.shape)}")
        parts = [x.narrow(dim, s, e - s) for s, e in self.chunks(rank)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The full-sequence tensor from every rank's local part (``parts[r]`` is rank r's), in global order."""
        n = self.chunk_len
        pieces: list[torch.Tensor | None] = [None] * self.num_chunks
        for r, part in enumerate(parts):
            for j, c in enumerate(self.chunk_ids(r)):
                pieces[c] = part.narrow(dim, j * n, n)
        return torch.cat(pieces, dim)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SequenceShards:
    """A sequence sharded over ``cp x sp`` (Ulysses inside context parallelism, "unified sequence parallel").

    `cp` says which tokens this rank's cp rank holds (`SequenceLayout`, load-balanced or not); the ``sp`` ranks of
    that cp rank split its shard into `sp_size` contiguous pieces, sp rank s holding piece s. Ulysses' all-to-all
    over ``sp`` concatenates the pieces in sp order, so after it each rank holds its cp rank's whole shard, in the
    order context-parallel attention expects. With ``sp_size=1`` this is `cp` itself; with ``cp.size=1``, plain
    Ulysses (each sp rank a contiguous 1/sp of the sequence). Raises ValueError when the length does not split.
    """

    cp: SequenceLayout
    sp_size: int = 1
    sp_rank: int = 0

    def __post_init__(self) -> None:
        if self.sp_size < 1 or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"rank {self.sp_rank} is not in a group of {self.sp_size}")
        if self.cp.local_len % self.sp_size:
            need = self.cp.size * self.sp_size
            if self.cp.load_balance and self.cp.size > 1:
                need = math.lcm(need, self.cp.num_chunks)
            raise ValueError(
                f"sequence length {self.seq_len} does not split over cp_size={self.cp.size} x "
                f"sp_size={self.sp_size}: each cp rank's {self.cp.local_len} tokens must split into {self.sp_size} "
                f"equal sequence-parallel pieces. Pad or cut sequences to a multiple of {need}"
            )

    @classmethod
    def of(cls, seq_len: int, cp_size: int = 1, cp_rank: int = 0, load_balance: bool = True, sp_size: int = 1,
           sp_rank: int = 0) -> SequenceShards:
        return cls(SequenceLayout(seq_len, cp_size, cp_rank, load_balance and cp_size > 1), sp_size, sp_rank)

    @property
    def seq_len(self) -> int:
        return self.cp.seq_len

    @property
    def size(self) -> int:
        return self.cp.size * self.sp_size

    @property
    def local_len(self) -> int:
        return self.cp.local_len // self.sp_size

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's local rows."""
        return self.cp.positions(device).narrow(0, self.sp_rank * self.local_len, self.local_len)

    def shard(self, x: torch.Tensor, dim: int, sp_rank: int | None = None) -> torch.Tensor:
        """This rank's part (sp rank `sp_rank`, default this one, of this cp rank) of a full-sequence tensor."""
        s = self.sp_rank if sp_rank is None else sp_rank
        return self.cp.shard(x, dim).narrow(dim, s * self.local_len, self.local_len)


def shard_loss_tokens(batch: Any, size: int, rank: int, load_balance: bool, sp_size: int = 1,
                      sp_rank: int = 0) -> int | None:
    """Loss tokens in `rank`'s shard of a batch's sequences: what the model's loss averages over on that rank.

    Counts ``shift_labels`` if the batch has them, else ``labels`` shifted as Hugging Face models (and a context
    parallel script) shift them: ``labels[..., 1:]`` padded with -100. None when the batch has neither, or when
    its length does not split into this layout (such a batch cannot be sharded; evaluation may still use it whole,
    and ``maybe_context_parallel`` refuses it for training).
    """
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
            return None
        labels = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    try:
        layout = SequenceShards.of(labels.shape[-1], size, rank, load_balance, sp_size, sp_rank)
    except ValueError:
        return None
    return int((layout.shard(labels, -1) != IGNORE_INDEX).sum())


# ---- all-gather attention ----------------------------------------------------------------------------------------
def gather_sequence(x: torch.Tensor, layout: SequenceLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's shard of `x` (sequence on dim 2) concatenated in global order (not differentiable)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(layout.size)]
    dist.all_gather(parts, x, group=group)
    return layout.unshard(parts, dim=2)


def reduce_scatter_sequence(x: torch.Tensor, layout: SequenceLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of every rank's full-sequence `x` (dim 2), each rank receiving its own shard of the sum."""
    parts = [layout.shard(x, 2, rank=r).contiguous() for r in range(layout.size)]
    out = torch.empty_like(parts[layout.rank])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


def gather_pair(a: torch.Tensor, b: torch.Tensor, layout: SequenceLayout,
                group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_sequence` of two tensors (K and V) with one collective when their shapes allow: one rendezvous per
    layer instead of two, the same bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return gather_sequence(a, layout, group), gather_sequence(b, layout, group)
    return gather_sequence(torch.cat([a, b], dim=1), layout, group).chunk(2, dim=1)


def reduce_scatter_pair(a: torch.Tensor, b: torch.Tensor, layout: SequenceLayout,
                        group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """`reduce_scatter_sequence` of two tensors (the K and V gradients), with one collective when shapes allow."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return reduce_scatter_sequence(a, layout, group), reduce_scatter_sequence(b, layout, group)
    return reduce_scatter_sequence(torch.cat([a, b], dim=1), layout, group).chunk(2, dim=1)


def _key_blocks(layout: SequenceLayout, causal: bool) -> list[list[tuple[int, int, bool]]]:
    """Per local chunk, the key ranges ``(start, end, causal)`` it attends to: under a causal mask the keys before
    the chunk (full) and the chunk itself (causal); else the whole sequence."""
    if not causal:
        return [[(0, layout.seq_len, False)] for _ in layout.chunks()]
    return [[(0, s, False)] * (s > 0) + [(s, e, True)] for s, e in layout.chunks()]


class _AllGatherAttention(torch.autograd.Function):
    """K/V all-gathered in forward (and again in backward, rather than kept); their gradients reduce-scattered."""

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
                        group: dist.ProcessGroup, is_causal: bool, scale: float | None) -> torch.Tensor:
    """Attention of the local queries over the whole sequence, with K/V all-gathered over `group`.

    Shapes as `scaled_dot_product_attention`: ``[batch, heads, local_len, head_dim]`` (K/V may have fewer heads).
    Under a causal mask each local chunk ``[start, end)`` attends to keys ``[0, start)`` in full and to itself
    causally; the two partial results are merged by log-sum-exp (`ndparallel.parallel.blockwise`).
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _AllGatherAttention.apply(query, key, value, layout, group, bool(is_causal), float(scale))


def sharded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SequenceLayout,
                      group: dist.ProcessGroup, strategy: str, is_causal: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """Exact attention for sequence-sharded ``[batch, heads, local_len, head_dim]`` tensors (see module doc)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[2] != layout.local_len:
            raise ValueError(
                f"context-parallel attention: {name} has shape {tuple(t.shape)}, expected [batch, heads, "
                f"{layout.local_len}, head_dim] (this rank's {layout.local_len} of {layout.seq_len} positions)"
            )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"context-parallel attention: {query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads")
    if layout.size == 1:
        gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale, **gqa)
    if strategy == "allgather":
        return allgather_attention(query, key, value, layout, group, is_causal, scale)
    if strategy == "ring":
        from .ring import ring_attention

        return ring_attention(query, key, value, layout, group, is_causal, scale)
    raise ValueError(f"cp_comm_strategy must be one of {list(STRATEGIES)}, got {strategy!r}")


# ---- step 3 of `ndparallel.parallel.parallelize` -------------------------------------------------------------------
def _sizes_label(mesh: Any) -> str:
    return " x ".join(f"{axis}_size={mesh.size(axis)}" for axis in ("cp", "sp") if mesh.size(axis) > 1)


def check_context_parallel(model: nn.Module, mesh: Any) -> None:
    """Refuse, before any collective, a model whose attention context/sequence parallelism cannot make exact, or
    (``sp > 1``) whose attention heads Ulysses cannot split."""
    from .. import attention

    attention.check_model(model, _sizes_label(mesh))
    if mesh.size("sp") > 1:
        from .ulysses import check_heads

        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            kv = getattr(config, "num_key_value_heads", None) or heads
            check_heads(heads, kv, mesh.size("sp"), mesh.size("tp"), where=type(model).__name__)


def apply_context_parallel(model: nn.Module, mesh: Any, config: Any) -> nn.Module:
    """Route `model`'s attention through context-parallel attention (see `ndparallel.attention`), Ulysses over
    ``sp`` included.

    Hugging Face models with ``attn_implementation`` "sdpa" or "eager" are switched to ndparallel's registered
    attention function; any other model must call `ndparallel.attention.context_parallel_attention` itself. The
    strategy and layout (`config`, a `TorchContextParallelConfig`) are applied per batch by
    ``Accelerator.maybe_context_parallel``.
    """
    from .. import attention

    attention.prepare_model(model, _sizes_label(mesh))
    return model
