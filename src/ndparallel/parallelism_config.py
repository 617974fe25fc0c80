"""`ndparallel.parallelism_config`: Accelerate's module path of `ParallelismConfig` (its home is `ndparallel.config`)."""

from .config import ParallelismConfig

__all__ = ["ParallelismConfig"]
