"""Finding a batch size that fits: `find_executable_batch_size`, Accelerate's name and meaning
(`accelerate.utils.memory`; here `ndparallel.find_executable_batch_size` and `ndparallel.utils`), so scripts that
use it port with their imports changed.

`find_executable_batch_size` calls the decorated function with a batch size and, when it fails because memory ran
out (CUDA, XPU or HIP "out of memory", the CPU allocator's "can't allocate memory", cuDNN's unsupported-size
error), frees what it can and calls it again with 0.9x the size. Under several processes the ranks agree after
every try, through the process group's store (`agreement.monitored_barrier`, not a collective of the backend): if
any rank ran out of memory, every rank tries again, with the same smaller size -- also the ranks whose try
succeeded. What no library can undo: ranks that went on into a collective the failed rank will not join wait
there until the backend's timeout (the failed rank reports the ranks missing from the barrier when its own
timeout passes). The usual out-of-memory -- the same shapes on every rank, failing at the same allocation -- and
one after a try's last collective are not that case.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.agreement import monitored_barrier

_OOM_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN refusing a size it cannot fit
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` says memory ran out (or cuDNN could not run the size): a smaller batch may fit."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def release_memory() -> None:
    """Collect garbage and give cached accelerator memory back (between tries; `Accelerator.free_memory`)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()


def _all_fit(fitted: bool, size: int) -> bool:
    """Every rank's outcome of a try at `size`: True when none ran out of memory. A store barrier, not a
    collective (see the module docstring); the same answer on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fitted
    return monitored_barrier(f"find_executable_batch_size({size})", digest="fit" if fitted else "oom") and fitted


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable:
    """Decorate ``function(batch_size, ...)``: call it with `starting_batch_size`, then 0.9x that (or what
    `reduce_batch_size_fn()` returns) after each out-of-memory failure, until it returns; the caller omits
    ``batch_size``. RuntimeError once the size reaches 0. The size reached is kept for later calls, as Accelerate
    keeps it. Under several processes every rank tries the same sizes (see the module docstring).

        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size, model, optimizer):
            ...

        train(model, optimizer)
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    if not isinstance(starting_batch_size, int) or starting_batch_size < 1:
        raise ValueError(f"find_executable_batch_size: starting_batch_size must be a positive int, got "
                         f"{starting_batch_size!r}")
    batch_size = starting_batch_size

    def reduce() -> int:
        return int(batch_size * 0.9) if reduce_batch_size_fn is None else int(reduce_batch_size_fn())

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        release_memory()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove this as the decorator already does so: `{function.__name__}({given})`")
        while True:
            if batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                result, fitted = function(batch_size, *args, **kwargs), True
            except Exception as exc:  # noqa: BLE001 - only out-of-memory errors are retried
                if not should_reduce_batch_size(exc):
                    raise
                result, fitted = None, False
                del exc  # its traceback holds the frames (and tensors) of the failed try
            if _all_fit(fitted, batch_size):
                return result
            result = None
            release_memory()
            batch_size = reduce()

    return decorator
