"""Sharding data loaders along the ``batch`` view.

Each rank of ``batch`` (dp_replicate x dp_shard) receives distinct samples; every rank of the other axes (cp,
sp, tp) receives exactly the samples of its ``batch`` coordinate -- which rank is which is asked of the mesh,
never computed from the global rank. Which samples each rank reads, pass by pass (D = size of ``batch`` consecutive
batches per global batch, the last uneven batch, shuffling, iterable datasets), is `ndparallel.training.samplers`;
this module wraps them in the prepared loader (what a step reads, its token counts, its position for resuming).

Options (Accelerate's `DataLoaderConfiguration`). ``split_batches=True``: the loader's batch is the global batch,
and each rank takes its 1/D of it (the batch size must divide by D) -- the samples the sharded sampler gives with
batches of B/D.
``even_batches=False``: the samples left at the end are not topped up; a rank may get a short batch or none. Ranks
then run different numbers of steps (DDP needs ``Accelerator.join_uneven_inputs``), so no window totals are agreed
on: the loss keeps Accelerate's meaning (1 / accumulation steps) for that loader. A DataLoader with ``batch_size=None``
(its dataset yields whole batches) gives each rank every D-th item.

Resuming. A pass starts where `load_state_dict` (the restored epoch only) or `skip_batches` (the next pass, whatever
its epoch) put it; the position is given to the sampler (or the iterable shard) for the whole pass, since torch's
DataLoader calls iter() on its batch sampler more than once per pass with worker processes, and the next pass
starts at its beginning. The samples a resumed pass yields are the uninterrupted pass's under every DataLoader
setting (worker processes, persistent or not, prefetching, pinned memory); random numbers drawn inside worker
processes (augmentations) start again with the resumed pass, so they are not the uninterrupted run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from .loss import BatchInfo, GradientState, TokenTotal, count_loss_tokens
from .samplers import IterableDatasetShard, ShardedBatchSampler, UnbatchedSampler
from ..distributed.runtime import group_name, resolve_group


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
        return shard, DataLoader(loader.dataset, sampler=UnbatchedSampler(shard), batch_size=None, **kwargs)
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
