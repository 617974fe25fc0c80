"""The memory step of `ndparallel.parallel.parallelize`: after tensor and sequence parallelism (the head keeps its
input as their hooks lay it out), before activation checkpointing and FSDP2."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .loss_head import install

if TYPE_CHECKING:  # options.py imports this package (for MemoryKwargs)
    from ...mesh import ParallelMesh
    from ..options import PrepareOptions


def apply_memory_features(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """The chunked loss `options.memory` asks for (`MemoryKwargs`)."""
    install(model, options.memory)
    return model
