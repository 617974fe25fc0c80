"""ndparallel: N-dimensional parallel training of PyTorch models with Hugging Face Accelerate's API.

    from ndparallel import Accelerator, ParallelismConfig, FullyShardedDataParallelPlugin
"""

from .accelerator import Accelerator, DistributedType
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
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "ParallelMesh",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "set_seed",
    "__version__",
]
