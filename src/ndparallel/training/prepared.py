"""The record of what an Accelerator prepared: the one object checkpoints read and write.

The Accelerator appends to it in `prepare` and `register_for_checkpointing`; `ndparallel.checkpoint.save_state` /
`load_state` take it (with the run's settings) and touch nothing else of the Accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .data import PreparedDataLoader
from .loss import GradientState
from .optim import AcceleratedOptimizer, AcceleratedScheduler
from ..parallel.interface import interface


@dataclass
class PreparedObjects:
    gradient_state: GradientState  # accumulation and optimizer-step counters
    scaler: torch.amp.GradScaler | None = None  # fp16 mixed precision
    models: list[nn.Module] = field(default_factory=list)  # as prepare() returned them (wrapped)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[PreparedDataLoader] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)  # register_for_checkpointing: state_dict/load_state_dict

    def release_gathered(self) -> dict[int, torch.Tensor]:
        """Every prepared model's parameters left gathered by a forward without backward back on their shards
        (`PreparedModel.release_gathered`), before anything reads or updates them; ``{id(gathered): sharded}``."""
        released: dict[int, torch.Tensor] = {}
        for model in self.models:
            released.update(interface(model).release_gathered())
        return released
