"""Where this process stands, and process control: Accelerate's process properties and helpers, read from the
process state (`ndparallel.state`) and the mesh (`ndparallel.distributed.mesh`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from ..distributed.mesh import ParallelMesh
from ..training.prepared import PreparedObjects
from ..distributed.state import AcceleratorState, DistributedType, PartialState

# Where torch's Join works: DDP over several processes (on GPUs and, unlike Accelerate, on CPUs with gloo).
_JOINABLE_TYPES = (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)


def _axis_property(axis: str, what: str) -> property:
    def get(self: ProcessesMixin) -> int:
        return self.mesh.rank(axis) if what == "rank" else self.mesh.size(axis)

    get.__doc__ = f"This process's coordinate along ``{axis}``." if what == "rank" else f"Size of ``{axis}``."
    return property(get)


class ProcessesMixin:
    """Part of `ndparallel.Accelerator`: its process and mesh surface."""

    state: AcceleratorState
    mesh: ParallelMesh
    prepared: PreparedObjects
    even_batches: bool

    # ---- processes ------------------------------------------------------------------------------------------------
    device = property(lambda self: self.state.device, doc="This process's device.")
    num_processes = property(lambda self: self.state.num_processes)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.use_distributed)

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def multi_device(self) -> bool:
        """Accelerate's: several processes doing plain data parallelism on accelerators (not FSDP)."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    is_composable_parallelism_enabled = is_fsdp2

    # ---- the mesh -------------------------------------------------------------------------------------------------
    @property
    def torch_device_mesh(self):
        """The world `DeviceMesh`: a dimension for each axis of more than one rank, and every view spanning more than
        one rank by name (Accelerate's ``dp``, ``dp_shard_cp``, ``dp_cp``; ndparallel's ``batch``, ``fsdp``, ``loss``);
        ``accelerator.mesh[name]`` answers every view name."""
        return self.mesh.world

    dp_replicate_rank = _axis_property("dp_replicate", "rank")
    dp_replicate_size = _axis_property("dp_replicate", "size")
    dp_shard_rank = _axis_property("dp_shard", "rank")
    dp_shard_size = _axis_property("dp_shard", "size")
    cp_rank = _axis_property("cp", "rank")
    cp_size = _axis_property("cp", "size")
    sp_rank = _axis_property("sp", "rank")
    sp_size = _axis_property("sp", "size")
    tp_rank = _axis_property("tp", "rank")
    tp_size = _axis_property("tp", "size")
    # Accelerate's names: data_parallel_rank is the coordinate along dp_replicate, data_parallel_shard_rank along
    # dp_shard (the coordinate among all ranks with distinct samples is mesh.rank("batch")).
    data_parallel_rank = _axis_property("dp_replicate", "rank")
    data_parallel_shard_rank = _axis_property("dp_shard", "rank")
    tensor_parallel_rank = _axis_property("tp", "rank")
    context_parallel_rank = _axis_property("cp", "rank")
    sequence_parallel_rank = _axis_property("sp", "rank")
    data_parallel_size = _axis_property("batch", "size")  # dp_replicate * dp_shard, ParallelismConfig's meaning

    # Accelerate raises here (it has no pipeline parallelism); ndparallel answers the stage's coordinate.
    pipeline_parallel_rank = _axis_property("pp", "rank")
    pp_rank = _axis_property("pp", "rank")
    pp_size = _axis_property("pp", "size")

    @property
    def should_save_model(self) -> bool:
        """Whether this process takes part in saving the model: every process does (`save_model` and `save_state` are
        collective; only the main process writes what is not sharded)."""
        return True

    # ---- process control --------------------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """A barrier over every process. As Accelerate's, it needs only the process state, which
        ``AcceleratorState._reset_state()`` leaves (this Accelerator's own state is then forgotten)."""
        if "runtime" in PartialState._shared:  # the process state, shared by every state object of this process
            PartialState().wait_for_everyone()
        else:
            self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        return self.state.on_local_process(function, local_process_index)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """torch's `Join` over the DDP models among `joinables`, for ranks that run out of batches at different steps
        (loaders with ``even_batches=False``). `even_batches` overrides the prepared map-style loaders' setting inside
        the block (an iterable dataset's loader keeps its own, with a warning); Join is on when batches are uneven.
        Elsewhere than multi-process DDP (FSDP2 cannot join) it warns and does nothing."""
        if self.num_processes == 1:
            yield
            return
        if self.distributed_type not in _JOINABLE_TYPES:
            warnings.warn("Joining uneven inputs is only supported for multi-GPU (and multi-CPU) DDP training, not "
                          f"{self.distributed_type.value}; join_uneven_inputs has no effect: keep even_batches=True",
                          stacklevel=3)
            yield
            return
        overridden = []
        if even_batches is not None:
            for loader in self.prepared.dataloaders:
                if not loader.iterable:
                    overridden.append((loader, loader.even_batches))
                    loader.even_batches = even_batches
            if len(overridden) < len(self.prepared.dataloaders):
                warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                              "given were iterable", stacklevel=3)
        else:
            even_batches = self.even_batches
        ddp = [j for j in joinables if isinstance(j, DistributedDataParallel)]
        try:
            with Join(ddp, enable=not even_batches) if ddp else contextlib.nullcontext():
                yield
        finally:
            for loader, value in overridden:
                loader.even_batches = value

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """This process's share of `inputs` over every process (`ndparallel.state.PartialState`)."""
        return self.state.split_between_processes(inputs, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        self.state.print(*args, **kwargs)
