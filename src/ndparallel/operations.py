"""The Accelerator's collectives for metrics and logging, on nested structures of tensors: gather along the
``batch`` view and reduce over the ``loss`` view (Accelerate's `accelerate.utils.operations`). Each takes the mesh
and the name of the view, and does nothing on a view of one rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .mesh import ParallelMesh

REDUCTIONS = ("sum", "mean", "none")


def map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    raise TypeError(f"can only gather/reduce tensors and dicts/lists/tuples of tensors, got {type(obj).__name__}")


def gather_tensor(tensor: torch.Tensor, mesh: ParallelMesh, view: str) -> torch.Tensor:
    """Concatenate every view rank's `tensor` along dim 0, in view order; sizes along dim 0 may differ."""
    if mesh.size(view) == 1:
        return tensor if tensor.dim() else tensor.unsqueeze(0)
    group = mesh.group(view)
    tensor = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
    n = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(mesh.size(view))]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    parts = [torch.empty_like(tensor) for _ in sizes]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def gather(obj: Any, mesh: ParallelMesh, view: str) -> Any:
    return map_tensors(obj, lambda t: gather_tensor(t, mesh, view))


def gather_object(obj: Any, mesh: ParallelMesh, view: str) -> list[Any]:
    """Every view rank's picklable `obj`, in view order."""
    if mesh.size(view) == 1:
        return [obj]
    parts: list[Any] = [None] * mesh.size(view)
    dist.all_gather_object(parts, obj, group=mesh.group(view))
    return parts


def reduce(obj: Any, mesh: ParallelMesh, view: str, reduction: str = "sum", scale: float = 1.0) -> Any:
    """All-reduce every tensor of `obj` over `view`; returns new tensors.

    "sum" adds, "mean" averages (integers become floats); "none" sums too, as Accelerate's `reduce` does.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if not out.is_floating_point() and reduction == "mean":
            out = out.float()
        if mesh.size(view) > 1:
            dist.all_reduce(out, group=mesh.group(view))
        if reduction == "mean":
            out /= mesh.size(view)
        return out * scale if scale != 1.0 else out

    return map_tensors(obj, one)
