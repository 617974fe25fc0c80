"""`ndparallel.utils`: Accelerate's `accelerate.utils` names, so that changing ``accelerate`` to ``ndparallel`` on the
import lines ports a script. Each name's real home is in the module it is imported from; nothing is defined here."""

from .training.batch_size import find_executable_batch_size
from .checkpoint import ProjectConfiguration
from .configuration.parallelism import ParallelismConfig
from .configuration.handlers import TorchContextParallelConfig, TorchTensorParallelConfig
from .training.data import move_to_device as send_to_device
from .distributed.devices import (
    get_accelerator_free_memory,
    get_distributed_backend,
    get_torch_accelerator_backend,
    normalize_device,
)
from .distributed.gather_reduce import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    pad_across_processes,
)
from .distributed.gather_reduce import gather_all as gather
from .distributed.gather_reduce import gather_object_all as gather_object
from .distributed.gather_reduce import reduce_all as reduce
from .configuration.plugins import (
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
from .training.seed import set_seed, synchronize_rng_state, synchronize_rng_states
from .distributed.state import DistributedType
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
    "get_accelerator_free_memory",
    "get_distributed_backend",
    "get_torch_accelerator_backend",
    "normalize_device",
    "pad_across_processes",
    "progress_bar",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
]
