"""`ndparallel.parallelism_config`: Accelerate's module path of `ParallelismConfig` (home: `ndparallel.config`)."""

from .config import ParallelismConfig

__all__ = ["ParallelismConfig"]
