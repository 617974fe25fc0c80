"""Ulysses sequence parallelism: attention over a sequence sharded on ``sp`` by switching to head sharding.

Each rank of ``sp`` holds 1/sp of every sequence (`layout.SequenceShards`). Around attention:

1. one all-to-all over ``sp`` turns sequence-sharded ``[batch, heads, L/sp, head_dim]`` query/key/value into
   head-sharded ``[batch, heads/sp, L, head_dim]``: rank s keeps heads ``[s*heads/sp, (s+1)*heads/sp)`` of every
   rank's piece and concatenates the pieces in sp order;
2. attention runs on whole-length sequences for those heads (plain SDPA, or with ``cp > 1`` the context-parallel
   attention (all-gather or ring) over the cp rank's shard: "unified sequence parallelism");
3. a second all-to-all turns the output back into sequence-sharded ``[batch, heads, L/sp, head_dim]``.

Backward runs the same collectives the other way round (each all-to-all's gradient is the inverse all-to-all;
`collectives.SeqToHeads` / `HeadsToSeq`).
Per layer and direction a rank sends (sp-1)/sp of its q, k, v and output shards; the amount per rank falls as sp
grows, unlike all-gather CP, whose K/V traffic per rank is constant.

Grouped-query attention: key/value heads are split over ``sp`` like query heads, so query head h still meets its
key/value head. When the (local) key/value heads are not a multiple of sp, each is repeated (as ``repeat_kv``) to
the least count that is; the repeats' gradients sum back through autograd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .communication import HeadsToSeq, SeqToHeads


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int, tp_size: int = 1, where: str = "") -> None:
    """Refuse head counts Ulysses cannot split, before any collective. `num_heads`/`num_kv_heads` are the model's
    (global) counts; tensor parallelism splits them by `tp_size` first."""
    prefix = f"{where}: " if where else ""
    if num_heads % (tp_size * sp_size):
        works = [s for s in range(1, num_heads + 1) if num_heads % (tp_size * s) == 0]
        raise ValueError(
            f"{prefix}sp_size={sp_size}{f' x tp_size={tp_size}' if tp_size > 1 else ''} does not divide "
            f"num_attention_heads={num_heads}: Ulysses gives each sequence-parallel rank whole attention heads "
            f"(num_attention_heads must be a multiple of tp_size * sp_size); sp sizes that work: {works}"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{prefix}num_attention_heads={num_heads} is not a multiple of num_key_value_heads="
                         f"{num_kv_heads}")


def kv_repeats(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each (local) key/value head is repeated so that sp splits them like the query heads: the
    least r with ``num_kv_heads * r`` a multiple of `sp_size` (it divides `num_heads`, which is a multiple of both)."""
    if num_heads % sp_size or num_heads % num_kv_heads:
        raise ValueError(f"Ulysses attention: {num_heads} query heads and {num_kv_heads} key/value heads cannot be "
                         f"split over sp_size={sp_size}; query heads must be a multiple of sp_size and of the "
                         "key/value heads")
    return sp_size // math.gcd(num_kv_heads, sp_size)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Attention of sequence-sharded ``[batch, heads, local_len, head_dim]`` tensors over `group` (``sp``).

    `attend(q, k, v)` computes attention over the whole (cp-local) sequence of head-sharded tensors (GQA allowed:
    k/v may have fewer heads). Shapes are checked by the caller (`ndparallel.parallel.sequence.attention`); every
    rank of `group` sees the same ones.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return attend(query, key, value)
    repeats = kv_repeats(query.shape[1], key.shape[1], size)
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    q, k, v = (SeqToHeads.apply(t, group, size) for t in (query, key, value))
    return HeadsToSeq.apply(attend(q, k, v), group, size)
