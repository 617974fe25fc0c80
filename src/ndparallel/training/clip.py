"""Gradient-norm clipping over parameters that may be DTensors on different meshes, or plain tensors.

The total norm is (sum over all parameters of sum |g|^p)^(1/p). Each rank can compute its own part of the sum
for the shards it holds; those parts must be added over exactly the mesh dimensions along which a gradient is
*sharded*, and not over the dimensions along which it is replicated (that would count it twice). So gradients
are grouped by (mesh, sharded dimensions), each group's partial sum is all-reduced over those dimensions only,
and the groups' results are added. Plain tensors are the same on every rank (DDP reduced them) and need no
reduction. Every rank sees the parameters in the same order, so the collectives match across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _local_and_key(grad: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    if not isinstance(grad, DTensor):
        return grad, (None, ())
    if any(isinstance(p, Partial) for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements])
    # Anything neither replicated nor partial splits the tensor: Shard, and also the _StridedShard FSDP2 puts
    # on a dimension tensor parallelism already split (which is not a Shard subclass in recent torch).
    sharded = tuple(i for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial()))
    return grad.to_local(), (grad.device_mesh, sharded)


@torch.no_grad()
def total_grad_norm(grads: list[torch.Tensor], norm_type: float,
                    across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The total norm of `grads`; with `across` (pipeline stages, which hold different parameters), the parts of
    every rank of that group add up too. A rank may hold no gradients (its part is then 0). `norm_type` 0 is
    torch's (`torch.nn.utils.get_total_norm`): the number of gradients with a nonzero element."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local, key = _local_and_key(g)
        groups.setdefault(key, []).append(local)
    if norm_type == 0:
        return _nonzero_gradients(groups, across, grads[0].device if grads else torch.device("cpu"))
    inf = math.isinf(norm_type)
    parts = []
    for (mesh, sharded), locals_ in groups.items():
        # One multi-tensor norm per group (one kernel launch on a GPU, as torch's own clipping). Half-precision
        # gradients are normed in fp32; fp32 and fp64 keep their own precision. A rank may hold an empty shard: its
        # part is 0 (the inf norm of an empty tensor is undefined, so it is left out).
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in locals_) else torch.float32
        nonempty = [t for t in locals_ if t.numel()]
        if nonempty:
            norms = torch.stack(torch._foreach_norm(nonempty, norm_type, dtype=dtype))
            part = norms.max() if inf else (norms ** norm_type).sum()
        else:
            part = torch.zeros((), dtype=dtype, device=locals_[0].device)
        for dim in sharded:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(dim))
        parts.append(part)
    if not parts:
        parts = [torch.zeros((), device=grads[0].device if grads else "cpu")]
    device, dtype = parts[0].device, max((p.dtype for p in parts), key=lambda d: torch.finfo(d).bits)
    if len(parts) == 1:
        total = parts[0]
    else:
        stacked = torch.stack([p.to(device, dtype) for p in parts])
        total = stacked.max() if inf else stacked.sum()
    if across is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=across)
    return total if inf else total ** (1.0 / norm_type)


def _nonzero_gradients(groups: dict[tuple, list[torch.Tensor]], across: dist.ProcessGroup | None,
                       device: torch.device) -> torch.Tensor:
    """The 0-"norm" of `total_grad_norm`: how many gradients have a nonzero element. Each gradient's count of nonzero
    elements is added over the dimensions it is sharded along before it is tested, so a shard of zeros does not
    hide its peers' nonzero elements."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, sharded), locals_ in groups.items():
        counts = torch.stack([torch.count_nonzero(t).to(torch.float32) for t in locals_])
        for dim in sharded:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + (counts > 0).sum().to(total.device, total.dtype)
    if across is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=across)
    return total


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, across: dist.ProcessGroup | None = None,
                    counted_elsewhere: set[int] | None = None) -> torch.Tensor:
    """Scale gradients in place so their total `norm_type` norm is at most `max_norm`; return the total norm.
    `across`: a group whose ranks hold other parameters of the same model (pipeline stages; `total_grad_norm`);
    `counted_elsewhere`: ids of parameters whose gradient another rank of `across` counts (a tied weight's second
    copy): scaled, not counted."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not grads and across is None:
        return torch.tensor(0.0)
    counted = [p.grad for p in parameters if id(p) not in (counted_elsewhere or ())]
    norm = total_grad_norm(counted, float(norm_type), across)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # One multi-tensor multiply per device and dtype (torch's own clipping does the same).
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), locals_ in by_kind.items():
        torch._foreach_mul_(locals_, coef.to(device, dtype))
    return norm
