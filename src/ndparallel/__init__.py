"""ndparallel: N-dimensional parallel training of PyTorch models with Hugging Face Accelerate's API.

    from ndparallel import Accelerator, ParallelismConfig, FullyShardedDataParallelPlugin
"""

from ._version import __version__
from .accelerator import Accelerator, DistributedType
from .checkpoint import CheckpointError, ProjectConfiguration, init_empty_weights
from .config import (
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from .mesh import ParallelMesh
from .parallel.sequence import context_parallel_attention
from .utils import set_seed

__all__ = [
    "Accelerator",
    "CheckpointError",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "ParallelMesh",
    "ParallelismConfig",
    "ProjectConfiguration",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "context_parallel_attention",
    "init_empty_weights",
    "set_seed",
    "__version__",
]
