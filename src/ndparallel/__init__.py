"""ndparallel: N-dimensional parallel training of PyTorch models with Hugging Face Accelerate's API.

    from ndparallel import Accelerator, ParallelismConfig, FullyShardedDataParallelPlugin

Accelerate's module paths work too: `ndparallel.accelerator`, `ndparallel.parallelism_config`, `ndparallel.state`,
`ndparallel.utils`, `ndparallel.big_modeling`.
"""

from ._version import __version__
from .accelerator import Accelerator
from .training.batch_size import find_executable_batch_size
from .checkpoint import CheckpointError, ProjectConfiguration, init_empty_weights
from .configuration.parallelism import ParallelismConfig
from .configuration.handlers import PipelineParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig
from .distributed.mesh import ParallelMesh
from .parallel.memory import MemoryKwargs
from .parallel.sequence import context_parallel_attention
from .configuration.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)
from .training.seed import set_seed
from .distributed.state import DistributedType, PartialState
from .integrations import enable as _enable_integrations

__all__ = [
    "Accelerator",
    "AutocastKwargs",
    "CheckpointError",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "MemoryKwargs",
    "ParallelMesh",
    "ParallelismConfig",
    "PartialState",
    "PipelineParallelConfig",
    "ProjectConfiguration",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "context_parallel_attention",
    "find_executable_batch_size",
    "init_empty_weights",
    "set_seed",
    "__version__",
]

# A Hugging Face Trainer given an ndparallel ParallelismConfig takes ndparallel's route (ndparallel.integrations).
_enable_integrations()
