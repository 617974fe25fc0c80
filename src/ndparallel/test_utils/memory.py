"""Memory counted on the CPU, on any device's tensors: what autograd keeps for backward (`kept_bytes`: the distinct
storages the saved tensors live in, parameters aside) and the most bytes of tensors alive at once in a region
(`LiveBytes`).

`LiveBytes` is a `TorchDispatchMode` that tracks the storages ops create while it is on (each released through a
weak reference when its last tensor dies) and keeps the largest sum of their bytes alive at once: the peak of what a
region holds, on any device. Buffers a kernel allocates inside itself (workspaces) are not seen; the same kernels on
both sides of a comparison keep that fair.

Under gloo a reading could come out high: gloo's worker thread lets go of a collective's tensors when it is done with
them, which can be after the caller's ``wait()`` returned (in about half the runs of the chunked block's all-gather,
its send buffer was still alive during the attention that followed). So while `LiveBytes` is on, torch.distributed's
blocking collectives return only once the backend holds none of their tensors (`settled_collectives`): the bytes
counted are then those the code itself keeps alive, in every run. `least_of` takes each reading's least over a few
runs, for what is left (collectives with ``async_op=True`` are not waited on).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.test_utils.collectives import _tensors


def kept_bytes(run: Callable[[], object], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages `run()` saves for backward (each storage once), less those of `parameters`."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    return sum(n for ptr, n in kept.items() if ptr not in weights)


def training_step_kept_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """What a causal LM's forward and backward on `ids` (labels the same) keep, parameters aside."""
    return kept_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward(), model.parameters())


def least_of(measure: Callable[[], dict[str, int]], runs: int = 3) -> dict[str, int]:
    """Each reading of ``measure()`` (bytes by name: peaks, what stays alive) at its least over `runs` calls, with a
    ``gc.collect()`` before each. Readings only: counts that must not vary (host syncs, collectives) are checked per
    run by the caller, never reduced this way."""
    least: dict[str, int] = {}
    for _ in range(runs):
        gc.collect()
        for name, value in measure().items():
            least[name] = min(least.get(name, value), value)
    return least


def _storages(x: Any) -> list[torch.UntypedStorage]:
    if isinstance(x, torch.Tensor):
        try:
            return [x.untyped_storage()]
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage of its own
            return []
    if isinstance(x, (list, tuple)):
        return [s for item in x for s in _storages(item)]
    return []


# torch.distributed's blocking collectives that the library calls (by module attribute, so the patch reaches them)
BLOCKING_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                        "all_to_all", "all_to_all_single", "all_reduce", "broadcast")
SETTLE_SECONDS = 2.0  # then the call returns anyway: a reading may count the buffer late, never hang


def _settled(collective: Callable) -> Callable:
    @functools.wraps(collective)
    def call(*args, **kwargs):
        tensors = [t for t in _tensors((args, list(kwargs.values()))) if not t.is_meta]
        before = [t._use_count() for t in tensors]  # C++ references to each tensor: the backend's add to them
        out = collective(*args, **kwargs)
        if not kwargs.get("async_op"):
            deadline = time.monotonic() + SETTLE_SECONDS
            while any(t._use_count() > n for t, n in zip(tensors, before)) and time.monotonic() < deadline:
                time.sleep(1e-4)
        return out
    return call


@contextlib.contextmanager
def settled_collectives() -> Iterator[None]:
    """While on, each of `BLOCKING_COLLECTIVES` returns only once the backend holds none of the tensors it was given
    (each tensor's C++ use count back to what it was before the call; at most `SETTLE_SECONDS`): gloo's worker thread
    drops a finished collective's tensors on its own time, after ``wait()`` returned to the caller."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in BLOCKING_COLLECTIVES if hasattr(dist, name)}
    for name, collective in originals.items():
        setattr(dist, name, _settled(collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m:`` then ``m.peak``: the most bytes of storages created inside that were alive at once
    (``m.live`` now). Storages that existed before the region (inputs, parameters) are not counted. Blocking
    collectives are settled while it is on (`settled_collectives`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, int] = {}  # storage key -> bytes, while alive
        self._settled = contextlib.ExitStack()

    def __enter__(self) -> "LiveBytes":
        self._settled.enter_context(settled_collectives())
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._settled.close()

    def _release(self, key: int, _ref: Any = None) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(s): s for s in _storages((args, list((kwargs or {}).values())))}
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            key = storage._cdata
            if key in self._seen or any(s._cdata == key for s in before.values()):
                continue
            self._seen[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._release, key)
        self.peak = max(self.peak, self.live)
        return out
