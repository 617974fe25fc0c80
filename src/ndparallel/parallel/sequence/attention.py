"""Exact attention over sequences sharded on ``cp x sp``: the one function every entry point ends in.

`sequence_parallel_attention` checks the shapes once, then (sp > 1) runs Ulysses over ``sp`` around the
context-parallel attention over ``cp`` (all-gather or ring, by `CP_ATTENTION`), or plain SDPA when cp is 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .allgather import allgather_attention
from .positions import SequenceChunking, SequenceShards
from .masking import DocumentMask
from .ring import ring_attention
from .ulysses import head_chunked_attention, ulysses_attention

# cp_comm_strategy -> attention over the cp shards; the names are `ndparallel.configuration.handlers.CP_STRATEGIES`,
# which validates
# them when a `TorchContextParallelConfig` is built. "alltoall" is Accelerate's name for rotating K/V blocks between
# the cp ranks: the ring.
CP_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {"allgather": allgather_attention, "ring": ring_attention,
                                                        "alltoall": ring_attention}


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shards: SequenceShards) -> None:
    """Raise unless q/k/v are ``[batch, heads, local_len, head_dim]`` shards of `shards`, with query heads a
    multiple of the key/value heads (GQA). The same on every rank, so it raises before any collective."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[0] != query.shape[0] or t.shape[2] != shards.local_len:
            raise ValueError(
                f"sequence-sharded attention: {name} has shape {tuple(t.shape)}, expected [batch, heads, "
                f"{shards.local_len}, head_dim] (this rank's {shards.local_len} of {shards.seq_len} positions), with "
                f"the query's batch size {query.shape[0]}"
            )
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"sequence-sharded attention: key has {key.shape[1]} heads, value {value.shape[1]}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"sequence-sharded attention: {query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads")


def sequence_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shards: SequenceShards,
                                *, cp_group: dist.ProcessGroup | None = None, sp_group: dist.ProcessGroup | None = None,
                                strategy: str = "allgather", is_causal: bool = True, scale: float | None = None,
                                doc: DocumentMask | None = None, head_chunks: int | str | None = None) -> torch.Tensor:
    """Exact attention of this rank's shard of queries over the whole sequence (causal by global position, or full).

    `shards` says which positions this rank holds (`SequenceShards`); `cp_group` / `sp_group` are the ``cp`` and
    ``sp`` groups (needed when their size is above 1); `strategy` is the context-parallel one ("allgather" or
    "ring"). Tensors are ``[batch, heads, local_len, head_dim]``; key/value may have fewer heads (GQA). `doc`: which
    keys each query sees in a padded or packed batch, and a sliding window (`masking.DocumentMask`). `head_chunks`:
    attention (and Ulysses' all-to-alls) over that many groups of heads, one after the other
    (`ulysses.ulysses_attention`, `ulysses.head_chunked_attention`).
    """
    check_qkv(query, key, value, shards)
    attend = whole_sequence_attend(shards, cp_group, strategy, is_causal, query.shape[-1], scale, doc)
    if shards.sp_size == 1:
        if shards.cp.size > 1:  # context parallelism alone: its head chunks, if any
            return head_chunked_attention(query, key, value, attend, head_chunks, shards.cp.seq_len)
        return attend(query, key, value)
    return ulysses_attention(query, key, value, sp_group, attend, head_chunks)


def whole_sequence_attend(shards: SequenceShards, cp_group: dist.ProcessGroup | None, strategy: str, is_causal: bool,
                          head_dim: int, scale: float | None, doc: DocumentMask | None
                          ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`attend(q, k, v)`: attention of head-sharded tensors over the whole (cp-local) sequence -- plain SDPA, the block
    kernels where documents mask it, or the context-parallel attention over ``cp`` (`sequence_parallel_attention`'s
    arguments)."""
    scale = head_dim ** -0.5 if scale is None else float(scale)
    chunking, cp_attention = shards.cp, CP_ATTENTION[strategy]
    masked = doc is not None and not doc.trivial

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if chunking.size == 1 and masked:  # the block kernels on this rank's whole sequence, in two chunks
            return ring_attention(q, k, v, SequenceChunking(chunking.seq_len, 1, 0, chunking.seq_len % 2 == 0), None,
                                  is_causal, scale, doc)
        if chunking.size == 1:
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **gqa)
        return cp_attention(q, k, v, chunking, cp_group, is_causal, scale, doc if masked else None)

    return attend
