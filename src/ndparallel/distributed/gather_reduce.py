"""The Accelerator's collectives for metrics and logging, on nested structures of tensors: gather along the
``batch`` view and reduce over the ``loss`` view (Accelerate's `accelerate.utils.operations`). Each takes the mesh
and the name of the view, and does nothing on a view of one rank. `pad_across_processes` works over every process,
as Accelerate's does.

Debug mode (Accelerate's ``state.debug = True``, or ``$ACCELERATE_DEBUG_MODE`` / ``$NDPARALLEL_DEBUG_MODE`` when the
process state starts): before each collective here, the processes exchange the shapes of the tensors they pass, and
when those cannot go through it together (a gather or reduce of other shapes, a pad of tensors of other ranks -- a
collective that would hang or fail), every process raises the same `DistributedOperationException`, naming each
process's shapes. It costs one object all-gather per call, so it is off by default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .mesh import ParallelMesh
from .state import PartialState

REDUCTIONS = ("sum", "mean", "none", "max")


def map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    raise TypeError(f"can only gather/reduce tensors and dicts/lists/tuples of tensors, got {type(obj).__name__}")


class DistributedOperationException(Exception):
    """Raised in debug mode on every process when the tensors of a collective do not match across processes."""


def check_shapes(obj: Any, operation: str, group: dist.ProcessGroup | None = None, *, except_dim: int | None = None,
                 rank_only: bool = False) -> None:
    """Debug mode (`PartialState.debug`): every process of `group` (None: all) passes tensors of the same shapes to
    `operation` -- but along `except_dim` (a gather along it), or in their number of dimensions only (`rank_only`:
    a pad) -- else the same `DistributedOperationException` everywhere. Collective; nothing when debug is off."""
    if not PartialState._shared.get("debug") or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return

    def shape(t: torch.Tensor) -> Any:
        if rank_only:
            return t.dim()
        dims = list(t.shape)
        if except_dim is not None and dims:
            dims[except_dim % len(dims)] = "*"
        return tuple(dims)

    mine = map_tensors(obj, shape)
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    if any(f != found[0] for f in found):
        listing = "\n  - ".join(f"process {i}: {f}" for i, f in enumerate(found))
        what = "numbers of dimensions" if rank_only else "shapes" + (" (* : sizes that may differ)" if except_dim
                                                                      is not None else "")
        raise DistributedOperationException(
            f"cannot run {operation}: the processes passed tensors of other {what}, which it cannot combine (the "
            f"collective would fail or hang):\n  - {listing}")


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
    if mesh.size(view) > 1:
        check_shapes(obj, "gather", mesh.group(view), except_dim=0)
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

    "sum" adds, "mean" averages (integers become floats); "none" sums too, as Accelerate's `reduce` does; "max"
    takes the elementwise largest.
    """
    if mesh.size(view) > 1:
        check_shapes(obj, "reduce", mesh.group(view))
    return _all_reduce(obj, mesh.group(view) if mesh.size(view) > 1 else None, mesh.size(view), reduction, scale)


def _all_reduce(obj: Any, group: dist.ProcessGroup | None, size: int, reduction: str, scale: float) -> Any:
    """`reduce` over `group` of `size` ranks (None with size > 1: every process)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if not out.is_floating_point() and reduction == "mean":
            out = out.float()
        if size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM, group=group)
        if reduction == "mean":
            out /= size
        return out * scale if scale != 1.0 else out

    return map_tensors(obj, one)


def pad_across_processes(obj: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad every tensor of `obj` along `dim` to the largest size any process has there (over every process), with
    `pad_index`, at the end (or the start with `pad_first`), so that tensors of uneven length can be gathered."""
    check_shapes(obj, "pad_across_processes", rank_only=True)

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or not dist.is_initialized() or dist.get_world_size() == 1:
            return t
        d = dim % t.dim()
        size = torch.tensor([t.shape[d]], device=t.device, dtype=torch.long)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest - t.shape[d]
        pad = t.new_full(shape, pad_index)
        return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

    return map_tensors(obj, one)


# ---- over every process (Accelerate's `accelerate.utils` functions) -------------------------------------------------
def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def gather_all(obj: Any) -> Any:
    """Concatenate every process's tensors (or dicts/lists of them) along dim 0, in rank order."""
    if _world_size() == 1:
        return map_tensors(obj, lambda t: t if t.dim() else t.unsqueeze(0))
    check_shapes(obj, "gather")

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous() if t.dim() else t.reshape(1)
        parts = [torch.empty_like(t) for _ in range(_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    return map_tensors(obj, one)


def gather_object_all(obj: Any) -> list[Any]:
    """Every process's picklable `obj`, in rank order (lists are concatenated, as Accelerate's `gather_object`)."""
    parts: list[Any] = [obj]
    if _world_size() > 1:
        parts = [None] * _world_size()
        dist.all_gather_object(parts, obj)
    return [x for part in parts for x in (part if isinstance(part, list) else [part])]


def reduce_all(obj: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """All-reduce every tensor of `obj` over every process ("mean", "sum", "none", which sums, or "max")."""
    check_shapes(obj, "reduce")
    return _all_reduce(obj, None, _world_size(), reduction, scale)


def broadcast(obj: Any, from_process: int = 0) -> Any:
    """Every tensor of `obj` replaced, in place, by process `from_process`'s."""
    if _world_size() > 1:
        check_shapes(obj, "broadcast")
        map_tensors(obj, lambda t: dist.broadcast(t, src=from_process) or t)
    return obj


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """`object_list` replaced, in place, by process `from_process`'s (picklable objects)."""
    if _world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list
