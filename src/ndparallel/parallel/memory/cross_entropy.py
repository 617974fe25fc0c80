"""The LM head and its cross-entropy over chunks of tokens: at most one chunk's logits exist at a time.

``linear_cross_entropy(hidden, weight, bias, labels, ...)`` computes what ``ForCausalLMLoss(hidden @ weight.T + bias,
...)`` -- transformers' causal-LM loss -- computes, with the same meaning of ``labels`` / ``shift_labels``,
``num_items_in_batch`` and ``ignore_index``, without the ``tokens x vocabulary`` logits: the tokens are taken
``chunk`` rows at a time through the head, an fp32 log-sum-exp and the loss. The gradient is computed in the same
pass (as Liger's fused linear cross-entropy does): for each chunk, softmax minus one-hot, scaled by 1 / denominator,
then the two matrix multiplies that backward would run -- the gradient of the hidden states and the chunk's share of
the head's gradient (summed over chunks in fp32). Backward then only scales them by the incoming gradient. So the
head costs the three matrix multiplies the unchunked loss costs, on every row as the unchunked logits are, and what
lives at once is one chunk's logits in fp32 and their gradient, plus the head's gradient and the hidden states'.

How many chunks (`chunk_rows`): as many as the memory needs, no more -- the fewest equal chunks whose fp32 logits fit
in `CHUNK_BYTES` (128 MiB), so one chunk, one matrix multiply, wherever all the logits fit (1,024 tokens of a
32,000-token vocabulary: 1 chunk; 4,096: 4; 32,768 of 128,256: 126). Nothing is read on the host (on a GPU the host would wait
for the device's queue to drain): the chunks come from shapes, the tokens whose label does not count
(``ignore_index``) get a scale of 0 by ``where``, and a label's column is found by index arithmetic; a counted label
outside the vocabulary stops the step as the unchunked loss does, by an assertion on the device.

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
# Auto chunk size: as few equal chunks as keep each chunk's fp32 logits within CHUNK_BYTES (one where they all fit).
CHUNK_BYTES = 128 * 2**20


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
    """Rows per chunk: `requested`, else as few equal chunks as keep each chunk's fp32 logits within `CHUNK_BYTES` --
    one chunk (one matrix multiply, as the unchunked loss) when all the logits fit."""
    if requested is not None:
        return max(1, int(requested))
    return even_chunk_rows(tokens, CHUNK_BYTES // (4 * max(1, vocab_local)))  # the most rows whose fp32 logits fit


def even_chunk_rows(rows: int, fit: int) -> int:
    """Rows per chunk when `rows` are spread evenly over the fewest chunks of at most `fit` rows (at least 1) each."""
    chunks = max(1, math.ceil(rows / max(1, fit)))
    return max(1, math.ceil(rows / chunks))


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
                                                 chunk, group, vocab_start, vocab, dtype, ctx.needs_input_grad[:3])
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
        # A 0-dim factor keeps each gradient's dtype (the product is computed in fp32 and rounded once).
        out = [None if g is None else g * grad_loss for g in ctx.saved_tensors]
        return (*out, None, None, None, None, None, None, None, None)


def _forward_and_gradients(hidden, weight, bias, labels, ignore_index, denominator, transforms, chunk, group,
                           vocab_start, vocab, dtype, needs):
    # Nothing here reads a tensor's value on the host (a GPU would stall until its queue drained): the chunks come
    # from shapes, every row goes through the head (as the unchunked loss's logits hold every row), and the rows
    # whose label does not count get a scale of 0 in the loss and the gradient.
    shape = hidden.shape
    h = hidden.reshape(-1, shape[-1])
    y = labels.reshape(-1).to(h.device)
    valid = y != ignore_index
    # A counted label outside the vocabulary fails as the unchunked loss fails (on a GPU: asynchronously, no sync).
    low_high = torch.where(valid, y, 0).aminmax()
    torch._assert_async((low_high.min >= 0) & (low_high.max < vocab),
                        f"chunked loss: a label is outside the vocabulary [0, {vocab}) (and not ignore_index "
                        f"{ignore_index})")
    if denominator is None:
        denominator = valid.sum()  # the mean over counted tokens (0: NaN, as the unchunked loss)
    denominator = torch.as_tensor(denominator, device=h.device).to(torch.float32)
    # Each row's share of the gradient: 1 / denominator where its label counts, else 0 (also with no counted token).
    row_scale = torch.where(valid, denominator.reciprocal(), 0.0)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    vocab_local, rows = w.shape[0], y.numel()
    need_h, need_w, need_b = needs
    step = chunk_rows(rows, vocab_local, chunk)
    single = step >= rows
    # One chunk: the hidden states' gradient is its product; more: each chunk's product written into its rows.
    grad_h = None if single or not need_h else torch.empty(h.shape, dtype=dtype, device=h.device)
    target = y if vocab_start == 0 else y - vocab_start
    total = grad_w = grad_b = None
    for start in range(0, rows, step):
        end = min(start + step, rows)
        def part(t: torch.Tensor) -> torch.Tensor:
            return t if single else t[start:end]

        h_c = part(h).to(dtype)
        loss_c, grad_x = _chunk(h_c, w, b, part(target), part(valid), part(row_scale), transforms, group,
                                vocab_local)
        total = loss_c if total is None else total + loss_c
        if need_h:
            if single:
                grad_h = grad_x @ w
            else:
                torch.mm(grad_x, w, out=grad_h[start:end])
        if need_w:
            # Summed over chunks in fp32 (in place when the head computes in fp32); one chunk's is its product.
            if grad_w is None:
                grad_w = grad_x.t() @ h_c
                if not single:
                    grad_w = grad_w.float()
            elif grad_x.dtype == torch.float32:
                grad_w.addmm_(grad_x.t(), h_c)
            else:
                grad_w += grad_x.t() @ h_c
        if need_b and b is not None:
            summed = grad_x.sum(0, dtype=torch.float32)
            grad_b = summed if grad_b is None else grad_b + summed
        del grad_x, h_c  # before the next chunk's logits: one chunk at a time
    if total is None:  # no rows at all
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=dtype, device=h.device) if need_w else None
        grad_b = torch.zeros(vocab_local, dtype=torch.float32, device=h.device) if need_b and b is not None else None
    loss = total / denominator  # as the unchunked loss divides
    grads = (grad_h.reshape(shape).to(hidden.dtype) if grad_h is not None else None,
             grad_w.to(weight.dtype) if grad_w is not None else None,
             grad_b.to(bias.dtype) if grad_b is not None else None)
    return loss, grads


def _chunk(h_c, w, b, target, valid, row_scale, transforms, group, vocab_local):
    """One chunk: (the sum of its counted tokens' losses, the gradient of its logits (compute dtype), each row's
    scaled by `row_scale`, 0 where the label does not count). `target`: the labels less this rank's first vocabulary
    row. Index arithmetic, no selection: the label's column is `target` clamped into this rank's rows, and under a
    split vocabulary (`group`) a row whose label another rank holds takes nothing from it (`owned`)."""
    x = F.linear(h_c, w, b)
    dtype = x.dtype
    if transforms:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            z = x
            for transform in transforms:
                z = transform(z)
            zf = z.float()
    else:
        zf = x.float()  # x itself in fp32
        x = None  # the compute-dtype logits are not needed again: one copy of them at a time
    column = target.clamp(0, vocab_local - 1).unsqueeze(1)
    owned = None if group is None else target == column.squeeze(1)
    with torch.no_grad():
        m = zf.amax(dim=1)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z_t = zf.gather(1, column).squeeze(1)
        # The softmax is built in place where nothing else needs the logits (no transform to differentiate).
        p = zf.detach().clone() if transforms else zf
        p.sub_(m.unsqueeze(1)).exp_()
        s = p.sum(dim=1)
        if group is not None:  # the sum of exponentials and the label's logit, over the ranks' vocabulary rows
            sums = torch.stack([s, z_t * owned])
            dist.all_reduce(sums, group=group)
            s, z_t = sums[0], sums[1]
        loss = torch.where(valid, m + torch.log(s) - z_t, 0.0).sum()
        # (softmax - one-hot of the label) x the row's scale: the softmax scaled in place, then -scale at the label.
        p.mul_((row_scale / s).unsqueeze(1))
        p.scatter_add_(1, column, (row_scale.neg() if owned is None else row_scale.neg() * owned).unsqueeze(1))
    if transforms:
        grad_x, = torch.autograd.grad(zf, x, grad_outputs=p)
    else:
        grad_x = p.to(dtype) if p.dtype != dtype else p
    return loss, grad_x
