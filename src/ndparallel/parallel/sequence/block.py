"""Head-chunked attention blocks: the q/k/v/o projections' backward inside each head chunk (issue 50).

Head-chunked attention (`ulysses`, ``MemoryKwargs(ulysses_head_chunks=...)``) holds one chunk's full-sequence heads
at a time, but the projections around it do not: autograd hands o_proj's backward the layer's output gradient and
gets back the gradient of the whole attention output, and the attention's backward gives q_proj/k_proj/v_proj the
shard's q/k/v gradients whole -- all heads of all the rank's tokens at once. The projections are per head along
their output (q/k/v) and input (o) dimensions, so their backward splits by head exactly as the attention's does.

With head chunks on, `install` runs each Llama attention module (plain ``nn.Linear`` projections, the module's own
rotary function) through `ChunkedBlock` while sequences are sharded:

- forward is the module's own, op for op (the projections whole, its rotary function, `context_parallel_attention`
  over head chunks, the head-major output made contiguous, o_proj): the same values. It keeps for backward only the
  hidden states it was given and the rotary tables (the module's own path keeps those hidden states too, and the
  sequence-sharded q/k/v and o_proj's copy of the output besides);
- backward, per chunk of `ulysses.chunk_plan`: the chunk's heads' rows of q_proj/k_proj/v_proj again, rotary, the
  chunk's all-to-alls and attention (`_HeadChunked`'s), o_proj's backward for the chunk's columns (the gradient of the
  chunk's heads of the attention output, and their columns of o_proj's weight gradient), the attention's and
  rotary's backward, and the projections' backward for the chunk's rows: the hidden states' gradient accumulated in
  place (``addmm_``) in one buffer of their shape and dtype, the weights' gradients by rows (key/value heads shared
  by several chunks add up). The whole shard's q/k/v/o gradients never exist; one chunk's do.

The same operations on the same heads as the unchunked block, but the hidden states' gradient is summed over the
chunks' matmuls (3 per chunk, in the compute dtype) where autograd sums three whole-head ones: equal to rounding
(tests: fp32 1e-6 of each gradient's largest element; in bf16 the errors against fp64 measured 1.4x the module's for
the hidden states' gradient, up to 2x for key/value weights whose heads several chunks share). The price: each chunk's q/k/v projections, rotary, all-to-alls and attention forward again in
backward. Nothing reads tensor values on the host. Tensor-parallel projections (DTensor weights: under tp
`apply_sequence_parallel` does not install the block, and `_plain_reason` refuses them), adapters (PEFT wrappers around
the projections), caches, masks and dropout keep the module's own forward (`_plain_reason`). Tested in training
(`chunked_calls` counts the forwards it ran): sp 2, cp 2, pp 2 x sp 2 and dp_shard 2 x sp 2 run it and train as
unchunked; tp 2 x sp 2 never runs it and trains as unchunked (tests/parallel/sequence/test_ulysses_head_chunks.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...models.families import chunked_attention_types
from .attention import whole_sequence_attend
from .sharding import active, context_parallel_attention
from .ulysses import (Runs, _add, _arrive, _leave, _runs, _send, chunk_bytes, chunk_plan, kv_repeats,
                      resolve_chunks)

# model type -> the attention class whose forward `ChunkedBlock` reproduces op for op (the families table's); the planner
# models the chunked block for these types
MODEL_TYPES = chunked_attention_types()
SUPPORTED = tuple(MODEL_TYPES.values())
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class _Spec:
    """What the chunked block's backward needs besides tensors."""

    head_dim: int
    heads: int
    kv_heads: int
    chunks: int
    size: int  # sp ranks (1: context parallelism alone)
    group: Any
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # whole-sequence heads (`ulysses`)
    causal: bool
    scale: float | None


def _local(runs: Runs) -> tuple[list[tuple[int, int]], Runs]:
    """The distinct heads `runs` name (all ranks), as spans of consecutive heads, and `runs` renumbered to their
    positions among those heads (a chunk's q/k/v hold only its heads, in order)."""
    heads = sorted({first + j for rank in runs for first, n in rank for j in range(n)})
    where = {h: i for i, h in enumerate(heads)}
    return _runs(heads), [[(where[first], n) for first, n in rank] for rank in runs]


def _rows(t: torch.Tensor | None, spans: list[tuple[int, int]], d: int, dim: int = 0) -> torch.Tensor | None:
    """The rows (`dim` 0) or columns (1) of `t` of heads `spans` (head h: ``[h*d, (h+1)*d)``), in one copy."""
    if t is None:
        return None
    parts = [t.narrow(dim, first * d, n * d) for first, n in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _add_rows(into: torch.Tensor, part: torch.Tensor, spans: list[tuple[int, int]], d: int, dim: int = 0) -> None:
    """`_rows`' adjoint: add `part` into the rows (columns) of `into` of heads `spans`, in place."""
    offset = 0
    for first, n in spans:
        into.narrow(dim, first * d, n * d).add_(part.narrow(dim, offset, n * d))
        offset += n * d


def _rotary_in_place(rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(q, k, cos, sin)` one key/value head and its query heads at a time, each result written over its
    input: elementwise per head, so the same values, without a second copy of q and k or all heads' temporaries."""
    group = q.shape[1] // k.shape[1]
    for g in range(k.shape[1]):
        heads_q, heads_k = q[:, g * group:(g + 1) * group], k[:, g:g + 1]
        part_q, part_k = rotary(heads_q, heads_k, cos, sin)
        heads_q.copy_(part_q)
        heads_k.copy_(part_k)
        del part_q, part_k
    return q, k


class ChunkedBlock(torch.autograd.Function):
    """A Llama attention block (q/k/v projections, rotary, attention, o_proj) whose backward runs head chunk by head
    chunk (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                wv: torch.Tensor, wo: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
                bv: torch.Tensor | None, bo: torch.Tensor | None, spec: _Spec) -> torch.Tensor:
        ctx.save_for_backward(x, cos, sin, wq, wk, wv, wo, bq, bk, bv, bo)
        ctx.spec = spec
        shape = (*x.shape[:-1], -1, spec.head_dim)
        q, k, v = (F.linear(x, w, b).view(shape).transpose(1, 2) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        q, k = _rotary_in_place(spec.rotary, q, k, cos, sin)
        out = context_parallel_attention(q, k, v, is_causal=spec.causal, scale=spec.scale)
        del q, k, v
        out = out.transpose(1, 2).contiguous()  # as the registered attention function returns it
        return F.linear(out.reshape(*x.shape[:-1], -1).contiguous(), wo, bo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, cos, sin, wq, wk, wv, wo, bq, bk, bv, bo = (None if t is None else t.detach() for t in ctx.saved_tensors)
        spec, d = ctx.spec, ctx.spec.head_dim
        b, n = x.shape[:2]
        x2, g2 = x.reshape(b * n, x.shape[-1]), grad.reshape(b * n, grad.shape[-1])
        dx = torch.zeros_like(x2)
        dws = [torch.zeros_like(w) for w in (wq, wk, wv, wo)]
        dbs = [None if t is None else torch.zeros_like(t) for t in (bq, bk, bv)]
        for runs in chunk_plan(spec.heads, spec.kv_heads, spec.size, spec.chunks):
            (q_spans, q_runs), (kv_spans, kv_runs) = _local(runs[0]), _local(runs[1])
            spans, local_runs = (q_spans, kv_spans, kv_spans), (q_runs, kv_runs, kv_runs)
            weights = [_rows(w, s, d) for w, s in zip((wq, wk, wv), spans)]
            with torch.enable_grad():  # the chunk's heads of q/k/v, sequence-sharded, and their rotary
                pre = [F.linear(x2, w, _rows(t, s, d)).view(b, n, -1, d).transpose(1, 2).requires_grad_()
                       for w, t, s in zip(weights, (bq, bk, bv), spans)]
                q, k = spec.rotary(pre[0], pre[1], cos, sin)
            # the chunk's full-sequence heads as leaves: what was sent is freed as soon as it has arrived
            heads = [_arrive(_send(t.detach(), r), spec.group).requires_grad_()
                     for t, r in zip((q, k, pre[2]), local_runs)]
            # the value projection, sent, is done with (no graph holds it: rotary takes q and k): let it go before
            # the attention, keeping its shape, dtype and layout for its gradient
            v_like = pre.pop()
            v_like = (v_like.new_empty(0), (b, n, v_like.shape[1], d))
            with torch.enable_grad():
                out = spec.attend(*heads)
            # o_proj's backward for the chunk's columns: their weight gradient, and the chunk's output gradient
            o_local = _leave(out.detach(), spec.group, spec.size).permute(1, 3, 0, 2, 4).reshape(b * n, -1)
            _add_rows(dws[3], g2.t() @ o_local, q_spans, d, dim=1)
            del o_local
            d_out = (g2 @ _rows(wo, q_spans, d, dim=1)).view(b, n, -1, d).transpose(1, 2)
            d_out = _arrive(_send(d_out, q_runs), spec.group)  # the output's all-to-all's adjoint
            d_heads = list(torch.autograd.grad(out, heads, d_out))
            del out, d_out, heads
            d_local = []
            for t, r in zip((q, k, v_like), local_runs):
                into = torch.zeros_like(t) if isinstance(t, torch.Tensor) else t[0].new_zeros(t[1]).transpose(1, 2)
                _add(into, _leave(d_heads.pop(0), spec.group, spec.size), r)
                d_local.append(into)
            d_pre = [*torch.autograd.grad((q, k), pre, d_local[:2]), d_local[2]]
            del q, k, pre, d_local, v_like
            for i, (dp, s) in enumerate(zip(d_pre, spans)):
                dp2 = dp.transpose(1, 2).reshape(b * n, -1)
                dx.addmm_(dp2, weights[i])
                _add_rows(dws[i], dp2.t() @ x2, s, d)
                if dbs[i] is not None:
                    _add_rows(dbs[i], dp2.sum(0), s, d)
            # the loops' names too: they would keep this chunk's value projection and its gradient into the next one
            del d_pre, weights, t, into, dp, dp2
        dbo = g2.sum(0) if bo is not None else None
        return dx.view_as(x), None, None, *dws, *dbs, dbo, None


def _plain_reason(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this call keeps the module's own forward (None: `ChunkedBlock` runs it)."""
    if active() is None or not torch.is_grad_enabled():
        return "not sharded, or no backward"
    if len(args) > 1 or "hidden_states" not in kwargs and not args:
        return "called positionally"
    if kwargs.get("attention_mask") is not None or kwargs.get("cache") is not None \
            or kwargs.get("past_key_values") is not None:
        return "a mask or a cache"
    if module.training and getattr(module, "attention_dropout", 0.0):
        return "attention dropout"
    if any(kwargs.get(k) for k in ("output_attentions", "sliding_window")):
        return "attention weights or a window asked for"
    rotary = kwargs.get("position_embeddings")
    if not isinstance(rotary, tuple) or len(rotary) != 2 or any(t.requires_grad for t in rotary):
        return "rotary tables that are not a (cos, sin) pair of constants"
    params = [getattr(module, p).weight for p in PROJECTIONS]
    if any(type(p) is not torch.Tensor and type(p) is not nn.Parameter for p in params):
        return "tensor-parallel (DTensor) projections"
    return None


@torch.compiler.disable  # collectives and the per-batch sharding state: kept out of compiled graphs
def _forward(module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The attention module's forward once `install`ed: `ChunkedBlock` where it applies and more than one head chunk
    is asked for at these shapes, else the module's own."""
    if _plain_reason(module, args, kwargs) is not None:
        return original(*args, **kwargs)
    x = args[0] if args else kwargs["hidden_states"]
    state = active()
    sharding, shards = state.sharding, state.shards
    d, heads = module.head_dim, module.q_proj.out_features // module.head_dim
    kv_heads = module.k_proj.out_features // d
    size = shards.sp_size
    full_len = size * shards.local_len if size > 1 else shards.cp.seq_len  # as `sequence_parallel_attention`
    chunks = resolve_chunks(sharding.head_chunks, heads, kv_heads, size, full_len, x.shape[0], d, x.element_size())
    if chunks == 1 or (size == 1 and shards.cp.size == 1):
        return original(*args, **kwargs)
    causal = getattr(module, "is_causal", True)
    attend = whole_sequence_attend(shards, sharding.cp_group, sharding.strategy, causal, d, module.scaling,
                                   state.visibility(None))
    spec = _Spec(d, heads, kv_heads, chunks, size, sharding.sp_group if size > 1 else None,
                 getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb"), attend, causal, module.scaling)
    cos, sin = kwargs["position_embeddings"]
    q, k, v, o = (getattr(module, p) for p in PROJECTIONS)
    module._ndparallel_chunked_block_calls += 1  # a host-side count: no tensor read
    out = ChunkedBlock.apply(x, cos, sin, q.weight, k.weight, v.weight, o.weight, q.bias, k.bias, v.bias, o.bias,
                             spec)
    return out, None


def install(model: nn.Module) -> int:
    """Run every supported attention module of `model` (`SUPPORTED`, with plain ``nn.Linear`` projections) through
    `_forward`; the number of modules changed."""
    count = 0
    for module in model.modules():
        if type(module).__name__ not in SUPPORTED or getattr(module, "_ndparallel_chunked_block", False):
            continue
        if not all(type(getattr(module, p, None)) is nn.Linear for p in PROJECTIONS):
            continue
        module.forward = functools.partial(_forward, module, module.forward)
        module._ndparallel_chunked_block = True
        module._ndparallel_chunked_block_calls = 0
        count += 1
    return count


def chunked_calls(model: nn.Module) -> int:
    """The forwards of `model`'s `install`ed attention modules that ran through `ChunkedBlock` (not the module's own
    forward) since they were installed; 0 where none is installed (tests read it)."""
    return sum(getattr(m, "_ndparallel_chunked_block_calls", 0) for m in model.modules())


def _sp_chunk(heads: int, kv_heads: int, sp_size: int, chunks: int, full_len: int, local_len: int, batch: int,
              head_dim: int, element_size: int) -> tuple[int, int, bool]:
    """Under sp: one chunk's query (or output) bytes on one rank (its ``heads / (sp * chunks)`` full-sequence heads,
    as many bytes as its ``heads / chunks`` sequence-sharded ones), a key (or value) tensor's (repeated for the
    chunk, `ulysses.chunk_bytes`' count), and whether `communication.heads_from_parts` / ``parts_from_heads`` copy a
    chunk's query or output (all but one batch element of one head per rank: their reshapes are views)."""
    per_head = batch * full_len * head_dim * element_size
    q = heads // (sp_size * chunks)
    kv = kv_heads * kv_repeats(heads, kv_heads, sp_size * chunks) // (sp_size * chunks)
    return q * per_head, kv * per_head, batch * q > 1


def forward_bytes(heads: int, kv_heads: int, sp_size: int, chunks: int, full_len: int, local_len: int, batch: int,
                  head_dim: int, element_size: int) -> int:
    """Bytes `ChunkedBlock.forward` allocates at its peak on one rank, in the attention: the shard's q/k/v (the
    key/value heads as projected; rotary in place) and its attention output (``batch x local_len x head_dim`` per
    head), and of one chunk
    - under sp, as the chunk's output leaves (`ulysses._leave`): its full-sequence q/k/v and output
      (`ulysses.chunk_bytes`) and the output's all-to-all receive buffer, with the copy the all-to-all sends where
      ``parts_from_heads`` makes one (more than one batch element or head per rank). The buffers sent for q/k/v are
      the block's to let go when their all-to-alls return (``_arrive``): counted so; gloo's worker thread may release
      one late, so a reading can come out one such buffer high (tests: the least reading exact), and how long NCCL's
      work objects hold one on a GPU is not measured here. Exact with sp alone (plain attention,
      tests/parallel/sequence/test_chunked_block.py); with cp x sp the strategy's buffers, the caller's to add, are
      counted at the same time as the output's two: an upper bound;
    - under cp alone (`sp_size` 1): the one copy `ulysses._send` makes of its q/k/v (``_arrive`` hands it on, nothing
      is exchanged), ``local_len`` long; its output is the attention's result, made after the attention's own peak
      (the strategy's buffers, the caller's to add: `allgather.forward_bytes`, `ring.forward_bytes`). Exact against
      the bytes the block allocates with either strategy (tests/planner/test_planner_context_parallel.py,
      test_planner_ring.py).
    Not counted: rotary's temporaries before the attention (one key/value head's query heads at a time). The module's
    own forward holds as much, and a second q and k for rotary."""
    shard = batch * local_len * head_dim * element_size * (2 * heads + 2 * kv_heads)
    if sp_size == 1:
        kv = kv_heads * kv_repeats(heads, kv_heads, chunks)  # key/value heads as `chunk_plan` spreads them
        return shard + (heads // chunks + 2 * (kv // chunks)) * batch * local_len * head_dim * element_size
    q, _, copies = _sp_chunk(heads, kv_heads, sp_size, chunks, full_len, local_len, batch, head_dim, element_size)
    chunk = chunk_bytes(heads, kv_heads, sp_size, chunks, full_len, batch, head_dim, element_size)
    return shard + chunk + q * (1 + copies)


def backward_bytes(heads: int, kv_heads: int, sp_size: int, chunks: int, full_len: int, local_len: int, batch: int,
                   head_dim: int, hidden: int, element_size: int) -> int:
    """Bytes `ChunkedBlock.backward` allocates on one rank beyond its saved tensors, the incoming gradient and the
    weights' gradients: the hidden states' gradient (``batch x local_len x hidden``), and of one chunk
    - under sp, on the chunk that holds the most: its q and k projected again (the distinct key/value heads it sends,
      ``local_len`` long; its value projection is let go once sent), rotary's new q and k, the rows of q_proj's weight
      it takes (one copy: a span per sp rank) and k_proj's and v_proj's (a copy where their heads are not one span),
      its full-sequence q/k/v and output, and
      the larger of (a) at the attention's backward, the output's gradient and the q/k/v gradients it returns, and
      (b) as the output's gradient arrives (``_arrive``), its sequence-sharded gradient, the buffer sent and the one
      received, and their reshaped copy where ``heads_from_parts`` makes one (more than one batch element or head
      per rank); the attention's log-sum-exp is the caller's to add. Exact with sp alone against the bytes the block
      allocates (tests/parallel/sequence/test_chunked_block.py; gloo may release a buffer it sent late: the least
      reading); with cp x sp the strategy's buffers, the caller's to add, count the key/value gradients again:
      an upper bound. Not counted: biases' rows (``heads / chunks x head_dim`` elements), rotary's temporaries in its
      backward (one chunk's heads; below this peak in the tests);
    - under cp alone (`sp_size` 1), at the attention's backward (its own buffers and log-sum-exp the caller's to add:
      `allgather.backward_bytes`, `ring.backward_bytes`): its q and k projected again (the value projection let go
      once sent), rotary's new q and k, `_send`'s copies of the three that the attention takes, its output and the
      output's gradient, and the query's gradient the attention returns -- 6 query-head and 4 key/value-head tensors
      of ``local_len`` tokens (key/value heads as `ulysses.chunk_plan` spreads them). Exact, on the busiest rank,
      against the bytes the block allocates with either strategy (tests/planner/test_planner_context_parallel.py,
      test_planner_ring.py)."""
    grad = batch * local_len * hidden * element_size
    if sp_size == 1:
        kv = kv_heads * kv_repeats(heads, kv_heads, chunks)
        return grad + (6 * (heads // chunks) + 4 * (kv // chunks)) * batch * local_len * head_dim * element_size
    q, kv, copies = _sp_chunk(heads, kv_heads, sp_size, chunks, full_len, local_len, batch, head_dim, element_size)
    head, row = batch * local_len * head_dim * element_size, head_dim * hidden * element_size
    most = 0
    for runs in chunk_plan(heads, kv_heads, sp_size, chunks):
        kv_spans = _local(runs[1])[0]
        distinct = sum(n for _, n in kv_spans)  # the chunk's key heads as projected again
        weights = heads // chunks * row + (2 * distinct * row if len(kv_spans) > 1 else 0)
        most = max(most, 2 * q + 2 * distinct * head + weights)  # projected q and k, rotary's q and k
    held = 2 * q + 2 * kv  # the full-sequence q/k/v and output
    return grad + most + held + max(q + q + 2 * kv, q * (3 + copies))
