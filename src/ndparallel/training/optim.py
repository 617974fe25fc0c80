"""Optimizer and LR-scheduler wrappers that respect gradient accumulation and the fp16 grad scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .loss import GradientState


def _kind(param: torch.Tensor) -> Any:
    """What a fused or foreach kernel call must not mix: plain tensors, and DTensors of each mesh."""
    return param.device_mesh if isinstance(param, DTensor) else None


def _uses_multi_tensor_kernels(group: dict[str, Any]) -> bool:
    """Whether torch's optimizer would update the group with fused or foreach kernels (its default picks foreach
    on GPUs when neither is given)."""
    if group.get("fused") or group.get("foreach"):
        return True
    return group.get("foreach", False) is None and not group.get("fused") and any(
        p.device.type != "cpu" for p in group["params"])


def switch_parameters(optimizer: torch.optim.Optimizer,
                      replaced: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """Point `optimizer` (a torch optimizer, not a wrapper) at new parameters: `replaced` maps ``id(old)`` to
    ``(old, new)``, new None for a parameter this rank no longer holds (dropped from its group). A replaced
    parameter's state moves to the new one when every state tensor fits it (same shape, both plain or both
    DTensors: the parameter moved or was re-created, not sharded), else the update would mix layouts: refused.
    Returns the number of parameters replaced."""
    count = 0
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            entry = replaced.get(id(p))
            if entry is None or entry[0] is not p:
                params.append(p)
                continue
            new, count = entry[1], count + 1
            state = optimizer.state.pop(p, None)
            if new is None:
                continue
            if state:
                misfit = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and (
                    v.shape != new.shape or isinstance(v, DTensor) != isinstance(new, DTensor))]
                if misfit:
                    optimizer.state[p] = state
                    raise ValueError(
                        f"remap_optimizer_parameters: the optimizer's state {misfit} of a parameter of shape "
                        f"{tuple(p.shape)} does not fit the parameter that replaced it ({type(new).__name__} of shape "
                        f"{tuple(new.shape)}): it stepped before its model was sharded; build the optimizer, prepare "
                        "it with its model, then train")
                optimizer.state[new] = {k: v.to(new.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                        for k, v in state.items()}
            params.append(new)
        group["params"] = params
    return count


@contextlib.contextmanager
def uniform_param_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For the optimizer step: split param groups that mix plain tensors with DTensors (tensor parallelism without
    FSDP2 leaves norms plain), or DTensors of different meshes, into groups of one kind with the same settings.

    torch's fused and foreach kernels take the group's tensors in one call and refuse such a mix ("got mixed
    torch.Tensor and DTensor"); the update itself is per element, so splitting changes no number. Per-parameter
    state is keyed by parameter, so it is untouched; settings a step writes back into its group (the learning rate
    an adaptive optimizer tunes) are copied to the original group afterwards."""
    groups = optimizer.param_groups
    split, parts = [], []
    for group in groups:
        by_kind: dict[Any, list[torch.Tensor]] = {}
        for param in group["params"]:
            by_kind.setdefault(_kind(param), []).append(param)
        pieces = ([{**group, "params": params} for params in by_kind.values()]
                  if len(by_kind) > 1 and _uses_multi_tensor_kernels(group) else [group])
        split.extend(pieces)
        parts.append((group, pieces))
    if len(split) == len(groups):
        yield
        return
    optimizer.param_groups = split
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for group, pieces in parts:
            for key, value in pieces[0].items():
                if key != "params" and value is not group.get(key):
                    group[key] = value


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: `step` and `zero_grad` do nothing on accumulation steps that don't synchronise.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects, so an LR scheduler
    built on the original optimizer keeps working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None,
                 before_step: Callable[[], object] | None = None) -> None:
        self.optimizer = optimizer
        # The Accelerator's: parameters a forward left gathered go back to their shards before the update, or the
        # next forward would compute with the gathered copy of the values before it (`PreparedModel.release_gathered`).
        self.before_step = before_step
        self.gradient_state = gradient_state
        self.scaler = scaler
        # Fault tolerance (`ndparallel.fault_tolerance`): asked before each update whether the replica groups commit
        # the step; False skips it on every group alike.
        self.commit: Callable[[], bool] | None = None
        self._step_was_skipped = False

    def __getstate__(self) -> dict[str, Any]:
        # The Accelerator's hook holds every prepared object: a pickled optimizer (Accelerate's tests pickle one)
        # is the optimizer alone, as Accelerate's.
        return {**self.__dict__, "before_step": None, "commit": None}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last `step` skipped the update: not a sync step, or fp16 found inf/nan gradients."""
        return self._step_was_skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            self._step_was_skipped = True
            return None
        if self.before_step is not None:
            self.before_step()
        if self.commit is not None and not self.commit():
            self._step_was_skipped = True
            return None
        if self.scaler is None:
            self._step_was_skipped = False
            with uniform_param_groups(self.optimizer):
                return self.optimizer.step(closure)
        scale_before = self.scaler.get_scale()
        with uniform_param_groups(self.optimizer):
            self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
        self.scaler.update()
        self._step_was_skipped = self.scaler.get_scale() < scale_before
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Wraps an LR scheduler, as Accelerate's: it steps only when the optimizer really stepped, and then once per
    data-parallel rank (`steps_per_update`) unless batches are split.

    Each of the D ranks of the ``batch`` view draws its own batch, so one optimizer step consumes D of the loader's
    batches: a schedule written for one process (in loader batches) advances D steps, as Accelerate's does with D
    processes (under tensor, context or sequence parallelism D is the data-parallel degree, not the process count:
    those ranks share their batches). With ``split_batches=True`` one step consumes one loader batch: it steps once.
    With ``step_with_optimizer=False`` (Accelerate's ``step_scheduler_with_optimizer=False``) every call steps it.
    On an accumulation micro-step the schedule stays where it is (with ``adjust_scheduler``, torch's own step count
    still moves, as Accelerate's does, so torch does not warn that the optimizer did not step).
    """

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], gradient_state: GradientState,
                 step_with_optimizer: bool = True, steps_per_update: int = 1, adjust_scheduler: bool = True) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_update = steps_per_update
        self.adjust_scheduler = adjust_scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.steps_per_update):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its last step
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
