"""This process's replica group as one participant of torchft's fault-tolerant data parallelism.

The job's replicated axis (``dp_replicate_size`` = R) is R replica groups, each a torch.distributed job of its own
(its mesh has ``dp_replicate = 1``; FSDP2, TP, CP, SP run inside it as usual). Across groups only torchft talks: a
`torchft.Manager` per group agrees with the lighthouse on which groups take part in each step (the quorum), averages
the gradients over them, and lets a group that joins late take the live state from one that is up to date.

A step under faults, top to bottom (`ndparallel.Accelerator` calls each part):

1. the first training forward of a step (`start_step`, a forward pre-hook on each prepared model) snapshots where
   this group's data loaders are and starts the quorum in the background;
2. backward, at the micro-step that synchronises gradients (`average_gradients`): every gradient (this rank's local
   shard) is summed over the groups of the quorum and divided by their number. A group that is healing (it joined
   late and is fetching the live state) contributes zeros and is not counted;
3. ``optimizer.step()`` asks `should_commit`: a group that healed loads the fetched state first (parameters,
   optimizer and scheduler state, objects registered for checkpointing, RNG, data position), then every group of the quorum steps with the same averaged
   gradients, so all of them hold the same parameters afterwards. A step that lost a group half-way (its all-reduce
   failed) or has fewer than ``min_replicas`` groups is not committed: no group steps, the batch is dropped, the next
   step forms a new quorum without the dead group.

Each step appends one record to `records` (and to the participation log, one JSON line per step, from each group's
first rank): the step, whether this group took part, how many groups did, whether it was committed, the data
position of the batch and this rank's loss. The records of all groups together say which groups' batches made up
each update, which is what a one-process replay needs (tests/fault_tolerance).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .settings import JOIN_TIMEOUT, START_STORE_ENV, FaultToleranceKwargs

if TYPE_CHECKING:
    from ..training.prepared import PreparedObjects


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Empty:
    """An empty local shard in transit (torch's streaming load, which torchft's transport uses, cannot read a
    storage of zero bytes; a rank whose shard of a small parameter is empty has them)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def _send(value: Any) -> Any:
    """A value of the live state as it travels: a local tensor, detached (an empty one as `_Empty`)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = _local(value).detach()
    return _Empty(value) if value.numel() == 0 else value


def _received(value: Any) -> Any:
    return value.tensor() if isinstance(value, _Empty) else value


def require_torchft() -> Any:
    try:
        import torchft
    except ImportError:
        raise ImportError("fault tolerance runs on torchft, which is not installed: pip install torchft==0.2.0 "
                          "(or pip install 'ndparallel[ft]')") from None
    return torchft


class ReplicaGroups:
    """torchft's manager for this process, and the hooks that make a prepared training loop fault tolerant."""

    def __init__(self, settings: FaultToleranceKwargs, prepared: PreparedObjects, device: torch.device,
                 group_rank: int, group_size: int) -> None:
        torchft = require_torchft()
        from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

        self.settings = settings
        self.prepared = prepared
        self.group_rank = group_rank
        timeout = timedelta(seconds=settings.timeout)
        pg = ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else ProcessGroupBabyNCCL(timeout=timeout)
        # replica_id ends in the group's number: torchft derives global ranks from its trailing digits.
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replicas, timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout), rank=group_rank, world_size=group_size,
            replica_id=f"ndparallel_replica_{settings.replica_id}", lighthouse_addr=settings.lighthouse,
            # No healing at the first step: torchft would pick the source group rank by rank, so the groups'
            # shards would each take part from another group. The groups must start alike instead, which the
            # first step checks (`_check_same_start`); a group that joins later heals as a whole.
            init_sync=False)
        self.manager.register_state_dict_fn("ndparallel", self._load_live_state, self._live_state)
        self._meet_every_group()
        self.records: list[dict[str, Any]] = []
        # What else a step changes, by name: (state, load) -- the Trainer's counters and LR scheduler
        # (`integrations.trainer_faults`). A healing group loads each after the prepared objects.
        self._more_state: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.positions_taken: list[dict[str, Any]] = []  # the data positions of the live state last loaded
        self._log = None
        directory = settings.participation_log
        if directory and group_rank == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._log = Path(directory) / f"replica_{settings.replica_id}.jsonl"
        self._in_step = False  # a quorum was started for the step under way
        self._first_step = True
        self._quorums = 0  # quorums started by this process
        self._positions: list[dict[str, Any]] = []  # the data loaders' states when the step began
        self._loss: torch.Tensor | None = None
        self._contributors: torch.Tensor | None = None  # the groups in this step's gradient average (on the device)
        self._started = 0.0

    def _meet_every_group(self) -> None:
        """At the job's start, wait (up to `JOIN_TIMEOUT`) until every group's manager is up. torchft's lighthouse
        makes the first quorum wait only for the groups it has heard from, so a group that is slower to start (a
        loaded machine, a longer import) would find the others trained on alone, each from its own start. The
        groups meet in the launcher's store (``ndparallel launch --fault-tolerant``; groups started by hand do not
        wait); a restarted group joins the running job instead, and the other ranks of a group wait in its quorum."""
        address = os.environ.get(START_STORE_ENV)
        if not address or self.group_rank != 0 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
            return
        from torch.distributed import TCPStore

        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=JOIN_TIMEOUT))
        store.add("groups_started", 1)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while store.add("groups_started", 0) < self.settings.replicas and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---- 1. the step begins ----------------------------------------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Start each step's quorum at the model's first training forward of the step (not in evaluation)."""
        def pre_hook(module: nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.start_step()
        model.register_forward_pre_hook(pre_hook)

    def start_step(self) -> None:
        if self._in_step:
            return
        self._in_step = True
        self._started = time.monotonic()
        # The batch of this step is drawn already: a group that heals from this one continues after it.
        self._positions = [loader.state_dict() for loader in self.prepared.dataloaders]
        self.manager.start_quorum()
        self._quorums += 1

    # ---- 2. gradients averaged over the groups that take part ------------------------------------------------------
    def average_gradients(self, models: list[nn.Module], loss: torch.Tensor | None = None) -> None:
        """Sum every local gradient over the quorum's groups and divide by their number (a healing group sends zeros
        and receives the average). One all-reduce per dtype, of all gradients flattened."""
        self.start_step()  # a loop whose model ran no training forward this step (or not through the hook)
        if loss is not None:
            self._loss = loss.detach()
        from torch.distributed import ReduceOp

        params = [p for model in models for p in model.parameters() if p.requires_grad]
        if self._first_step:  # this process's first step: is the job starting, or is this group joining late?
            self._first_step = False
            self.manager.wait_quorum()  # a group that heals is at the live step from here on
            if self.manager.current_step() == 0:
                self._refuse_a_lonely_restart()
                self._check_same_start(params)
        for p in params:
            if p.grad is None:  # every group sends buffers of the same size
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            grad = _local(p.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            # One more element, 1: torchft zeroes the whole buffer of a group that does not take part, so after the
            # sum it counts the groups whose gradients are in it (torchft's own count also holds a group that heals
            # at the first step, whose zeros would then halve the average).
            one = torch.ones(1, dtype=grads[0].dtype, device=grads[0].device)
            flat = torch.cat([*(g.reshape(-1) for g in grads), one])
            work = self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)
            try:
                work.wait()
            except Exception as exc:  # the step is given up (not committed); the next quorum leaves the failed out
                self.manager.report_error(exc)
                continue
            self._contributors = flat[-1:].clone()
            flat /= self._contributors.clamp(min=1)  # on the device: no host sync
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _refuse_a_lonely_restart(self) -> None:
        """A group that torchrun restarted and whose first quorum holds no other group has no live state to take:
        it would train alone from its initial parameters while the others' progress is gone. It stops instead."""
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts and self.settings.replicas > 1 and self.manager.num_participants() <= 1:
            raise RuntimeError(
                f"fault tolerance: replica group {self.settings.replica_id} was restarted ({restarts} time(s)) but "
                "found no live replica group to take the state from (the others have finished or failed); it stops "
                "rather than train alone from its initial parameters. Resume the job from its last checkpoint "
                "(accelerator.load_state) if the others did not finish")

    def _check_same_start(self, params: list[torch.Tensor]) -> None:
        """At the job's first step: every group must hold the same parameters (bit for bit), or their average would
        mean nothing. A digest of this rank's shards, summed over the groups, must be the number of groups times
        this rank's own; raises on every rank otherwise."""
        from torch.distributed import ReduceOp

        digest = torch.zeros((), dtype=torch.int64, device=params[0].device if params else "cpu")
        for i, p in enumerate(params):
            local = _local(p).detach().reshape(-1)
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
            digest += (local.view(bits).to(torch.int64) * (i + 1)).sum()  # wraps alike on every group
        both = torch.stack([digest, torch.ones((), dtype=torch.int64, device=digest.device)])
        work = self.manager.allreduce(both, reduce_op=ReduceOp.SUM)
        work.wait()
        if self.manager.errored() is None and int(both[0]) != int(both[1]) * int(digest):
            raise RuntimeError(
                f"fault tolerance: the {int(both[1])} replica groups start from different parameters (rank "
                f"{self.group_rank} of replica group {self.settings.replica_id} differs), so averaging their "
                "gradients would mean nothing; build the model the same way in every group -- seed it before "
                "building (ndparallel.utils.set_seed) or load the same weights")

    # ---- 3. commit, or give the step up ----------------------------------------------------------------------------
    def should_commit(self) -> bool:
        """Whether the optimizer steps (every group of the quorum answers alike); records the step."""
        self.start_step()
        self.manager.wait_quorum()
        participating = self.manager.is_participating()
        step = self.manager.current_step()
        committed = bool(self.manager.should_commit())  # a healing group loads the live state in here
        # the groups whose gradients the update averages (read after the commit, which waited for the device)
        participants = None if self._contributors is None else int(self._contributors.item())
        # position / epoch: where this group's (first) data loader stands once the step's batch is drawn
        record = {"step": step, "replica": self.settings.replica_id, "participating": participating,
                  "participants": participants, "committed": committed,
                  "position": self._positions[0]["position"] if self._positions else None,
                  "epoch": self._positions[0]["epoch"] if self._positions else None,
                  "loss": float(self._loss) if self._loss is not None else None,
                  "seconds": round(time.monotonic() - self._started, 4)}
        self.records.append(record)
        if self._log is not None:
            with self._log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        self._in_step, self._loss, self._contributors = False, None, None
        return committed

    # ---- checkpoints beside it ----------------------------------------------------------------------------------
    def writes_checkpoints(self) -> bool:
        """Whether this group writes `save_state`'s checkpoint: one group does, the first of those up to date in the
        current quorum (every group sees the same quorum); before the first step, group 0. The others hold the same
        state and skip the write, so no two groups write one directory."""
        if not self._quorums:
            return self.settings.replica_id == 0
        return self.manager.participating_rank() == 0

    # ---- the live state a healing group takes ----------------------------------------------------------------------
    def register_state(self, name: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Send `state()` with the live state under `name`; a healing group calls `load` with it (the same name
        must be registered in every group: a group that heals from one without it stops with an error)."""
        self._more_state[name] = (state, load)

    def _live_state(self) -> dict[str, Any]:
        """This rank's part of everything a step changes, as plain local tensors (torchft's transport sends it to the
        same rank of a healing group, whose parameters are sharded the same way)."""
        state: dict[str, Any] = {
            "models": [{name: _send(t) for name, t in _tensors(m)} for m in self.prepared.models],
            "optimizers": [_local_optimizer_state(o.state_dict()) for o in self.prepared.optimizers],
            "schedulers": [s.state_dict() for s in self.prepared.schedulers],
            "custom": [o.state_dict() for o in self.prepared.custom_objects],  # register_for_checkpointing
            "loaders": self._positions,
            "rng": torch.get_rng_state(),
            "more": {name: state() for name, (state, _) in self._more_state.items()},
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def _load_live_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for model, values in zip(self.prepared.models, state["models"]):
                for name, tensor in _tensors(model):
                    _local(tensor).copy_(_received(values[name]))
        for optimizer, saved in zip(self.prepared.optimizers, state["optimizers"]):
            optimizer.load_state_dict(_distributed_optimizer_state(saved, optimizer))
        for scheduler, saved in zip(self.prepared.schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        for obj, saved in zip(self.prepared.custom_objects, state["custom"]):
            obj.load_state_dict(saved)
        for loader, position in zip(self.prepared.dataloaders, state["loaders"]):
            loader.continue_at(position)
        self.positions_taken = state["loaders"]
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"])
        for name, (_, load) in self._more_state.items():
            if name not in state["more"]:
                raise RuntimeError(f"fault tolerance: replica group {self.settings.replica_id} heals from a group that "
                                   f"sends no {name!r} state; every group must run the same script")
            load(state["more"][name])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "state": {index: {key: _send(value) for key, value in values.items()}
                               for index, values in state["state"].items()}}


def _distributed_optimizer_state(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """`saved` (local tensors) with each tensor shaped like its parameter's local shard made a DTensor again, placed
    as the parameter is (scalars such as Adam's step stay plain)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def restore(index: int, value: Any) -> Any:
        param, value = params[int(index)], _received(value)
        if (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
                and value.shape == param.to_local().shape):
            return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        return value

    return {**saved, "state": {index: {key: restore(index, value) for key, value in values.items()}
                               for index, values in saved["state"].items()}}

