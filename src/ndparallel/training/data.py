"""Sharding data loaders along the ``batch`` view.

Each rank of ``batch`` (dp_replicate x dp_shard) receives distinct samples; every rank of the other axes (cp,
sp, tp) receives exactly the samples of its ``batch`` coordinate -- which rank is which is asked of the mesh,
never computed from the global rank.

Global batches. The original loader's batches are taken ``D`` at a time (D = size of ``batch``): one optimizer
micro-step consumes D consecutive original batches, and batch-rank d gets the d-th. With the usual
``BatchSampler`` that is the slice ``[d*B, (d+1)*B)`` of ``D*B`` consecutive samples, so step k sees exactly the
samples a single process would see with ``batch_size=D*B``.

The last uneven batch. When the samples left at the end fill fewer than D batches (or D batches, the last short):
- ``drop_last=True``: they are dropped (on every rank, so every rank takes the same number of steps);
- ``drop_last=False``: they are split evenly over the D ranks, each rank getting ceil(m / D) samples, the
  shortfall filled with samples from the start of the epoch. `Accelerator.gather_for_metrics` drops those
  repeats again.

Shuffling. Every random sampler of torch (``RandomSampler`` from ``shuffle=True``, ``SubsetRandomSampler``,
``WeightedRandomSampler``) is given, at each pass, a generator seeded with (seed + epoch), where the seed is rank
0's: its sampler's or DataLoader's generator seed if either has one, its torch seed otherwise. All ranks draw the same
order, and each pass (epoch 0, 1, 2... unless ``set_epoch`` says otherwise) reshuffles deterministically. A
custom sampler must yield the same order on every rank itself.

Options (Accelerate's `DataLoaderConfiguration`). ``split_batches=True``: the loader's batch is the global batch,
and each rank takes its 1/D of it (the batch size must divide by D) -- the same samples as above with batches of B/D.
``even_batches=False``: the samples left at the end are not topped up; a rank may get a short batch or none. Ranks
then run different numbers of steps (DDP needs ``Accelerator.join_uneven_inputs``), so no window totals are agreed
on: the loss keeps Accelerate's meaning (1 / accumulation steps) for that loader. A DataLoader with ``batch_size=None``
(its dataset yields whole batches) gives each rank every D-th item.

Iterable datasets. Every rank iterates the whole dataset (it must yield the same order on every rank) and
keeps its share of each run of D*B samples, with the same end-of-data rule as above. At most one worker
process may read it (more would each yield every sample); what it must know of each pass (the epoch, where the pass
starts) and what the main process must learn (the real samples of the last batch) go through shared memory, so a
persistent worker follows the passes too.

Resuming. A pass starts where `load_state_dict` (the restored epoch only) or `skip_batches` (the next pass, whatever
its epoch) put it; the position is given to the sampler (or the iterable shard) for the whole pass, since torch's
DataLoader calls iter() on its batch sampler more than once per pass with worker processes, and the next pass
starts at its beginning. The samples a resumed pass yields are the uninterrupted pass's under every DataLoader
setting (worker processes, persistent or not, prefetching, pinned memory); random numbers drawn inside worker
processes (augmentations) start again with the resumed pass, so they are not the uninterrupted run's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from .loss import BatchInfo, GradientState, TokenTotal, count_loss_tokens
from ..distributed.runtime import group_name, resolve_group


def uneven_refusal(holding: int, shards: int, why: str) -> str:
    """The error of an uneven last batch (``even_batches=False``) where every rank must run every step."""
    return (f"even_batches=False: the last batch of this pass goes to {holding} of the {shards} ranks with distinct "
            f"samples, and the others have none, but {why}: the ranks with a batch would wait for the others "
            "forever. Keep even_batches=True (the last batch is evened out; gather_for_metrics drops the repeats), "
            "use drop_last=True, or train with DDP and accelerator.join_uneven_inputs")


class ShardedBatchSampler(Sampler[list[int]]):
    """This shard's batch of each group of `num_shards` consecutive batches of `batch_sampler`."""

    def __init__(self, batch_sampler: Any, num_shards: int, shard_index: int, drop_last: bool, seed: int,
                 even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.drop_last = drop_last
        self.seed = seed
        self.even_batches = even_batches
        self.last_remainder = 0  # real samples of the last pass's final global batch, when it was not whole
        self.lockstep = ""  # why every rank must run every step (set by the Accelerator), "" if they need not
        # Where the current pass starts (`begin_pass`): skip this many batches of `batch_sampler`, or -- when resuming
        # with another batch size -- this many of its sampler's indices, re-batched after that.
        self.start_batches = 0
        self.start_samples = 0

    def begin_pass(self, start_batches: int = 0, start_samples: int = 0) -> None:
        """Where the pass about to be iterated starts. It holds for every `__iter__` until the next `begin_pass`:
        torch's DataLoader calls iter() on its batch sampler more than once per pass (its multi-process iterator:
        once when made and again when it resets, also at every pass of persistent workers), and each call must start
        at the pass's position, not only the first."""
        self.start_batches, self.start_samples = start_batches, start_samples

    def set_epoch(self, epoch: int) -> None:
        """Make every random sampler draw from a generator seeded with (seed + epoch): the same on all ranks. Samplers
        nest (a BatchSampler given as a DataLoader's sampler holds a RandomSampler): each level is seeded."""
        obj, seen = self.batch_sampler, set()
        while obj is not None and id(obj) not in seen:
            seen.add(id(obj))
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
            if hasattr(obj, "generator"):  # RandomSampler, SubsetRandomSampler, WeightedRandomSampler
                obj.generator = torch.Generator().manual_seed((self.seed + epoch) % 2**63)
            if hasattr(obj, "initial_seed"):  # SeedableRandomSampler, which seeds its generator again from this
                obj.initial_seed = self.seed
            obj = getattr(obj, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        return self._shards(self.start_batches, self.start_samples)

    def _batches(self, skip_batches: int, skip_samples: int) -> Iterator[tuple[list[int], bool]]:
        """The pass's batches, each with whether it lies before the resume position."""
        if skip_samples:  # another batch size than at save: re-batch the indices that follow the position
            size, indices = self.batch_sampler.batch_size, iter(self.batch_sampler.sampler)
            done = [i for _, i in zip(range(skip_samples), indices)]
            for start in range(0, len(done), size):
                yield done[start:start + size], True
            batch: list[int] = []
            for index in indices:
                batch.append(index)
                if len(batch) == size:
                    yield batch, False
                    batch = []
            if batch and not self.batch_sampler.drop_last:
                yield batch, False
            return
        for i, batch in enumerate(self.batch_sampler):
            yield list(batch), i < skip_batches

    def _shards(self, skip_batches: int, skip_samples: int) -> Iterator[list[int]]:
        self.last_remainder = 0
        group: list[list[int]] = []
        first: list[int] = []
        for batch, skipped in self._batches(skip_batches, skip_samples):
            if len(first) < self.num_shards * len(batch):
                first.extend(batch)
            if skipped:  # consumed before the checkpoint; still the start of the epoch for padding
                continue
            group.append(batch)
            # A group is whole when it has a batch for every shard, all as long as the first (only the very last
            # batch of a pass can be short: that group is evened out below, as the leftovers are).
            if len(group) == self.num_shards and (len(batch) == len(group[0]) or not self.even_batches):
                full = getattr(self.batch_sampler, "batch_size", None)
                if full is not None and len(batch) < full:  # the pass's last batch, short on every shard
                    self.last_remainder = sum(len(b) for b in group)
                yield group[self.shard_index]
                group = []
        if group and not self.drop_last and not self.even_batches:  # as they come: a short batch, or none
            self.last_remainder = sum(len(b) for b in group)
            if len(group) < self.num_shards and self.lockstep:
                raise ValueError(uneven_refusal(len(group), self.num_shards, self.lockstep))
            if self.shard_index < len(group):
                yield group[self.shard_index]
        elif group and not self.drop_last:
            rest = [i for b in group for i in b]
            self.last_remainder = len(rest)
            per_shard = math.ceil(len(rest) / self.num_shards)
            needed = per_shard * self.num_shards - len(rest)
            rest += [first[i % len(first)] for i in range(needed)]
            yield rest[self.shard_index * per_shard:(self.shard_index + 1) * per_shard]

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.drop_last:
            return n // self.num_shards
        if not self.even_batches:
            return n // self.num_shards + (self.shard_index < n % self.num_shards)
        return math.ceil(n / self.num_shards)


class _Unbatched(Sampler[int]):
    """The single index of each one-index batch of a sharded sampler (for DataLoaders with ``batch_size=None``)."""

    def __init__(self, shard: ShardedBatchSampler) -> None:
        self.shard = shard

    def __iter__(self) -> Iterator[int]:
        return (batch[0] for batch in self.shard)

    def __len__(self) -> int:
        return len(self.shard)


class IterableDatasetShard(IterableDataset):
    """This shard's part of each run of ``num_shards * batch_size`` samples of an iterable dataset.

    A worker process iterates its own copy of this object, and a persistent one keeps that copy from pass to pass,
    so what changes per pass -- the epoch, where the pass starts, the real samples of its last batch -- lives in a
    small tensor in shared memory (`_pass`) that the main process and the worker both read and write.
    """

    def __init__(self, dataset: IterableDataset, batch_size: int, num_shards: int, shard_index: int,
                 drop_last: bool, even_batches: bool = True) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.lockstep = ""  # as `ShardedBatchSampler.lockstep`
        self._pass = torch.zeros(3, dtype=torch.long)  # epoch, samples of the pass consumed before it starts, remainder

    @property
    def last_remainder(self) -> int:
        """Real samples of the last pass's final global batch, when it was not whole (0 otherwise)."""
        return int(self._pass[2])

    def set_epoch(self, epoch: int) -> None:
        self._pass[0] = epoch

    def begin_pass(self, start_samples: int = 0) -> None:
        """Where the pass about to be iterated starts (samples consumed before a checkpoint); it holds for every
        `__iter__` until the next `begin_pass`. Called in the main process before the DataLoader's iterator is made,
        which is when (or, with persistent workers, before) a worker process reads it."""
        if not self._pass.is_shared():  # made shared lazily: an unpickled copy has a private one
            self._pass.share_memory_()
        self._pass[1], self._pass[2] = start_samples, 0

    def __len__(self) -> int:
        """Samples this shard yields per pass (needs a dataset with a length)."""
        n = len(self.dataset)  # TypeError for datasets of unknown length, as DataLoader would raise
        run = self.num_shards * self.batch_size
        rest = n % run
        return n // run * self.batch_size + (0 if self.drop_last else math.ceil(rest / self.num_shards))

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = int(self._pass[0]), int(self._pass[1])
        if hasattr(self.dataset, "set_epoch"):  # here, in the process that iterates the dataset
            self.dataset.set_epoch(epoch)
        return self._samples(skip)

    def _samples(self, skip: int) -> Iterator[Any]:
        self._pass[2] = 0
        run = self.num_shards * self.batch_size
        first: list[Any] = []
        buffer: list[Any] = []
        lo, hi = self.shard_index * self.batch_size, (self.shard_index + 1) * self.batch_size
        for i, sample in enumerate(self.dataset):
            if len(first) < run:
                first.append(sample)
            if i < skip:  # consumed before the checkpoint
                continue
            buffer.append(sample)
            if len(buffer) == run:
                yield from buffer[lo:hi]
                buffer = []
        if buffer and not self.drop_last and not self.even_batches:  # as they come: a short batch, or none
            self._pass[2] = len(buffer)
            holding = -(-len(buffer) // self.batch_size)
            if holding < self.num_shards and self.lockstep:
                raise ValueError(uneven_refusal(holding, self.num_shards, self.lockstep))
            yield from buffer[lo:hi]
        elif buffer and not self.drop_last:
            self._pass[2] = len(buffer)
            per_shard = math.ceil(len(buffer) / self.num_shards)
            needed = per_shard * self.num_shards - len(buffer)
            buffer += [first[i % len(first)] for i in range(needed)]
            yield from buffer[self.shard_index * per_shard:(self.shard_index + 1) * per_shard]


def move_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return type(obj)({k: move_to_device(v, device, non_blocking) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(move_to_device(v, device, non_blocking) for v in obj)
    return obj


_LOADER_KWARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                  "generator", "persistent_workers")


def _batch_sizes(loader: DataLoader, split_batches: bool, num_shards: int) -> tuple[int | None, int | None]:
    """(the loader's batch size when it is fixed, the batch size of this rank's batches).

    Progress through a pass is counted in samples when batches have a fixed size (then a position means the same under
    any data-parallel size and batch size), else in original batches. The size is fixed when the loader has a
    batch_size or was given a torch BatchSampler (``DataLoader(batch_sampler=BatchSampler(s, B, d))`` batches as
    ``DataLoader(sampler=s, batch_size=B, drop_last=d)`` does); not for another batch sampler, or batch_size=None (no
    batching). With split_batches each rank's batches are 1/D of it."""
    fixed = loader.batch_size
    if fixed is None and type(loader.batch_sampler) is BatchSampler:
        fixed = loader.batch_sampler.batch_size
    if not split_batches:
        return fixed, fixed
    if fixed is None and loader.batch_sampler is not None:
        raise ValueError(f"prepare(): split_batches=True needs batches of a fixed size to split, and this "
                         f"DataLoader's batch_sampler ({type(loader.batch_sampler).__name__}) has none; give it a "
                         "batch_size (or a torch BatchSampler)")
    if fixed is None:
        return None, None
    if fixed % num_shards:
        raise ValueError(f"prepare(): split_batches=True needs a batch_size divisible by the {num_shards} "
                         f"ranks with distinct samples (the batch view); got batch_size={fixed}")
    return fixed, fixed // num_shards


def _sharded(loader: DataLoader, fixed: int | None, batch_size: int | None, num_shards: int, shard_index: int,
             seed: int, even_batches: bool, check_sampler: Callable[[Any], None]) -> tuple[Any, DataLoader]:
    """(this rank's shard of the data, the DataLoader that reads it), one of three ways: an iterable dataset's batches
    dealt over the shards; a map-style dataset without batching (batch_size=None) by items; else by batches of the
    loader's batch sampler (re-batched at batch_size with split_batches)."""
    kwargs = {k: getattr(loader, k) for k in _LOADER_KWARGS}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        if batch_size is None:
            raise ValueError("prepare(): an iterable dataset's DataLoader needs a batch_size to shard batches")
        if loader.num_workers > 1:
            raise ValueError(
                f"prepare(): num_workers={loader.num_workers} with an iterable dataset: each worker would read "
                "the whole dataset and yield every sample again; use num_workers=0 or 1"
            )
        shard = IterableDatasetShard(loader.dataset, batch_size, num_shards, shard_index, loader.drop_last,
                                     even_batches)
        return shard, DataLoader(shard, batch_size=batch_size, drop_last=False, **kwargs)
    if loader.batch_sampler is None:  # batch_size=None: the dataset yields whole batches: shard the items
        check_sampler(loader.sampler)
        single = BatchSampler(loader.sampler, 1, drop_last=False)
        shard = ShardedBatchSampler(single, num_shards, shard_index, False, seed, even_batches)
        return shard, DataLoader(loader.dataset, sampler=_Unbatched(shard), batch_size=None, **kwargs)
    batch_sampler = loader.batch_sampler
    check_sampler(getattr(batch_sampler, "sampler", None))
    drop_last = getattr(batch_sampler, "drop_last", False)
    if batch_size != fixed:  # split_batches: batches of B/D, taken D at a time
        batch_sampler = BatchSampler(batch_sampler.sampler, batch_size, drop_last)
    shard = ShardedBatchSampler(batch_sampler, num_shards, shard_index, drop_last, seed, even_batches)
    return shard, DataLoader(loader.dataset, batch_sampler=shard, **kwargs)


class PreparedDataLoader:
    """A data loader that yields this rank's share of each global batch, on this rank's device.

    It also reads one gradient-accumulation window of batches ahead to tell the Accelerator where windows end
    and how many loss tokens each batch and window hold (see `ndparallel.training.loss`). Attributes it does not define
    are looked up on the wrapped `torch.utils.data.DataLoader`.
    """

    def __init__(self, loader: DataLoader, *, num_shards: int, shard_index: int, seed: int,
                 device: torch.device, put_on_device: bool, window: int, window_group: dist.ProcessGroup | None,
                 gradient_state: GradientState | None = None,
                 local_count: Callable[[Any], int | None] | None = None, split_batches: bool = False,
                 even_batches: bool = True, non_blocking: bool = False,
                 sequence_plan: Callable[[Any], Any] | None = None, lockstep: str = "") -> None:
        self.base_loader = loader
        self.device = device  # this rank's device: batches go there (if put_on_device), token counts always
        self.put_on_device = put_on_device
        self.non_blocking = non_blocking
        self.window = window
        # Ranks with distinct samples (None: this rank alone). With uneven batches ranks may run different numbers
        # of steps, so nothing is agreed on per window (and token counts stay unknown: see the module docstring).
        self._window_group = window_group
        self.gradient_state = gradient_state  # told which batch is current, while this loader is iterated
        # Loss tokens this rank's model sees in a batch, when it sees only part of each sequence (context/sequence
        # parallelism: `SequenceSharding.count_loss_tokens`); None: the whole batch. Window totals always count whole
        # sequences.
        self.local_count = local_count
        # The sequence shards of each batch when they depend on the batch (`SequenceSharding.plan`: packed rows
        # dealt over cp by attention work); given to maybe_context_parallel through the gradient state.
        self.sequence_plan = sequence_plan
        self.epoch = 0
        self.seed = seed
        self.shard_index = shard_index
        # Progress through the current pass, for checkpoints: in samples when batches have a fixed size (then a
        # position means the same under any data-parallel size and batch size), else in original batches.
        # The loader's batch size when it is fixed: its batch_size, or that of a torch BatchSampler it was given
        # (``DataLoader(batch_sampler=BatchSampler(s, B, d))`` batches as ``DataLoader(sampler=s, batch_size=B,
        # drop_last=d)`` does); None for another batch sampler, or batch_size=None (no batching).
        fixed, batch_size = _batch_sizes(loader, split_batches, num_shards)
        self.position_unit = "samples" if fixed is not None else "batches"
        self._batch_size = batch_size  # of the sharded batch sampler: the loader's, or its 1/D with split_batches
        self._step = num_shards * (batch_size or 1)  # units one micro-step consumes, over all batch ranks
        self._position = 0
        self._finished = False  # the caller holds the pass's last batch: what follows is the next pass
        # Where the next pass starts: `_restored` (load_state_dict) belongs to the restored epoch, `self.epoch`, and
        # set_epoch to another drops it; `_skip` (skip_first_batches) holds for the next pass whatever its epoch (the
        # Trainer skips, then sets the epoch) and replaces `_restored`.
        self._restored = 0
        self._skip: int | None = None
        self._jump = False  # `continue_at` moved the position: the pass under way restarts there
        self._shard, self.loader = _sharded(loader, fixed, batch_size, num_shards, shard_index, seed, even_batches,
                                            self._check_sampler)
        # Why every rank must run every step (FSDP2, tp, cp, sp, pp: collectives in every forward), if it must: an
        # uneven last batch (even_batches=False) is then refused on every rank before any of them runs it.
        self._shard.lockstep = lockstep

    # ---- Accelerate's surface: even_batches (join_uneven_inputs overrides it), batch_sampler ----------------------
    @property
    def even_batches(self) -> bool:
        return self._shard.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._shard.even_batches = bool(value)

    @property
    def units_per_batch(self) -> int:
        """How far one batch of this rank moves `state_dict`'s position (in `position_unit`s: over every batch rank)."""
        return self._step

    @property
    def iterable(self) -> bool:
        """Whether the dataset is an iterable one (its samples are sharded as they come, not through a sampler)."""
        return isinstance(self._shard, IterableDatasetShard)

    @property
    def window_group(self) -> dist.ProcessGroup | None:
        return self._window_group if self.even_batches else None

    @property
    def batch_sampler(self) -> Any:
        """This rank's batch sampler (`ShardedBatchSampler`, with Accelerate's ``even_batches``); an iterable dataset's
        loader has torch's."""
        return self.loader.batch_sampler if self.iterable else self._shard

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_window_group"] = group_name(self._window_group)  # a process group travels by its name
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_window_group"] = resolve_group(state["_window_group"])
        self.__dict__.update(state)

    @staticmethod
    def _check_sampler(sampler: Any) -> None:
        if isinstance(sampler, DistributedSampler):
            raise ValueError(
                "prepare(): this DataLoader already uses a DistributedSampler; pass a plain DataLoader -- "
                "prepare() shards it along the mesh's `batch` view itself"
            )

    def skip_batches(self, num_batches: int) -> None:
        """Start the next pass at this rank's batch `num_batches` (Accelerate's `skip_first_batches`), whatever its
        epoch: counted from the start of the pass, so it replaces a position `load_state` restored rather than adding
        to it -- Accelerate's resume (``load_state``, then ``skip_first_batches`` with the batches the saved run had
        taken in its epoch) skips them once."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"skip_first_batches: num_batches must be an int >= 0, got {num_batches!r}")
        position = num_batches * self._step
        if self._restored and position != self._restored:
            warnings.warn(
                f"skip_first_batches({num_batches}): the next pass starts at batch {num_batches}, not where "
                f"load_state left this data loader (batch {self._restored / self._step:g} of epoch {self.epoch}); "
                "load_state restores the position by itself, so skip_first_batches is not needed after it",
                stacklevel=3)
        self._skip = position

    # ---- DataLoader-like surface -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` for the next pass (passes otherwise count 0, 1, 2, ...).

        After `load_state_dict`, the restored epoch keeps its restored position; another epoch starts afresh.
        """
        if epoch != self.epoch:
            self._restored = 0
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("base_loader", "loader"):
            raise AttributeError(name)
        return getattr(self.base_loader, name)

    @property
    def dataset(self) -> Any:
        return self.base_loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.base_loader.batch_size

    # ---- iteration -------------------------------------------------------------------------------------
    def _window_total(self, counts: list[int | None]) -> int | TokenTotal | None:
        """The window's loss tokens over the batch view: this rank's alone, or an all-reduce under way."""
        if any(c is None for c in counts):
            return None
        if self.window_group is None:
            return sum(counts)
        total = torch.tensor([sum(counts)], dtype=torch.long, device=self.device)
        return TokenTotal(total, dist.all_reduce(total, group=self.window_group, async_op=True))

    def __iter__(self) -> Iterator[Any]:
        if self.gradient_state is None:
            yield from self._batches()
            return
        self.gradient_state.enter(self)
        try:
            yield from self._batches()
        finally:  # also when the loop stops early (the generator is closed)
            self.gradient_state.leave(self)

    def _batches(self) -> Iterator[Any]:
        while (yield from self._pass()):  # a jump within the epoch (`continue_at`): the pass restarts there
            pass

    def _pass(self) -> Iterator[Any]:
        """One pass from `_next_start`; returns True when `continue_at` moved the position within its epoch."""
        epoch = self.epoch
        self._jump = False
        self._shard.set_epoch(self.epoch)
        self._position, self._finished = self._next_start(), False
        self._skip, self._restored = None, 0
        self._begin_pass(self._position)
        # DataLoader draws its workers' base seed at every pass; from a private generator (shuffling seed, epoch,
        # shard), that draw leaves the global torch RNG alone, so a resumed run's random stream (dropout) continues
        # exactly where the saved run's was.
        self.loader.generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.epoch * 1009 + self.shard_index) % 2**63)
        iterator = iter(self.loader)
        pending = next(iterator, _END)
        while pending is not _END:
            window = [pending]
            while len(window) < self.window and (pending := next(iterator, _END)) is not _END:
                window.append(pending)
            pending = next(iterator, _END) if len(window) == self.window else _END
            counts = [count_loss_tokens(b) if self.even_batches else None for b in window]
            total = self._window_total(counts)
            if self.local_count is not None and self.even_batches:
                counts = [self.local_count(b) for b in window]
            planned = [self.sequence_plan(b) if self.sequence_plan is not None else None for b in window]
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                end = last and pending is _END
                if self.gradient_state is not None:
                    self.gradient_state.on_batch(self, BatchInfo(
                        local_tokens=counts[i], window_tokens=total, window_batches=len(window), ends_window=last,
                        end_of_dataloader=end, remainder=self._shard.last_remainder if end else 0,
                        sequence_shards=planned[i]))
                self._position += self._step  # counted before the yield: the batch is the caller's now
                self._finished = end
                yield (move_to_device(batch, self.device, self.non_blocking or self.loader.pin_memory)
                       if self.put_on_device else batch)
                if self._jump:  # the window read ahead is dropped: the next batch is the one at the new position
                    return self.epoch == epoch  # in a later epoch: this pass ends, the next starts there
        self.epoch += 1
        self._position, self._finished = 0, False
        return False

    # ---- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch and position in it, in units that do not depend on the data-parallel size (see `__init__`). Once the
        caller holds the pass's last batch (a loop that saves after its epoch's last step), what follows is the
        next epoch from its start, as in the run that goes on: a resumed loop that counts its own epochs starts
        that one, not an empty rest of the finished one."""
        epoch, position = (self.epoch + 1, 0) if self._finished else (self.epoch, self._next_start() or self._position)
        return {"epoch": epoch, "position": position, "unit": self.position_unit,
                "batch_size": self.base_loader.batch_size, "num_shards": self._shard.num_shards,
                "seed": self.seed, "dataset_length": self._dataset_length()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position: the next pass skips what was consumed, also under another
        data-parallel size or batch size (then exact when the position is a multiple of the new batch size, as
        it is when the global batch is kept)."""
        if state["unit"] != self.position_unit:
            raise ValueError(
                f"data loader position was saved in {state['unit']} (batch_size={state['batch_size']}) but this "
                f"loader counts {self.position_unit} (batch_size={self.base_loader.batch_size}); resume with the "
                "same kind of batching")
        length = self._dataset_length()
        if None not in (length, state.get("dataset_length")) and length != state["dataset_length"]:
            warnings.warn(f"resuming a data loader over {length} samples from a checkpoint of one over "
                          f"{state['dataset_length']}: the position may not mean the same samples", stacklevel=2)
        position, batch_size = int(state["position"]), self._batch_size
        if (position and self.position_unit == "samples" and isinstance(self._shard, ShardedBatchSampler)
                and position % batch_size and not hasattr(self._shard.batch_sampler, "sampler")):
            raise ValueError(
                f"cannot resume at sample {position}: it is not a multiple of batch_size={batch_size} and the batch "
                "sampler has no `sampler` to re-batch")
        self.epoch = int(state["epoch"])
        if state.get("seed") is not None:  # the shuffling order of the saved run, whatever seeds are set now
            self.seed = int(state["seed"])
            if isinstance(self._shard, ShardedBatchSampler):
                self._shard.seed = self.seed
        self._restored, self._skip = position, None

    def continue_at(self, state: dict[str, Any]) -> None:
        """Go on from `state` (another replica group's `state_dict`, `ndparallel.fault_tolerance`): the next batch
        drawn is the one that follows it, also in the middle of a pass -- the pass restarts at that position, or
        ends when `state` is in a later epoch (the next pass then starts there)."""
        self.load_state_dict(state)
        self._jump = True

    def _dataset_length(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:  # an iterable dataset of unknown length
            return None

    def _next_start(self) -> int:
        """Where the next pass starts, in units of `position_unit`."""
        return self._skip if self._skip is not None else self._restored

    def _begin_pass(self, position: int) -> None:
        """Tell the shard where the pass starts: whole original batches when possible, else samples to re-batch."""
        if isinstance(self._shard, IterableDatasetShard) or self.position_unit == "batches":
            self._shard.begin_pass(position)
        elif position % self._batch_size == 0:
            self._shard.begin_pass(position // self._batch_size)
        else:
            self._shard.begin_pass(0, position)


_END = object()
