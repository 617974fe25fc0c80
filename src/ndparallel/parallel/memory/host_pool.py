"""Host memory for offloaded activations (`offload.ActivationOffload`), kept and reused step after step.

Each offloaded tensor gets a block of exactly its bytes rounded up to ``ALIGN`` (a page); a block given back goes to a
free list by size, and the next tensor of that size takes it. A training step offloads the same shapes every time (each
checkpointed block's input), so the pool allocates in the first step only, and holds the sum of one step's tensors:
not, as one ``torch.empty(..., pin_memory=True)`` per tensor does, each rounded up to a power of two by torch's caching
host allocator (`planner.offload.pinned`).

- **on CUDA** each block is its own anonymous memory map (whole pages of its own: no other allocation shares one,
  so registrations never overlap), page-locked by ``cudaHostRegister`` (as torch's own checkpoint stager pins
  shared memory), so it is pinned -- copies to and from it run asynchronously on the copy
  streams -- without the allocator's rounding. The pool is not that allocator and records nothing on its own: whoever
  copies out of a block gives the copy's completion event back with it (`release`), and the stream that next writes
  into the block waits for those events (`acquire`) -- on the device, with no host synchronisation. A block is
  unregistered and let go only once its events have completed (`Event.query`, which does not wait).
- **elsewhere** (CPU training with ``copy=True``) blocks are the same memory maps, unregistered, and there are no
  events; the path is the same.

Blocks free for a whole cycle (from the moment none is in use to the next such moment: a micro-step's forward and
backward) go back to the system, so a run whose shapes change holds what its recent steps used, not every shape seen.
"""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = mmap.PAGESIZE  # bytes: blocks are whole pages (what a memory map, and page-locking, hold)


def aligned(nbytes: int) -> int:
    """The bytes of a block holding `nbytes`."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(eq=False)
class Block:
    memory: torch.Tensor  # uint8, `size` bytes (over an anonymous memory map, which it keeps alive)
    size: int
    events: list[Any] = field(default_factory=list)  # CUDA: copies out of it that must finish before it is rewritten
    used: bool = True  # taken during the current cycle

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The block's first bytes as a contiguous tensor of `shape` and `dtype`."""
        nbytes = shape.numel() * dtype.itemsize
        return self.memory[:nbytes].view(dtype).view(shape)


@dataclass
class PoolStats:
    allocations: int = 0  # blocks the pool has allocated (page-locked on CUDA) in its lifetime
    released: int = 0  # blocks it let go (freed for a whole cycle)
    held: int = 0  # bytes of the blocks it holds now, free or in use
    peak_held: int = 0
    in_use: int = 0  # bytes of the blocks handed out and not yet given back
    peak_in_use: int = 0


class HostPool:
    """Blocks of host memory by size (module docstring); `pin`: page-lock them for the copy engines (CUDA)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.stats = PoolStats()
        self._free: dict[int, list[Block]] = {}
        self._blocks: list[Block] = []
        self._out = 0  # blocks handed out
        # Unregisters what is left once the pool itself goes (after the copies out of it, below); at the process's
        # exit the system takes the memory back, and CUDA may be gone already.
        self._finalizer = weakref.finalize(self, _let_go_all, self._blocks, pin)
        self._finalizer.atexit = False

    def acquire(self, nbytes: int, stream: Any = None) -> Block:
        """A block of at least `nbytes` that nothing reads any more; on CUDA `stream` (the one that writes into it)
        first waits for the copies out of it to finish."""
        size = aligned(nbytes)
        free = self._free.get(size)
        block = free.pop() if free else self._allocate(size)
        for event in block.events:
            stream.wait_event(event)
        block.events.clear()
        block.used = True
        self._out += 1
        self.stats.in_use += size
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.stats.in_use)
        return block

    def release(self, block: Block, events: list[Any] = ()) -> None:
        """Give `block` back; `events` (CUDA): the copies out of it still in flight. The end of a cycle (no block out)
        lets go of the blocks the cycle did not use."""
        block.events.extend(events)
        self._free.setdefault(block.size, []).append(block)
        self._out -= 1
        self.stats.in_use -= block.size
        if self._out == 0:
            self._trim()

    def _allocate(self, size: int) -> Block:
        memory = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)  # page-aligned, zeroed, its own pages
        if self.pin:
            _register(memory)
        block = Block(memory, size)
        self._blocks.append(block)
        self.stats.allocations += 1
        self.stats.held += size
        self.stats.peak_held = max(self.stats.peak_held, self.stats.held)
        return block

    def _trim(self) -> None:
        for size, free in list(self._free.items()):
            for block in [b for b in free if not b.used and all(e.query() for e in b.events)]:
                free.remove(block)
                self._blocks.remove(block)
                _let_go(block, self.pin)
                self.stats.held -= block.size
                self.stats.released += 1
            if not free:
                del self._free[size]
        for block in self._blocks:
            block.used = False


def _register(memory: torch.Tensor) -> None:
    status = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 1))  # 1: portable
    if status != 0:
        raise RuntimeError(f"cudaHostRegister of {memory.numel():,} bytes for offloaded activations failed "
                           f"(cudaError {status})")


def _let_go(block: Block, pin: bool) -> None:
    if pin:
        for event in block.events:
            event.synchronize()  # done already where `_trim` calls this; at the pool's end, the last copies
        torch.cuda.cudart().cudaHostUnregister(block.memory.data_ptr())
    block.memory = None


def _let_go_all(blocks: list[Block], pin: bool) -> None:
    for block in blocks:
        _let_go(block, pin)
    blocks.clear()
