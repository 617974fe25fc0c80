"""Exact resume of prepared data loaders under every loader setting, worker processes included (no processes of
our own: each rank's loader is built as prepare() builds it, the ranks of `batch` side by side in this process).

A reference run iterates two epochs and takes rank 0's loader state (what save_state writes) at four points:
mid-epoch 0, after the last batch of epoch 0 (inside the loop), after epoch 0's loop ended, and mid-epoch 1. Fresh
loaders loaded with each state, iterated by a loop that counts its epochs from the steps taken, yield exactly the
reference's batches from that point to the end of epoch 1: nothing replayed, nothing skipped, the next epoch as it
would have been. ``skip_first_batches`` as the Trainer calls it (fresh
loaders, skip, then ``set_epoch(1)``) yields the rest of epoch 1. The reference itself is checked against the same
loader without worker processes, so a worker path that went wrong in both runs alike would still fail.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from ndparallel.training.data import PreparedDataLoader
from ndparallel.training.loader_types import prepared_loader_class

N = 26  # samples: not a multiple of the global batch, so the last one is evened out (or dropped)
MID = 2  # steps taken before the mid-epoch states


class EpochShuffled(IterableDataset):
    """An iterable dataset whose order depends on its epoch (as a streaming dataset's shuffle buffer does): a worker
    that never heard of the new epoch would repeat the old order."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(100 + self.epoch))
        return iter(order.tolist())


class Batches(torch.utils.data.Dataset):
    """Items that are whole batches (for ``batch_size=None``)."""

    def __len__(self) -> int:
        return N // 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([2 * i, 2 * i + 1])


# id -> (DataLoader kwargs, PreparedDataLoader kwargs); "shards": ranks of `batch`; "stateful": the class prepare() makes
# with use_stateful_dataloader=True. Workers cost 0.1-0.5 s per pass each (persistent ones: once), so the settings
# with workers are chosen to reach each of torch's iterator paths (one worker, several, persistent, prefetching)
# under each of the prepared loader's ways of sharding.
SETTINGS: dict[str, tuple[dict, dict]] = {
    "map_shuffle": (dict(shuffle=True), dict(shards=2)),
    "map_shuffle_w1": (dict(shuffle=True, num_workers=1), dict(shards=1)),
    "map_shuffle_w2": (dict(shuffle=True, num_workers=2), dict(shards=2)),
    "map_shuffle_w2_persistent_prefetch1": (dict(shuffle=True, num_workers=2, persistent_workers=True,
                                                 prefetch_factor=1), dict(shards=2, window=2)),
    "map_ordered_w2_persistent_drop_last": (dict(num_workers=2, persistent_workers=True, drop_last=True),
                                            dict(shards=2)),
    "map_shuffle_w2_persistent_split_batches": (dict(shuffle=True, num_workers=2, persistent_workers=True,
                                                     prefetch_factor=4), dict(shards=2, split_batches=True)),
    "map_shuffle_w2_persistent_uneven": (dict(shuffle=True, num_workers=2, persistent_workers=True),
                                         dict(shards=2, even_batches=False)),
    "map_shuffle_w2_pin_memory": (dict(shuffle=True, num_workers=2, pin_memory=True), dict(shards=2)),
    "map_batch_sampler_w2_persistent": (dict(batch_sampler="custom", num_workers=2, persistent_workers=True),
                                        dict(shards=2)),
    "map_batch_size_none_w2": (dict(batch_size=None, num_workers=2), dict(shards=2)),
    "stateful_shuffle_w2_persistent": (dict(shuffle=True, num_workers=2, persistent_workers=True),
                                       dict(shards=2, stateful=True)),
    "iterable": (dict(iterable=True), dict(shards=2)),
    "iterable_w1": (dict(iterable=True, num_workers=1), dict(shards=2)),
    "iterable_w1_persistent": (dict(iterable=True, num_workers=1, persistent_workers=True), dict(shards=2)),
    "iterable_w1_persistent_drop_last": (dict(iterable=True, num_workers=1, persistent_workers=True, drop_last=True),
                                         dict(shards=1)),
}


def build(setting: dict, options: dict, shard: int, *, workers: bool = True) -> PreparedDataLoader:
    """Rank `shard`'s prepared loader of `setting` (without worker processes when not `workers`)."""
    kwargs = dict(setting)
    iterable = kwargs.pop("iterable", False)
    if not workers:
        for key in ("num_workers", "persistent_workers", "prefetch_factor"):
            kwargs.pop(key, None)
    if kwargs.get("batch_size", 3) is None:
        dataset: Any = Batches()
    elif iterable:
        dataset = EpochShuffled()
    else:
        dataset = list(range(N))
    if kwargs.get("batch_sampler") == "custom":  # a batch sampler of no fixed size: positions count batches
        kwargs["batch_sampler"] = list(BatchSampler(SequentialSampler(range(N)), 3, drop_last=False))
    elif "batch_size" not in kwargs:
        kwargs["batch_size"] = 6 if options.get("split_batches") else 3
    options = dict(options)
    cls = prepared_loader_class(options.pop("stateful", False))
    shards = options.pop("shards")
    return cls(DataLoader(dataset, **kwargs), num_shards=shards, shard_index=shard, seed=7,
               device=torch.device("cpu"), put_on_device=False, window=options.pop("window", 1), window_group=None,
               **options)


def ranks(name: str, *, workers: bool = True) -> list[PreparedDataLoader]:
    setting, options = SETTINGS[name]
    return [build(setting, options, shard, workers=workers) for shard in range(options["shards"])]


Step = tuple  # one global step: each rank's batch (None: that rank has none), as lists


def one_pass(loaders: list[PreparedDataLoader], at_step: Any = None) -> list[Step]:
    """One pass of every rank's loader, side by side; `at_step(i)` is called after step i is taken."""
    steps: list[Step] = []
    iterators = [iter(loader) for loader in loaders]
    for batches in itertools.zip_longest(*iterators):
        steps.append(tuple(None if b is None else b.tolist() for b in batches))
        if at_step is not None:
            at_step(len(steps) - 1)
    return steps


def reference(name: str, *, workers: bool = True) -> tuple[list[Step], dict[str, tuple[int, dict]], int]:
    """Two epochs' steps, the states (steps taken before, rank 0's state_dict) at the four points, epoch 0's length."""
    loaders = ranks(name, workers=workers)
    states: dict[str, tuple[int, dict]] = {}
    seen: list[Step] = []

    def take(point: str, done: int) -> None:
        state = loaders[0].state_dict()
        states[point] = (done, state)

    epoch0 = one_pass(loaders, lambda i: (take("mid_epoch", i + 1) if i + 1 == MID else None,
                                          take("end_of_epoch_inside_the_loop", i + 1)))
    seen += epoch0
    take("after_the_epoch", len(seen))
    seen += one_pass(loaders, lambda i: take("mid_next_epoch", len(epoch0) + i + 1) if i + 1 == MID else None)
    return seen, states, len(epoch0)


_references: dict[str, tuple] = {}
# pin_memory needs an accelerator (on a CPU-only machine torch turns it off with a warning: nothing to test there)
NAMES = [pytest.param(name, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs CUDA"))
         if SETTINGS[name][0].get("pin_memory") else name for name in SETTINGS]


def cached_reference(name: str) -> tuple[list[Step], dict[str, tuple[int, dict]], int]:
    if name not in _references:
        _references[name] = reference(name)
    return _references[name]


def test_the_table_reaches_every_resume_point():
    """The states are where the docstring says (so the table below tests what it claims)."""
    seen, states, epoch0 = reference("map_shuffle")
    assert epoch0 == 5 and len(seen) == 10  # 26 samples in global batches of 6: 4 whole, 1 evened out
    assert {p: (done, s["epoch"], s["position"]) for p, (done, s) in states.items()} == {
        "mid_epoch": (2, 0, 12), "end_of_epoch_inside_the_loop": (5, 1, 0), "after_the_epoch": (5, 1, 0),
        "mid_next_epoch": (7, 1, 12)}


@pytest.mark.parametrize("name", NAMES)
def test_a_resumed_loader_continues_the_uninterrupted_run(name):
    seen, states, epoch0 = cached_reference(name)
    if SETTINGS[name][0].get("num_workers"):  # worker processes deliver what the main process would
        assert seen == reference(name, workers=False)[0]
    shuffled = SETTINGS[name][0].get("shuffle") or SETTINGS[name][0].get("iterable")
    assert (seen[epoch0:] != seen[:epoch0]) == bool(shuffled)  # a new order each epoch, where there is one
    for point, (done, state) in states.items():
        loaders = ranks(name)
        for loader in loaders:
            loader.load_state_dict(state)
        resumed: list[Step] = []
        for _ in range(done // epoch0, 2):  # a loop that counts its epochs (Accelerate's examples: steps taken //
            resumed += one_pass(loaders)  # steps per epoch), to the end of epoch 1
        assert resumed == seen[done:], f"{name}, resumed {point}"


@pytest.mark.parametrize("name", NAMES)
def test_skip_first_batches_then_set_epoch_continues_that_epoch(name):
    """The Trainer's resume: fresh loaders, skip_first_batches(MID), then set_epoch(1): the rest of epoch 1."""
    seen, _, epoch0 = cached_reference(name)
    loaders = ranks(name)
    for loader in loaders:
        loader.skip_batches(MID)
        loader.set_epoch(1)
    assert one_pass(loaders) == seen[epoch0 + MID:]
    assert one_pass(loaders) != seen[epoch0 + MID:]  # the skip was for that pass only


def test_accelerates_resume_idiom_skips_once():
    """Accelerate's examples call load_state, then skip_first_batches with the batches taken in the epoch: the position
    load_state restored is the same one, not skipped twice (at an epoch's end too). Another number wins, with a
    warning."""
    seen, states, epoch0 = cached_reference("map_shuffle")
    done, state = states["mid_next_epoch"]
    loaders = ranks("map_shuffle")
    for loader in loaders:
        loader.load_state_dict(state)
        loader.skip_batches(MID)
    assert one_pass(loaders) == seen[done:]
    loaders = ranks("map_shuffle")
    for loader in loaders:
        loader.load_state_dict(state)
        with pytest.warns(UserWarning, match=r"skip_first_batches\(1\): the next pass starts at batch 1, not where "
                                             r"load_state left this data loader \(batch 2 of epoch 1\)"):
            loader.skip_batches(1)
    assert one_pass(loaders) == seen[epoch0 + 1:]
    # Saved after the epoch's last step: the example's loop starts the next epoch and skips 0 batches of it
    done, state = states["end_of_epoch_inside_the_loop"]
    loaders = ranks("map_shuffle")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loader in loaders:
            loader.load_state_dict(state)
            loader.skip_batches(done - done // epoch0 * epoch0)
    assert one_pass(loaders) == seen[epoch0:]
