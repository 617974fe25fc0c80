"""ndparallel: N-dimensional parallel training of PyTorch models with Hugging Face Accelerate's API.

    from ndparallel import Accelerator, ParallelismConfig, FullyShardedDataParallelPlugin
"""

from .accelerator import Accelerator, DistributedType
from .checkpoint import CheckpointError, ProjectConfiguration, init_empty_weights
from .config import (
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from .mesh import ParallelMesh
from .utils import set_seed

__version__ = "0.1.0"

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
    "init_empty_weights",
    "set_seed",
    "__version__",
]
