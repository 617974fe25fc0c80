"""Activation offloading: the inputs of checkpointed blocks go to host memory during forward and come back for backward.

With activation checkpointing, what a block keeps for backward is its input (torch's non-reentrant checkpoint saves
the block's tensor arguments through autograd's saved-tensor hooks and recomputes the rest). Offloading registers
`ActivationOffload`'s pack / unpack as saved-tensor hooks around each checkpointed block's forward -- entered before
the checkpoint's own, so they see exactly those inputs, and never during the recomputation -- and:

- on CUDA, packing copies the tensor into pinned host memory on a side stream (after the compute stream's work on it)
  and lets the device memory go once the copy is done (``record_stream``); unpacking in backward copies it back,
  and starts copying the input of the block backward needs next on another side stream (prefetch), so the copies
  overlap the blocks' recomputation and backward;
- elsewhere (CPU training, where host memory is the memory) nothing moves: packing keeps the tensor and records it,
  so the same tensors go through the same path and tests can see which (``copy=True`` makes it copy and restore
  them, exercising the round trip).

The host copies live in blocks of a `host_pool.HostPool` (pinned on CUDA, ordinary memory with ``copy=True``
elsewhere): one block per tensor of exactly its bytes (aligned), reused step after step, so a step holds the sum of
what it offloads and allocates nothing after the first. A block goes back to the pool once the last copy out of it
has been issued, with that copy's event (CUDA): the next copy into it waits for it on the device.

A tensor packed twice within one forward (the rotary tables every block receives) is offloaded once. Parameters,
DTensors, empty tensors, tensors on another device and (on CUDA) tensors below ``min_bytes`` stay where they are.
Exact: the values restored are those saved.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .host_pool import Block, HostPool

MIN_BYTES = 2**20  # smaller tensors are not worth a copy each way


@dataclass(eq=False)
class _Offloaded:
    host: torch.Tensor | None  # the host copy (pinned on CUDA): a view of `block`, or the tensor itself (no copy)
    device: torch.device
    nbytes: int
    event: Any = None  # CUDA: the device-to-host copy's completion
    previous: weakref.ref | None = None  # packed just before this one: what backward needs next (while autograd
    # holds it: handles are referred to weakly here, so a graph dropped without backward gives its blocks back)
    prefetched: tuple[torch.Tensor, Any] | None = None  # CUDA: (device copy, its completion event)
    unpacks_left: int = 1  # packs sharing this copy (a tensor given to several blocks)
    block: Block | None = None  # the pool's block under `host`
    copies_out: list[Any] = field(default_factory=list)  # CUDA: events of the copies out of the block issued so far
    give_back: Any = None  # returns the block to the pool: at the last unpack, or when autograd drops the handle


@dataclass(eq=False)
class _Kept:
    tensor: torch.Tensor


@dataclass
class OffloadStats:
    tensors: int = 0  # offloaded (distinct) per the counters' lifetime
    bytes: int = 0
    kept: int = 0  # packed but left in place (parameters, small, DTensors)
    restored: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # of the offloaded tensors, in order


class ActivationOffload:
    """The saved-tensor hooks of one model's checkpointed blocks (module docstring)."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES, copy: bool = False) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.min_bytes = min_bytes if self.cuda else 0  # a copy costs nothing where nothing is copied
        self.copy = copy
        self.stats = OffloadStats()
        self._last: weakref.ref | None = None  # to the handle packed last
        self._seen: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}  # id(tensor) -> (tensor, version, handle)
        self.pool = HostPool(pin=self.cuda)  # (unused where nothing is copied)
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- forward -------------------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Offloaded | _Kept:
        if type(tensor) is not torch.Tensor or tensor.device.type != self.device.type or tensor.numel() == 0 or \
                tensor.numel() * tensor.element_size() < self.min_bytes:
            self.stats.kept += 1
            # also parameters (nn.Parameter), DTensors, other tensor subclasses, and empty tensors (torch 2.11's
            # checkpoint saves an empty placeholder beside each block's inputs)
            return _Kept(tensor)
        tensor_ref, version, handle_ref = self._seen.get(id(tensor), (lambda: None, None, lambda: None))
        shared = handle_ref()
        if tensor_ref() is tensor and version == tensor._version and shared is not None and shared.host is not None:
            shared.unpacks_left += 1
            return shared
        handle = _Offloaded(None, tensor.device, tensor.numel() * tensor.element_size(), previous=self._last)
        if self.cuda or self.copy:
            self._take_block(handle, tensor)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                handle.host.copy_(tensor, non_blocking=True)
                handle.event = torch.cuda.Event()
                handle.event.record(self.d2h)
            tensor.record_stream(self.d2h)  # its memory is not reused before the copy is done
        elif self.copy:
            handle.host.copy_(tensor)
        else:
            handle.host = tensor
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(handle))
        self._last = weakref.ref(handle)
        self.stats.tensors += 1
        self.stats.bytes += handle.nbytes
        self.stats.shapes.append(tuple(tensor.shape))
        return handle

    def _take_block(self, handle: _Offloaded, tensor: torch.Tensor) -> None:
        """A pool block for `tensor`'s host copy (on CUDA, the copy stream waits for the copies out of its last
        use), given back when autograd lets go of `handle` if backward never unpacked it."""
        handle.block = self.pool.acquire(handle.nbytes, self.d2h if self.cuda else None)
        handle.host = handle.block.view(tensor.shape, tensor.dtype)
        handle.give_back = weakref.finalize(handle, self.pool.release, handle.block, handle.copies_out)

    # ---- backward ------------------------------------------------------------------------------------------------
    def unpack(self, handle: _Offloaded | _Kept) -> torch.Tensor:
        if isinstance(handle, _Kept):
            return handle.tensor
        self.stats.restored += 1
        if not self.cuda:
            tensor = handle.host.clone() if self.copy else handle.host
        else:
            tensor = self._to_device(handle)
            self._prefetch(handle.previous() if handle.previous is not None else None)
        handle.unpacks_left -= 1
        if handle.unpacks_left <= 0:
            handle.host = None
            if handle.give_back is not None:
                handle.give_back()  # the block back to the pool, with the events of the copies out of it
        return tensor

    def _to_device(self, handle: _Offloaded) -> torch.Tensor:
        current = torch.cuda.current_stream(self.device)
        if handle.prefetched is not None:
            (tensor, event), handle.prefetched = handle.prefetched, None
            current.wait_event(event)
            tensor.record_stream(current)  # allocated on the prefetch stream, used on this one
            return tensor
        current.wait_event(handle.event)
        tensor = handle.host.to(self.device, non_blocking=True)
        handle.copies_out.append(current.record_event())
        return tensor

    def _prefetch(self, handle: _Offloaded | None) -> None:
        if handle is None or handle.host is None or handle.prefetched is not None:
            return
        self.h2d.wait_event(handle.event)
        with torch.cuda.stream(self.h2d):
            tensor = handle.host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        handle.prefetched = (tensor, event)
        handle.copies_out.append(event)


def offload_block_inputs(blocks: list[nn.Module], offload: ActivationOffload) -> None:
    """Around each checkpointed block's forward, `offload`'s hooks (module docstring); the blocks must already be
    checkpointed (torch's composable ``checkpoint``), whose state tells a recomputation from a forward."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        entered: list[Any] = []

        def enter(module: nn.Module, args: tuple, kwargs: dict, entered: list = entered) -> None:
            state = checkpoint.state(module)
            if state is not None and state.enable_hook and torch.is_grad_enabled():  # not in recomputation
                context = offload.hooks()
                context.__enter__()
                entered.append(context)

        def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any, entered: list = entered) -> None:
            if entered:
                entered.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
        block.register_forward_hook(leave, with_kwargs=True, always_call=True)
