"""`ndparallel.utils`: Accelerate's `accelerate.utils` names, so that changing ``accelerate`` to ``ndparallel`` on the
import lines ports a script. Each name's real home is in the module it is imported from; nothing is defined here."""

from .batch_size import find_executable_batch_size
from .checkpoint import ProjectConfiguration
from .config import ParallelismConfig, TorchContextParallelConfig, TorchTensorParallelConfig
from .data import move_to_device as send_to_device
from .gather_reduce import DistributedOperationException, broadcast, broadcast_object_list, pad_across_processes
from .gather_reduce import gather_all as gather
from .gather_reduce import gather_object_all as gather_object
from .gather_reduce import reduce_all as reduce
from .plugins import (
    AORecipeKwargs,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    TERecipeKwargs,
    TorchDynamoPlugin,
)
from .seed import set_seed, synchronize_rng_state, synchronize_rng_states
from .state import DistributedType
from .tracking import GeneralTracker, LoggerType, progress_bar

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ParallelismConfig",
    "ProjectConfiguration",
    "TERecipeKwargs",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "broadcast",
    "broadcast_object_list",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "pad_across_processes",
    "progress_bar",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
