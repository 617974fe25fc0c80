"""`ndparallel.parallelism_config`: Accelerate's module path of `ParallelismConfig` (home:
`ndparallel.configuration`)."""

from .configuration.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
