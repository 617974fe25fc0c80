"""The collectives of expert parallelism, over the ``ep`` view: token counts, and tokens with variable splits.

Both are ``all_to_all_single``: rank r's i-th block goes to rank i, which receives it as its r-th block. Tokens move
with the sizes each side knows after the counts' exchange (dropless: every block is as long as its tokens), and the
backward of a move is the reverse move of the gradients, with the splits swapped -- every token's gradient returns to
the rank it came from, exactly (nothing is summed on the way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`counts` (ep, local experts): how many of this rank's tokens go to each expert, by the rank holding it. Returns
    the same table seen from the other side: row q, column j = tokens rank q sends to this rank's j-th expert."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` (one block per rank) exchanged for blocks of `receive` rows; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``x[sum(send[:i]):sum(send[:i+1])]`` to rank i of `group` and receive ``receive[q]`` rows from rank q, in
    rank order (differentiable)."""
    return _AllToAll.apply(x, send, receive, group)
