"""Ulysses sequence parallelism: attention over a sequence sharded on ``sp`` by switching to head sharding.

Each rank of ``sp`` holds 1/sp of every sequence (`positions.SequenceShards`). Around attention:

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

Head chunks (``MemoryKwargs(ulysses_head_chunks=...)``, issue 50): the all-to-all, the attention and the all-to-all
back run over `chunks` groups of heads one after the other, so that only ``heads / chunks`` heads' full-sequence
q/k/v/o exist at a time. Chunk c takes, of every sp rank's block of heads, the c-th of `chunks` equal parts: after the
all-to-all rank s holds heads ``s*H/sp + c*H/(sp*chunks) + [0, H/(sp*chunks))``, the c-th part of the heads it holds
unchunked, with the key/value heads those queries meet (key/value heads are repeated to a multiple of ``sp * chunks``,
as for sp alone, the repeats picked per chunk from the sequence-sharded tensors). Forward keeps only the
sequence-sharded q/k/v (`_HeadChunked`); backward runs each chunk's all-to-alls and attention again and its backward,
one chunk at a time, adding the chunk's gradients into the whole shard's: backward too holds one chunk's full-sequence
tensors. The same operations on the same heads as the unchunked path: exact against it; the price is each chunk's
forward again (three all-to-alls and the attention) in backward. Nothing reads tensor values on the host.
Context parallelism alone (sp 1) takes the same groups with nothing to exchange (`head_chunked_attention`): the cp
attention's gathered key/value exist for one group at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .communication import HeadsToSeq, SeqToHeads, heads_from_parts, parts_from_heads

# "auto" head chunks: the fewest whose full-sequence q/k/v/o fit in this many bytes (the chunked loss's 128 MiB rule,
# `ndparallel.parallel.memory.cross_entropy.CHUNK_BYTES`).
HEAD_CHUNK_BYTES = 128 * 2**20


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


def chunk_counts(num_heads: int, sp_size: int) -> list[int]:
    """The head chunk counts Ulysses can run with: the divisors of the query heads each sp rank holds."""
    per_rank = num_heads // sp_size
    return [c for c in range(1, per_rank + 1) if per_rank % c == 0]


def check_head_chunks(chunks: int | str | None, num_heads: int, sp_size: int, tp_size: int = 1,
                      where: str = "") -> None:
    """Refuse an int `chunks` that does not divide the query heads each sp rank holds (after tp), before any
    collective; None and "auto" always work."""
    if chunks is None or isinstance(chunks, str):
        return
    local = num_heads // tp_size
    if local % sp_size or (local // sp_size) % chunks:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}ulysses_head_chunks={chunks} does not divide the {local // sp_size} query heads "
                         f"each sp rank holds (num_attention_heads={num_heads} / tp_size={tp_size} / "
                         f"sp_size={sp_size}); chunk counts that work: {chunk_counts(local, sp_size)}")


def auto_head_chunks(num_heads: int, num_kv_heads: int, sp_size: int, full_len: int, batch: int, head_dim: int,
                     element_size: int, budget: int | None = None) -> int:
    """The fewest head chunks whose full-sequence q/k/v/o (``batch x full_len x head_dim`` each head, the key/value
    heads as repeated for that count) fit in `budget` bytes; the most chunks (one query head per rank each) when none
    does. One wherever all of them fit: the unchunked path. `budget`: `HEAD_CHUNK_BYTES` unless given."""
    budget = HEAD_CHUNK_BYTES if budget is None else budget
    counts = chunk_counts(num_heads, sp_size)
    for chunks in counts:
        if chunk_bytes(num_heads, num_kv_heads, sp_size, chunks, full_len, batch, head_dim, element_size) <= budget:
            return chunks
    return counts[-1]


def chunk_bytes(num_heads: int, num_kv_heads: int, sp_size: int, chunks: int, full_len: int, batch: int,
                head_dim: int, element_size: int) -> int:
    """Bytes of one chunk's full-sequence q, k, v and o on one sp rank: ``heads / (sp * chunks)`` query heads (q and
    o) and as many key/value heads (k and v, repeated for that count by `kv_repeats`), each ``batch x full_len x
    head_dim`` elements of `element_size` bytes (`auto_head_chunks` fits them in its budget; the planner counts
    them, `ndparallel.planner.footprint.attention_backward`)."""
    kv = num_kv_heads * kv_repeats(num_heads, num_kv_heads, sp_size * chunks)
    heads = 2 * (num_heads + kv) // (sp_size * chunks)  # q and o, k and v, of one chunk on one rank
    return heads * batch * full_len * head_dim * element_size


Runs = list[list[tuple[int, int]]]  # per sp rank t: the heads sent to t, as (first head, count) runs


def _runs(heads: list[int]) -> list[tuple[int, int]]:
    """`heads` as (first head, count) runs of consecutive heads, in order; a repeated head starts a new run."""
    runs: list[tuple[int, int]] = []
    for h in heads:
        if runs and h == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((h, 1))
    return runs


def _chunk_heads(heads: int, repeats: int, size: int, chunks: int, c: int) -> Runs:
    """The (original) heads of a [B, heads, L, D] tensor that chunk c sends to each sp rank: of rank t's block of the
    ``heads * repeats`` repeated heads, the c-th part; repeated head j is head j // repeats."""
    block = heads * repeats // size
    part = block // chunks
    return [_runs([(t * block + c * part + j) // repeats for j in range(part)]) for t in range(size)]


def _send(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """``[size, B, part, L, D]``: the heads of `x` ([B, H, L, D]) that `runs` name for each rank, in one copy (two for
    a rank's heads of several runs: repeated key/value heads)."""
    return torch.stack([x.narrow(1, *r[0]) if len(r) == 1 else torch.cat([x.narrow(1, *run) for run in r], dim=1)
                        for r in runs])


def _add(into: torch.Tensor, parts: torch.Tensor, runs: Runs) -> None:
    """Add `parts` ([size, B, part, L, D]) into the heads of `into` that `runs` name -- `_send`'s adjoint, in place (a
    head named twice gets both)."""
    for t, rank_runs in enumerate(runs):
        offset = 0
        for first, n in rank_runs:
            into.narrow(1, first, n).add_(parts[t].narrow(1, offset, n))
            offset += n


def _arrive(parts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`heads_from_parts` over sp; with no sp (context parallelism alone: one part) the part itself."""
    return parts[0] if parts.shape[0] == 1 else heads_from_parts(parts, group)


def _leave(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """`parts_from_heads` over sp; with no sp, `x` as its one part."""
    return x.unsqueeze(0) if size == 1 else parts_from_heads(x, group, size)


def chunk_plan(heads: int, kv_heads: int, size: int, chunks: int) -> list[tuple[Runs, Runs, Runs]]:
    """Per chunk, the heads of ``[B, heads, L, D]`` query and ``[B, kv_heads, L, D]`` key and value that it sends to
    each sp rank (the module docstring's groups; key/value heads repeated to a multiple of ``size * chunks``)."""
    repeats = kv_repeats(heads, kv_heads, size * chunks)
    plans = []
    for c in range(chunks):
        kv = _chunk_heads(kv_heads, repeats, size, chunks, c)
        plans.append((_chunk_heads(heads, 1, size, chunks, c), kv, kv))
    return plans


def resolve_chunks(head_chunks: int | str | None, heads: int, kv_heads: int, size: int, full_len: int, batch: int,
                   head_dim: int, element_size: int) -> int:
    """The head chunks `head_chunks` means for these shapes (1: all heads at once): "auto" as `auto_head_chunks`, an
    int checked against the heads each sp rank holds (`check_head_chunks`)."""
    if head_chunks == "auto":
        return auto_head_chunks(heads, kv_heads, size, full_len, batch, head_dim, element_size)
    if head_chunks is None or head_chunks <= 1:
        return 1
    check_head_chunks(head_chunks, heads, size)
    return head_chunks


class _HeadChunked(torch.autograd.Function):
    """Ulysses over groups of heads (module docstring). Forward runs the chunks one after the other and keeps only
    the sequence-sharded q/k/v; backward runs each chunk's all-to-alls and attention again and its backward, one
    chunk at a time, adding its q/k/v gradients into whole-shard buffers (the input's gradients, which exist anyway).
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                size: int, chunks: int, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(query, key, value)
        ctx.group, ctx.size, ctx.chunks, ctx.attend = group, size, chunks, attend
        b, h, n, _ = query.shape
        out = query.new_empty(b, size, chunks, h // (size * chunks), n, value.shape[-1])  # rank block, chunk, head
        for c, runs in enumerate(_HeadChunked.plan(query, key, size, chunks)):
            heads = [_arrive(_send(t, r), group) for t, r in zip((query, key, value), runs)]
            out[:, :, c] = _leave(attend(*heads), group, size).transpose(0, 1)
            del heads
        return out.view(b, h, n, value.shape[-1])

    @staticmethod
    def plan(query: torch.Tensor, key: torch.Tensor, size: int, chunks: int) -> list[tuple[Runs, Runs, Runs]]:
        """Per chunk, the heads of query, key and value sent to each rank (`chunk_plan`)."""
        return chunk_plan(query.shape[1], key.shape[1], size, chunks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        inputs = [t.detach() for t in ctx.saved_tensors]
        grads = [torch.zeros_like(t) for t in inputs]
        for runs in _HeadChunked.plan(inputs[0], inputs[1], ctx.size, ctx.chunks):
            # the chunk's full-sequence heads as leaves: what was sent is freed as soon as it has arrived
            heads = [_arrive(_send(t, r), ctx.group).requires_grad_() for t, r in zip(inputs, runs)]
            with torch.enable_grad():
                out = ctx.attend(*heads)
            d_out = _arrive(_send(grad, runs[0]), ctx.group)  # the output's all-to-all's adjoint
            d_heads = list(torch.autograd.grad(out, heads, d_out))
            del out, d_out, heads
            for into, r in zip(grads, runs):
                _add(into, _leave(d_heads.pop(0), ctx.group, ctx.size), r)
        return (*grads, None, None, None, None)


def head_chunked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                           head_chunks: int | str | None, full_len: int) -> torch.Tensor:
    """Context parallelism alone (no sp): `attend` over `head_chunks` groups of heads, one after the other, each
    recomputed in backward (the module docstring's head chunks with nothing to exchange), so the gathered (or
    circulating) key/value blocks and the attention's buffers exist for one group of heads at a time. "auto" counts
    q/k/v/o at `full_len`, the whole sequence's length (the gathered key/value's; q/o are shards: an overcount)."""
    b, h, _, d = query.shape
    head_chunks = resolve_chunks(head_chunks, h, key.shape[1], 1, full_len, b, d, query.element_size())
    if head_chunks == 1:
        return attend(query, key, value)
    return _HeadChunked.apply(query, key, value, None, 1, head_chunks, attend)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      head_chunks: int | str | None = None) -> torch.Tensor:
    """Attention of sequence-sharded ``[batch, heads, local_len, head_dim]`` tensors over `group` (``sp``).

    `attend(q, k, v)` computes attention over the whole (cp-local) sequence of head-sharded tensors (GQA allowed:
    k/v may have fewer heads). Shapes are checked by the caller (`ndparallel.parallel.sequence.attention`); every
    rank of `group` sees the same ones. `head_chunks`: None or 1, all heads at once; an int, that many groups of heads
    one after the other (module docstring); "auto", `auto_head_chunks` for these shapes.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return attend(query, key, value)
    b, h, n, d = query.shape
    head_chunks = resolve_chunks(head_chunks, h, key.shape[1], size, size * n, b, d, query.element_size())
    if head_chunks > 1:
        return _HeadChunked.apply(query, key, value, group, size, head_chunks, attend)
    repeats = kv_repeats(query.shape[1], key.shape[1], size)
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    q, k, v = (SeqToHeads.apply(t, group, size) for t in (query, key, value))
    return HeadsToSeq.apply(attend(q, k, v), group, size)
