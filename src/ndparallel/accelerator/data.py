"""Data loaders and LR schedulers in `prepare`: part of `ndparallel.Accelerator`.

A data loader is sharded along the ``batch`` view (`ndparallel.training.data`) -- times the replica groups under
fault tolerance (`ndparallel.fault_tolerance`) --, an LR scheduler steps with its optimizer once per data-parallel
rank (`ndparallel.training.optim.AcceleratedScheduler`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ..configuration.plugins import DataLoaderConfiguration
from ..distributed.mesh import ParallelMesh
from ..fault_tolerance import ReplicaGroups
from ..parallel.sequence import SequenceSharding
from ..training.data import PreparedDataLoader
from ..training.loader_types import prepared_loader_class, shuffle_seed
from ..training.loss import GradientState
from ..training.optim import AcceleratedScheduler
from ..training.prepared import PreparedObjects


class DataMixin:
    """Part of `ndparallel.Accelerator`: `prepare` for data loaders and LR schedulers, `skip_first_batches`."""

    mesh: ParallelMesh
    prepared: PreparedObjects
    gradient_state: GradientState
    sequence_sharding: SequenceSharding | None
    replica_groups: ReplicaGroups | None
    dataloader_config: DataLoaderConfiguration
    device_placement: bool
    gradient_accumulation_steps: int
    step_scheduler_with_optimizer: bool
    split_batches: bool
    num_processes: int
    device: torch.device
    _settings: Any

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        """Shard `data_loader` along the ``batch`` view (`ndparallel.training.data`)."""
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        # One shuffling seed for every rank, rank 0's (`shuffle_seed`): ranks seeded differently (or not at all)
        # still draw one order.
        config = self.dataloader_config
        if config.dispatch_batches and isinstance(data_loader.dataset, torch.utils.data.IterableDataset):
            raise ValueError("prepare(): dispatch_batches=True with an iterable dataset is not supported: every rank "
                             "reads its own share, so the dataset must yield the same order on every rank (not "
                             "only on rank 0, which dispatching reads); make it so and set dispatch_batches=False")
        seed = shuffle_seed(data_loader, config.data_seed, self.device)
        shards, shard = self._batch_shards()
        sharding = self.sequence_sharding  # under CP/SP a rank's loss averages over its shard's tokens only
        prepared = prepared_loader_class(config.use_stateful_dataloader, bool(config.dispatch_batches))(
            data_loader, num_shards=shards, shard_index=shard,
            seed=seed, device=self.device,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            window=self.gradient_accumulation_steps,
            window_group=self.mesh.group("batch") if self.mesh.size("batch") > 1 else None,
            gradient_state=self.gradient_state,
            local_count=sharding.count_loss_tokens if sharding is not None else None,
            sequence_plan=sharding.plan if sharding is not None and sharding.balance_documents else None,
            split_batches=config.split_batches, even_batches=config.even_batches, non_blocking=config.non_blocking,
            lockstep=self._lockstep_reason(),
        )
        self.prepared.dataloaders.append(prepared)
        return prepared

    prepare_dataloader = prepare_data_loader

    def _batch_shards(self) -> tuple[int, int]:
        """How many ranks draw different samples, and which of them this rank is: the ``batch`` view, times the
        replica groups under fault tolerance (group g holds shards g*B .. g*B+B-1)."""
        size, rank = self.mesh.size("batch"), self.mesh.rank("batch")
        if self.replica_groups is None:
            return size, rank
        return size * self.replica_groups.settings.replicas, self.replica_groups.settings.replica_id * size + rank

    def _lockstep_reason(self) -> str:
        """Why every rank must run every step of a data loader (collectives in every forward), or "" under DDP (whose
        ranks can run uneven numbers of steps inside `join_uneven_inputs`) and on one process."""
        axes = (*self.mesh.config.non_dp_dim_names, "pp")  # the ranks that receive the same samples, and stages
        sizes = [f"{axis}_size={self.mesh.size(axis)}" for axis in axes if self.mesh.size(axis) > 1]
        reasons = [f"{' x '.join(sizes)} runs collectives in every forward"] if sizes else []
        if self._settings.fsdp and self.num_processes > 1:
            reasons.insert(0, "FSDP2 all-gathers the sharded parameters in every forward")
        return "; ".join(reasons)

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        optimizers = [o for o in self.prepared.optimizers if scheduler.optimizer in (o, o.optimizer)]
        if not optimizers:
            raise ValueError(
                "prepare(): the LR scheduler's optimizer has not been prepared; pass the optimizer to prepare() "
                "in the same call or before the scheduler"
            )
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state,
                                       step_with_optimizer=self.step_scheduler_with_optimizer,
                                       steps_per_update=1 if self.split_batches else self._batch_shards()[0],
                                       adjust_scheduler=self._settings.adjust_scheduler)
        self.prepared.schedulers.append(wrapped)
        return wrapped

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """`dataloader` with its next pass starting `num_batches` batches later (resuming mid-epoch by hand)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError("skip_first_batches takes a data loader returned by prepare(); prepare it first")
        dataloader.skip_batches(num_batches)
        return dataloader
