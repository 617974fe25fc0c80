"""Optimizer and LR-scheduler wrappers that respect gradient accumulation and the fp16 grad scaler."""

from __future__ import annotations

from typing import Any

import torch

from .loss import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: `step` and `zero_grad` do nothing on accumulation steps that don't synchronise.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects, so an LR scheduler
    built on the original optimizer keeps working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._step_was_skipped = False

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
        if self.scaler is None:
            self._step_was_skipped = False
            return self.optimizer.step(closure)
        scale_before = self.scaler.get_scale()
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
