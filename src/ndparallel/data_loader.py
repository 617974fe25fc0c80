"""`ndparallel.data_loader`: Accelerate's `accelerate.data_loader` names (home: `ndparallel.training.loader_types`)."""

from .training.loader_types import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler, prepare_data_loader

__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "SeedableRandomSampler", "prepare_data_loader"]
