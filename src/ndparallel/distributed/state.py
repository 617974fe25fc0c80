"""Process and training state with Accelerate's names (`accelerate.state`): `PartialState`, `AcceleratorState`,
`GradientState`, `DistributedType`.

`PartialState` is this process's place in the job -- rank, world size, device, backend -- started once per process
(the first instance initialises torch.distributed through `ndparallel.distributed.runtime`; later ones share it, as
Accelerate's do) with the process-control helpers: `wait_for_everyone`, `main_process_first`, the `on_main_process`
family of decorators, `split_between_processes`, `print`. `AcceleratorState` adds what an `Accelerator` decided: mixed
precision, the parallelism config and its device mesh, the FSDP plugin and the distributed type. `GradientState` is
`ndparallel.training.loss.GradientState` (accumulation and the loss bookkeeping).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .agreement import monitored_barrier
from .failures import explain_collective_failures
from ..training.singletons import current
from ..training.loss import GradientState
from ..configuration.plugins import FullyShardedDataParallelPlugin
from .runtime import Runtime, env_flag, init_runtime

DEBUG_ENV = "NDPARALLEL_DEBUG_MODE"


class DistributedType(str, enum.Enum):
    """Accelerate's kinds of distributed setup. ndparallel runs NO, MULTI_CPU, MULTI_GPU and FSDP (FSDP2, whatever
    other parallelisms it is combined with); the others are listed so Accelerate scripts that compare against them
    still run."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PartialState:
    """This process's place in the job; every instance in a process shares one state (Accelerate's `PartialState`).

    The first one starts torch.distributed (gloo on CPU, NCCL on GPUs; a process nobody launched is a world of one);
    `cpu=True` keeps this process on the CPU. ``timeout`` / ``backend`` keyword arguments go to the process group.
    """

    _shared: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared
        if "runtime" in self._shared and not dist.is_initialized():  # the world it was made in has ended
            self._shared.clear()
        if "runtime" not in self._shared:  # (what a script set on a reset state stays)
            self.runtime: Runtime = init_runtime(cpu, **{k: v for k, v in kwargs.items() if v is not None})
            self._shared.setdefault("debug", env_flag(DEBUG_ENV) or env_flag("ACCELERATE_DEBUG_MODE"))
            explain_collective_failures()  # a rank that dies in a collective says where every rank was

    @staticmethod
    def _reset_state() -> None:
        """Forget the shared state (after the process group was destroyed); the next instance starts anew."""
        PartialState._shared.clear()

    def __getattr__(self, name: str) -> Any:
        """Only for what normal lookup did not find: a state that `_reset_state` emptied says so (Accelerate's
        message) for the attributes it had, instead of naming an internal one."""
        if not name.startswith("__") and self._was_reset() and (
                name == "runtime" or isinstance(getattr(type(self), name, None), property)):
            cls = type(self).__name__
            raise AttributeError(f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` "
                                 f"was called and an `Accelerator` or `{cls}` was not reinitialized.")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _was_reset(self) -> bool:
        return self.__dict__ is PartialState._shared and not PartialState._shared

    @property
    def debug(self) -> bool:
        """Accelerate's debug mode: the collectives of `ndparallel.distributed.gather_reduce` (``gather``, ``reduce``,
        ``broadcast``, ``pad_across_processes``) first check that every process passes tensors they can combine,
        raising the same `DistributedOperationException` everywhere otherwise. Settable; starts from
        ``$NDPARALLEL_DEBUG_MODE`` / ``$ACCELERATE_DEBUG_MODE``. One setting for the process."""
        return bool(PartialState._shared.get("debug", False))

    @debug.setter
    def debug(self, value: bool) -> None:
        PartialState._shared["debug"] = bool(value)

    # ---- where this process is -------------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return "runtime" in self._shared

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def default_device(self) -> torch.device:
        return self.runtime.device

    @property
    def backend(self) -> str:
        return self.runtime.backend

    @property
    def num_processes(self) -> int:
        return self.runtime.world_size

    @property
    def process_index(self) -> int:
        return self.runtime.rank

    @property
    def local_process_index(self) -> int:
        return self.runtime.local_rank

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    # ---- process control ------------------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """A barrier over every process."""
        monitored_barrier("wait_for_everyone", self.runtime.timeout)  # a barrier that names who is missing

    @contextlib.contextmanager
    def _goes_first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block first, the others after it (e.g. dataset preprocessing with a cache)."""
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        return self._goes_first(self.is_local_main_process)

    def _on(self, run: bool, function: Callable | None) -> Callable:
        if function is None:
            raise TypeError("use it as a decorator: @state.on_main_process")

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if run else None

        return wrapper

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run `function` on the main process only (elsewhere it returns None)."""
        return self._on(self.is_main_process, function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self._on(self.is_local_main_process, function)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        return self._on(self.is_last_process, function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: run `function` on process `process_index` only (``@state.on_process(process_index=1)``)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(self.process_index == process_index, function)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._on(self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of a list, tuple, tensor (dim 0) or dict of them (all the same length),
        over every process: the first ``len % n`` processes get one more. `apply_padding` repeats the last element
        so that every process gets as many (to gather the results afterwards; drop the repeats then)."""
        n, index = self.num_processes, self.process_index
        if n == 1:
            yield inputs
            return
        if isinstance(inputs, dict):
            lengths = {len(v) for v in inputs.values()}
            if len(lengths) > 1:
                raise ValueError("split_between_processes: all values of the dict must have the same length")
            length = lengths.pop() if lengths else 0
        else:
            length = len(inputs)
        per, extra = divmod(length, n)
        start = index * per + min(index, extra)
        end = start + per + (1 if index < extra else 0)
        longest = per + (1 if extra else 0)

        def split(values: Any) -> Any:
            if isinstance(values, dict):
                return type(values)((k, split(v)) for k, v in values.items())
            part = values[start:end]
            if apply_padding and len(values) and len(part) < longest:
                last = values[-1:]
                pad = longest - len(part)
                part = torch.cat([part, *[last] * pad]) if isinstance(part, torch.Tensor) else part + last * pad
            return part

        yield split(inputs)

    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._reset_state()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(distributed_type={self.distributed_type.value}, backend={self.backend}, "
                f"process {self.process_index} of {self.num_processes}, device={self.device})")


class AcceleratorState(PartialState):
    """What an `Accelerator` decided, on top of the process state: ``mixed_precision``, ``parallelism_config`` and
    its ``device_mesh``, ``fsdp_plugin``, ``distributed_type`` (FSDP when FSDP2 wraps the models), ``is_fsdp2`` --
    read from the Accelerator's settings (`ndparallel.accelerator.settings.Settings`, its one copy of them). Unlike
    Accelerate's, one per Accelerator (the process part is shared); ``AcceleratorState()`` with no arguments is that
    of the newest Accelerator, as Accelerate's singleton is, and `_reset_state` forgets all of them, as it forgets
    Accelerate's."""

    def __new__(cls, partial: PartialState | None = None, **kwargs: Any) -> AcceleratorState:
        if partial is None:
            if kwargs:
                raise TypeError("AcceleratorState(...) is made by the Accelerator; call AcceleratorState() with no "
                                "arguments for the current one, or pass the settings to Accelerator(...)")
            return current(AcceleratorState, "AcceleratorState")
        made = super().__new__(cls)
        AcceleratorState._made.add(made)  # unpickled ones too
        return made

    def __getnewargs__(self) -> tuple[str]:
        return ("<unpickled>",)  # pickle makes a new object (no arguments would mean the current one)

    def __init__(self, partial: PartialState | None = None, *, settings: Any = None, device_mesh: Any = None) -> None:
        if partial is None:  # the current state, returned by __new__ as it is
            return
        AcceleratorState._latest = weakref.ref(self)
        self.__dict__ = dict(partial._shared)  # a snapshot of the process state, plus this Accelerator's decisions
        self._settings = settings
        self.device_mesh = device_mesh

    mixed_precision = property(lambda self: self._settings.mixed_precision)
    parallelism_config = property(lambda self: self._settings.parallelism)

    @property
    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin | None:
        return self._settings.fsdp_plugin

    @fsdp_plugin.setter
    def fsdp_plugin(self, plugin: FullyShardedDataParallelPlugin) -> None:
        """Accelerate's: another FSDP2 plugin for the models prepared from then on (those prepared already stay as
        they are). Whether FSDP2 wraps the models was decided when the Accelerator was made, so an Accelerator
        without FSDP2 refuses one (it would be ignored)."""
        if not isinstance(plugin, FullyShardedDataParallelPlugin):
            raise TypeError(f"fsdp_plugin must be a FullyShardedDataParallelPlugin, got {type(plugin).__name__}")
        if not self._settings.fsdp:
            raise ValueError("state.fsdp_plugin = ...: this Accelerator does not wrap its models with FSDP2 (decided "
                             "when it was made, from its ParallelismConfig and plugin), so the plugin would be "
                             "ignored; pass fsdp_plugin=... (or a ParallelismConfig that shards) to Accelerator(...)")
        plugin.set_mixed_precision(self._settings.mixed_precision)
        self._settings.fsdp_plugin = plugin

    _made: weakref.WeakSet[AcceleratorState] = weakref.WeakSet()  # every state made so far, for `_reset_state`
    _forgotten: weakref.WeakSet[AcceleratorState] = weakref.WeakSet()  # those `_reset_state` cleared

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Accelerate's: forget the state of every Accelerator made so far. Reading it -- and so using such an
        Accelerator -- then raises Accelerate's AttributeError saying so; the next Accelerator makes a new one. With
        `reset_partial_state`, the shared process part is forgotten too (after the process group was destroyed)."""
        for state in list(AcceleratorState._made):
            state.__dict__.clear()
            AcceleratorState._forgotten.add(state)
        AcceleratorState._latest = None
        if reset_partial_state:
            PartialState._reset_state()

    def _was_reset(self) -> bool:
        return self in AcceleratorState._forgotten

    @property
    def is_fsdp2(self) -> bool:
        return self._settings.fsdp

    @property
    def distributed_type(self) -> DistributedType:
        """FSDP when FSDP2 wraps the models, else the process state's; a value assigned (as Accelerate's scripts do)
        is what the Accelerator reports from then on (its models stay as they were prepared)."""
        override = self.__dict__.get("_distributed_type")
        if override is not None:
            return override
        return DistributedType.FSDP if self._settings.fsdp else super().distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType | str) -> None:
        try:
            self._distributed_type = DistributedType(value)
        except ValueError:
            raise ValueError(f"distributed_type must be one of {[t.value for t in DistributedType]}, got "
                             f"{value!r}") from None


__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
