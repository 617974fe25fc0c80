"""The LM head and its cross-entropy over chunks of tokens: at most one chunk's logits exist at a time.

``linear_cross_entropy(hidden, weight, bias, labels, ...)`` computes what ``ForCausalLMLoss(hidden @ weight.T + bias,
...)`` -- transformers' causal-LM loss -- computes, with the same meaning of ``labels`` / ``shift_labels``,
``num_items_in_batch`` and ``ignore_index``, without the ``tokens x vocabulary`` logits: the tokens whose label counts
are gathered, then taken ``chunk`` rows at a time through the head, an fp32 log-sum-exp and the loss. The gradient is
computed in the same pass (as Liger's fused linear cross-entropy does): for each chunk, softmax minus one-hot, scaled
by 1 / denominator, then the two matrix multiplies that backward would run -- the gradient of the hidden states and
the chunk's share of the head's gradient, summed over chunks in fp32. Backward then only scales them by the incoming
gradient. So the head costs the three matrix multiplies the unchunked loss costs, and what lives at once is one
chunk's logits (compute dtype), their fp32 copy and their gradient, plus the head's gradient and the hidden states'.

The arithmetic follows the unchunked loss: the logits in the compute dtype (autocast's when it is on), then the
family's transform of them in that dtype (`Transform`: Gemma's soft-capping, a scale), then fp32; loss_i = lse_i -
z_i[label]; the gradient of the logits in fp32, cast to the compute dtype for the matrix multiplies. In fp32 the
gradients equal the unchunked ones to rounding (tests: 1e-6).

Vocabulary-parallel heads (tensor parallelism splits the head's rows over ``tp``: a DTensor weight ``Shard(0)``):
each tp rank computes its slice of every chunk's logits; the maximum, the sum of exponentials and the label's logit
are all-reduced over tp (one MAX, one SUM per chunk), so every rank gets the whole log-sum-exp; each rank's gradient
of the hidden states is its slice's partial sum (handed to DTensor as ``Partial``, which sums it over tp where the
layout needs it) and its head gradient is its own rows'. Every tp rank holds the same tokens and labels, so they run
the same chunks and meet in the same collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE_INDEX = -100
# Auto chunk size: at least MIN_CHUNKS chunks, at most CHUNK_BYTES of fp32 logits per chunk, never under MIN_ROWS rows.
MIN_CHUNKS = 16
CHUNK_BYTES = 256 * 2**20
MIN_ROWS = 64


@dataclass(frozen=True)
class Transform:
    """One elementwise step a model applies to its logits between the head and the loss: ``"mul"`` / ``"div"`` by
    `value`, ``"tanh"``, or ``"float"`` (an upcast)."""

    op: str
    value: float | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "mul":
            return x * self.value
        if self.op == "div":
            return x / self.value
        if self.op == "tanh":
            return torch.tanh(x)
        if self.op == "float":
            return x.float()
        raise AssertionError(self.op)


def softcap(cap: float) -> tuple[Transform, ...]:
    """Gemma's final soft-capping, ``tanh(x / cap) * cap``, as its forward writes it."""
    return (Transform("div", cap), Transform("tanh"), Transform("mul", cap))


def chunk_rows(tokens: int, vocab_local: int, requested: int | None = None) -> int:
    """Rows per chunk: `requested`, else at least `MIN_CHUNKS` chunks of at most `CHUNK_BYTES` fp32 logits, and not
    fewer than `MIN_ROWS` rows."""
    if requested is not None:
        return max(1, int(requested))
    by_bytes = max(1, CHUNK_BYTES // (4 * max(1, vocab_local)))
    return max(MIN_ROWS, min(math.ceil(tokens / MIN_CHUNKS), by_bytes))


def aligned_labels(labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The label of every position, as ``ForCausalLMLoss`` aligns them: `shift_labels` as given, else `labels`
    shifted left by one with `ignore_index` at the end."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _vocab_split(weight: torch.Tensor) -> tuple[Any, int, int]:
    """(the tp process group or None, this rank's first vocabulary row, the vocabulary size) of a head weight."""
    if not isinstance(weight, DTensor):
        return None, 0, weight.shape[0]
    placements = weight.placements
    if any(not isinstance(p, (Replicate, Shard)) for p in placements) or any(
            isinstance(p, Shard) and p.dim != 0 for p in placements) or sum(isinstance(p, Shard) for p in placements) > 1:
        raise ValueError(f"chunked loss: the LM head's weight is laid out as {placements}; it takes a whole head or "
                         "one split along the vocabulary (Shard(0))")
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            mesh = weight.device_mesh
            rows = math.ceil(weight.shape[0] / mesh.size(dim))
            return mesh.get_group(dim), mesh.get_local_rank(dim) * rows, weight.shape[0]
    return None, 0, weight.shape[0]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX, num_items_in_batch: Any = None,
                         transforms: Sequence[Transform] = (), chunk: int | None = None) -> torch.Tensor:
    """``ForCausalLMLoss(F.linear(hidden, weight, bias), ...)`` computed in chunks (module docstring).

    `labels` are aligned with the positions (`aligned_labels`). `hidden` is ``(..., h)``, or a DTensor replicated
    over the mesh of a vocabulary-split `weight`. Returns this rank's loss: the sum of its tokens' losses over
    `num_items_in_batch` when given, else their mean (NaN without tokens, as the unchunked loss).
    """
    group, vocab_start, vocab = _vocab_split(weight)
    if isinstance(weight, DTensor):
        split = group is not None
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                        run_check=False)
        # The gradient of the hidden states is each rank's partial sum over its vocabulary rows: Partial.
        grad_placements = [Partial() if split else Replicate()] * hidden.device_mesh.ndim
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local(
            grad_placements=grad_placements)
        weight = weight.to_local()
        bias = bias.to_local() if isinstance(bias, DTensor) else bias
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    denominator = num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, denominator, tuple(transforms),
                                     chunk, group, vocab_start, vocab)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the unchunked head computes its logits in: autocast's where it is on, else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, denominator, transforms, chunk, group, vocab_start,
                vocab):
        dtype = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grads = _forward_and_gradients(hidden, weight, bias, labels, ignore_index, denominator, transforms,
                                                 chunk, group, vocab_start, dtype, ctx.needs_input_grad[:3])
        # Saved as tensors of the graph: autograd frees them once this node has run, unless the graph is retained
        # (a zero-bubble pipeline schedule runs the backward twice, for the inputs' then the weights' gradients).
        # Marked, so that measurements of saved activations can tell them apart (the planner counts them as the
        # head's gradient and the loss's working set, not as activations).
        for g in grads:
            if g is not None:
                g._ndparallel_loss_gradient = True
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        out = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*out, None, None, None, None, None, None, None, None)


def _forward_and_gradients(hidden, weight, bias, labels, ignore_index, denominator, transforms, chunk, group,
                           vocab_start, dtype, needs):
    shape = hidden.shape
    h = hidden.reshape(-1, shape[-1])
    y = labels.reshape(-1).to(h.device)
    valid = y != ignore_index
    count = int(valid.sum())
    # Only the counted tokens go through the head: all of them as row ranges (no copy), else gathered.
    rows = None if count == y.numel() else valid.nonzero().squeeze(1)
    if denominator is None:
        denominator = torch.tensor(float(count), device=h.device)  # the mean over counted tokens (0: NaN)
    scale = 1.0 / torch.as_tensor(denominator, dtype=torch.float32, device=h.device)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    vocab_local = w.shape[0]
    need_h, need_w, need_b = needs
    grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
    # The head's gradient sums over chunks: in fp32 (in place when the head computes in fp32).
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_w else None
    grad_b = torch.zeros(vocab_local, dtype=torch.float32, device=h.device) if need_b and b is not None else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    step = chunk_rows(count, vocab_local, chunk)
    for start in range(0, count, step):
        end = min(start + step, count)
        idx = rows[start:end] if rows is not None else None
        h_c = (h[start:end] if idx is None else h.index_select(0, idx)).to(dtype)
        target = (y[start:end] if idx is None else y.index_select(0, idx)) - vocab_start
        loss_c, grad_x = _chunk(h_c, w, b, target, transforms, group, scale, vocab_local)
        total += loss_c
        if grad_h is not None:
            if idx is None:
                torch.mm(grad_x, w, out=grad_h[start:end])
            else:
                grad_h.index_copy_(0, idx, grad_x @ w)
        if grad_w is not None:
            if grad_x.dtype == torch.float32:
                grad_w.addmm_(grad_x.t(), h_c)
            else:
                grad_w += grad_x.t() @ h_c
        if grad_b is not None:
            grad_b += grad_x.sum(0, dtype=torch.float32)
        del grad_x, h_c  # before the next chunk's logits: one chunk at a time
    loss = total / torch.as_tensor(denominator, device=h.device)  # as the unchunked loss divides
    grads = (grad_h.reshape(shape).to(hidden.dtype) if grad_h is not None else None,
             grad_w.to(weight.dtype) if grad_w is not None else None,
             grad_b.to(bias.dtype) if grad_b is not None else None)
    return loss, grads


def _chunk(h_c, w, b, target, transforms, group, scale, vocab_local):
    """One chunk: (the sum of its token losses, the gradient of its logits (compute dtype) scaled by `scale`)."""
    x = F.linear(h_c, w, b)
    if transforms:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            z = x
            for transform in transforms:
                z = transform(z)
            zf = z.float()
    else:
        zf = x.float()  # x itself in fp32
    owned = (target >= 0) & (target < vocab_local)
    local_target = torch.where(owned, target, torch.zeros_like(target))
    with torch.no_grad():
        m = zf.amax(dim=1)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z_t = zf.gather(1, local_target.unsqueeze(1)).squeeze(1) * owned
        # The softmax is built in place where nothing else needs the logits (no transform to differentiate).
        p = zf.detach().clone() if transforms else zf
        p.sub_(m.unsqueeze(1)).exp_()
        sums = torch.stack([p.sum(dim=1), z_t])
        if group is not None:
            dist.all_reduce(sums, group=group)
        s, z_t = sums[0], sums[1]
        loss = (m + torch.log(s) - z_t).sum()
        p.div_(s.unsqueeze(1))  # softmax
        hit = owned.nonzero().squeeze(1)
        p[hit, local_target[hit]] -= 1.0
        p.mul_(scale)
    if transforms:
        grad_x, = torch.autograd.grad(zf, x, grad_outputs=p)
    else:
        grad_x = p.to(x.dtype) if p.dtype != x.dtype else p
    return loss, grad_x
