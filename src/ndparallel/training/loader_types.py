"""Accelerate's `accelerate.data_loader` names over ndparallel's prepared data loader (`ndparallel.training.data`).

`prepare` makes a data loader into a `DataLoaderShard` -- with ``DataLoaderConfiguration(dispatch_batches=True)`` a
`DataLoaderDispatcher` -- as Accelerate does, and both are torch ``DataLoader`` subclasses (with
``use_stateful_dataloader=True`` and torchdata installed, torchdata ``StatefulDataLoader`` ones too), so code that
checks a prepared loader's type finds what it finds under Accelerate. The classes only name and type it: both behave
as `ndparallel.training.data.PreparedDataLoader`, whose every rank reads its own share of each global batch (under
``dispatch_batches=True`` too: rank 0 does not read for the others, see `DataLoaderConfiguration`). The torch classes
contribute their type only: their ``__init__`` is not run, and what a prepared loader does not define is looked up
on the loader it was made from.

Also here, for scripts written against Accelerate's module: `prepare_data_loader` (one loader sharded without an
Accelerator) and `SeedableRandomSampler`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from .data import _LOADER_KWARGS, PreparedDataLoader
from ..distributed.layout import VIEWS


class DataLoaderShard(PreparedDataLoader, DataLoader):
    """A prepared data loader (`PreparedDataLoader`) under Accelerate's name and torch's ``DataLoader`` type."""


class DataLoaderDispatcher(PreparedDataLoader, DataLoader):
    """A prepared data loader under ``dispatch_batches=True``: Accelerate's name, `PreparedDataLoader`'s behaviour
    (every rank reads its own share of each global batch: the same batches rank 0 would have sent it)."""


def prepared_loader_class(stateful: bool, dispatch: bool = False) -> type[PreparedDataLoader]:
    """The class `prepare` makes a data loader into: `DataLoaderDispatcher` under ``dispatch_batches=True`` (of a
    map-style dataset: an iterable one is refused then), else `DataLoaderShard`; with
    ``DataLoaderConfiguration(use_stateful_dataloader=True)`` and torchdata installed, a subclass of it that is also
    a ``torchdata.stateful_dataloader.StatefulDataLoader``, as Accelerate's is then."""
    base = DataLoaderDispatcher if dispatch else DataLoaderShard
    if not stateful:
        return base
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:  # Accelerate refuses the setting without torchdata; ndparallel's loaders are stateful anyway
        return base
    return _stateful_class(base.__name__)


@functools.cache
def _stateful_class(name: str) -> type[PreparedDataLoader]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    base = {"DataLoaderShard": DataLoaderShard, "DataLoaderDispatcher": DataLoaderDispatcher}[name]
    return type(f"Stateful{name}", (base, StatefulDataLoader), {"__doc__": base.__doc__, "__module__": __name__})


def __getattr__(name: str) -> Any:
    """``StatefulDataLoaderShard`` / ``StatefulDataLoaderDispatcher``, made on first use (torchdata is optional):
    where pickle finds the class of a loader prepared with ``use_stateful_dataloader=True``."""
    if name in ("StatefulDataLoaderShard", "StatefulDataLoaderDispatcher"):
        return _stateful_class(name[len("Stateful"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SeedableRandomSampler(RandomSampler):
    """Accelerate's: a ``RandomSampler`` whose pass `e` draws from its generator seeded with ``initial_seed + e``
    (``initial_seed``: `data_seed`, else torch's initial seed when it is made); `set_epoch` sets `e`, and each pass
    moves it on by one. Inside a prepared loader, the loader sets ``initial_seed`` to the seed every rank shares
    (rank 0's, or the checkpoint's after `load_state`), so every rank draws the same order."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Any:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def shuffle_seed(loader: DataLoader, data_seed: int | None, device: torch.device) -> int:
    """Collective over every process: the seed every rank's random samplers draw from (see `ndparallel.training.data`),
    rank 0's -- `data_seed` if given, else a `SeedableRandomSampler`'s ``initial_seed``, else its sampler's or the
    loader's generator seed, else torch's initial seed."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    generator = getattr(sampler, "generator", None) or loader.generator
    seed = data_seed
    if seed is None:
        seed = getattr(sampler, "initial_seed", None)
    if not isinstance(seed, int):
        seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    seed_tensor = torch.tensor([seed % 2**62], dtype=torch.long, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed_tensor, src=0)
    return int(seed_tensor.item())


def _with_seedable_sampler(loader: DataLoader, data_seed: int | None) -> DataLoader:
    """`loader` with its ``RandomSampler`` (of ``shuffle=True``) replaced by a `SeedableRandomSampler`, as Accelerate's
    ``prepare_data_loader(use_seedable_sampler=True)`` does; any other loader as it is."""
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if type(sampler) is not RandomSampler or type(batch_sampler) is not BatchSampler:
        return loader
    seedable = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                     num_samples=sampler._num_samples, generator=sampler.generator,
                                     data_seed=data_seed)
    kwargs = {k: getattr(loader, k) for k in _LOADER_KWARGS}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if loader.batch_size is not None:
        return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=seedable, drop_last=loader.drop_last,
                          **kwargs)
    return DataLoader(loader.dataset, batch_sampler=BatchSampler(seedable, batch_sampler.batch_size,
                                                                 batch_sampler.drop_last), **kwargs)


def _mesh_shard(mesh: Any) -> tuple[int, int]:
    """(number of shards, this rank's shard) of a device mesh: its ``dp_replicate`` x ``dp_shard`` dimensions (the
    ranks that read different samples), by this rank's coordinates in them."""
    names = mesh.mesh_dim_names or ()
    shards, index = 1, 0
    for dim in VIEWS["batch"]:
        if dim in names:
            size = mesh[dim].size()
            shards, index = shards * size, index * size + mesh.get_local_rank(dim)
    return shards, index


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types: Any = None,
                        dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> PreparedDataLoader:
    """Accelerate's: `dataloader` sharded over `num_processes` shards (all processes by default; a device mesh's
    ``dp_replicate`` x ``dp_shard`` ranks with `torch_device_mesh`), this process reading shard `process_index`, as
    `Accelerator.prepare` shards it (`ndparallel.training.data`) but without an Accelerator: no gradient accumulation
    window, no loss-token counts. Collective: every process agrees on the shuffling seed (`shuffle_seed`). `rng_types`
    and `slice_fn_for_dispatch` are accepted and unused (every rank reads its own share, drawn alike)."""
    from ..distributed.state import PartialState  # the process state: started here if no Accelerator has started it

    state = PartialState()
    if torch_device_mesh is not None:
        num_processes, process_index = _mesh_shard(torch_device_mesh)
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    if not 0 <= process_index < num_processes:
        raise ValueError(f"prepare_data_loader: process_index={process_index} is not one of the {num_processes} "
                         "shards (0 .. num_processes - 1)")
    if dispatch_batches is None:  # Accelerate's default: dispatch an iterable dataset's batches when put on device
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and isinstance(dataloader.dataset, IterableDataset):
        raise ValueError("prepare_data_loader: dispatch_batches=True with an iterable dataset is not supported: every "
                         "rank reads its own share, so the dataset must yield the same order on every rank; make it "
                         "so and pass dispatch_batches=False")
    device = state.device if device is None else torch.device(device)
    seed = shuffle_seed(dataloader, data_seed, device)
    if use_seedable_sampler:
        dataloader = _with_seedable_sampler(dataloader, seed)
    cls = prepared_loader_class(use_stateful_dataloader, bool(dispatch_batches))
    return cls(dataloader, num_shards=num_processes, shard_index=process_index, seed=seed, device=device,
               put_on_device=put_on_device, window=1, window_group=None, split_batches=split_batches,
               even_batches=even_batches, non_blocking=non_blocking)


__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "SeedableRandomSampler", "prepare_data_loader"]
