"""Background saves (``save_state(async_save=True)``): a host copy of the state, and one writer thread per rank.

`host_copy` copies a model's or optimizer's state dict into host buffers that are kept from one save to the next
(under the same name): after the first save, a copy is a `copy_` into memory already mapped, several times faster
than allocating it again, at the cost of one copy of this rank's shard held between saves. DTensors stay DTensors
(their local shard copied, the mesh and placements kept), so DCP writes the same global layout as a blocking save.

`start` hands the write to this process's writer thread (started at the first background save and kept: starting a
thread waits for it to run, which on a busy CPU costs about as long as the rest of the stall), its collectives on a
gloo process group of its own (made once, by every rank together, at the first background save) so they never
interleave with the training's. `wait` waits for the write and raises its error. The thread is a daemon, so an idle
one never keeps a process alive; a script that ends while its last checkpoint is written waits for it first (a hook
at interpreter exit, run where the interpreter joins its threads).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed.runtime import heartbeat
from . import storage
from .storage import rank

_buffers: dict[str, torch.Tensor] = {}  # host copies kept between saves, by "<part>/<key path>"
_wrappers: dict[str, tuple[torch.Tensor, DTensor]] = {}  # a buffer of `_buffers` holding a shard, and its DTensor


def host_copy(state: Any, name: str) -> Any:
    """A copy of `state` (nested dicts and lists of tensors, DTensors and plain values) in host memory, made now;
    tensors are copied into the buffers of the previous save of `name` where their shapes and dtypes allow (all in
    one `torch._foreach_copy_`)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    copy = _mirror(state, name, pairs)
    if pairs:
        destinations, sources = zip(*pairs)
        torch._foreach_copy_(list(destinations), list(sources))
    return copy


def _mirror(state: Any, name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`state` with each tensor replaced by its host buffer; the copies to make are added to `pairs`."""
    if isinstance(state, dict):
        return {k: _mirror(v, f"{name}/{k}", pairs) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_mirror(v, f"{name}/{i}", pairs) for i, v in enumerate(state))
    if isinstance(state, DTensor):
        local = _buffer(state.to_local(), name, pairs)
        buffer, kept = _wrappers.get(name, (None, None))  # a DTensor around this buffer, made by an earlier save
        if (kept is None or buffer is not local or kept.device_mesh != state.device_mesh
                or kept.placements != state.placements or kept.shape != state.shape or kept.stride() != state.stride()):
            kept = DTensor.from_local(local, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                                      stride=state.stride())
            _wrappers[name] = (local, kept)
        return kept
    if isinstance(state, torch.Tensor):
        return _buffer(state, name, pairs)
    return state


def _buffer(tensor: torch.Tensor, name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    tensor = tensor.detach()
    buffer = _buffers.get(name)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        pin = tensor.device.type == "cuda"  # a page-locked buffer makes the device-to-host copy fast
        buffer = _buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    pairs.append((buffer, tensor))
    return buffer


class _Under:
    """This rank's background save, if one is under way."""

    done: threading.Event | None = None  # set when the write has ended
    error: BaseException | None = None
    target: Path | None = None
    group: Any = None  # the process group of background saves' collectives
    world: Any = None  # the default group it was made under


class _Writer:
    """The thread that runs this process's background writes, one at a time, in the order given."""

    _current: _Writer | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="ndparallel-background-save", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.jobs.get()()

    @classmethod
    def get(cls) -> _Writer:
        """The writer of this process (made again in a process forked from one that had one: its thread is not)."""
        writer = cls._current
        if writer is None or writer.pid != os.getpid() or not writer.thread.is_alive():
            writer = cls._current = _Writer()
        return writer


def _wait_at_exit() -> None:
    """At interpreter exit, where it joins its threads: a background write under way ends first (quietly: its error
    was printed when it happened)."""
    done = _Under.done
    if done is not None:
        done.wait()


try:  # before non-daemon threads are joined, while the interpreter still runs every thread (as concurrent.futures)
    threading._register_atexit(_wait_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # an interpreter without it: at exit, before the modules are torn down
    import atexit

    atexit.register(_wait_at_exit)


def start(write: Callable[[], None], target: Path) -> None:
    """Run `write` (the collective write of the checkpoint `target`) on this rank's writer thread. Every rank calls
    it together (the first call makes the process group)."""
    if dist.is_available() and dist.is_initialized() and _Under.world is not dist.group.WORLD:
        # Made again under a new default group (a process group released and initialized again).
        _Under.group, _Under.world = dist.new_group(backend="gloo"), dist.group.WORLD
    done = threading.Event()

    def run() -> None:
        try:
            with storage.collectives_on(_Under.group):
                write()
        except BaseException as exc:  # noqa: BLE001 -- raised by the next `wait`, on this rank
            _Under.error = exc
            # Said now as well: a script that never waits again (no end_training) must not lose it silently.
            print(f"ndparallel: rank {rank()}: the background save_state of {target} failed: {exc} (the previous "
                  f"checkpoint is untouched; the next save_state, load_state, wait_for_checkpoint or end_training "
                  f"raises it)", file=sys.stderr, flush=True)
        finally:
            done.set()

    _Under.error, _Under.target, _Under.done = None, target, done
    _Writer.get().jobs.put(run)


def wait() -> Path | None:
    """Wait for this rank's background save, if one is under way, and raise its error if it failed (the same on every
    rank: its collectives agree on errors); return the directory it wrote, or None."""
    done, target = _Under.done, _Under.target
    if done is None:
        return None
    heartbeat("save_state: waiting for the background save")
    done.wait()
    _Under.done = None
    if _Under.error is not None:
        error, _Under.error = _Under.error, None
        raise error
    return target


def release() -> None:
    """Drop the kept host copies (they are made again by the next background save) and forget the process group
    (`end_training`, before the process group is released)."""
    _buffers.clear()
    _wrappers.clear()
    _Under.group = _Under.world = None
