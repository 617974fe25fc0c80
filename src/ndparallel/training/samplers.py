"""Which samples each rank of the ``batch`` view reads: the sharded batch sampler and the iterable-dataset shard
that `ndparallel.training.data.PreparedDataLoader` drives.

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

Iterable datasets. Every rank iterates the whole dataset (it must yield the same order on every rank) and
keeps its share of each run of D*B samples, with the same end-of-data rule as above. At most one worker
process may read it (more would each yield every sample); what it must know of each pass (the epoch, where the pass
starts) and what the main process must learn (the real samples of the last batch) go through shared memory, so a
persistent worker follows the passes too."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler


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


class UnbatchedSampler(Sampler[int]):
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
