"""The memory step of `ndparallel.parallel.parallelize`: after tensor and sequence parallelism (the head keeps its
input as their hooks lay it out), before activation checkpointing and FSDP2."""

from __future__ import annotations

from torch import nn

from ...distributed.mesh import ParallelMesh
from ..options import PrepareOptions
from ..target import target_of
from .loss_head import install
from .rms_norm import apply_fused_rms_norm
from .tiled_mlp import apply_tiled_mlp


def apply_memory_features(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """The chunked loss, the tiled MLPs and the fused RMSNorms `options.memory` asks for (`MemoryKwargs`)."""
    target = target_of(model, options)  # resolved once by `parallelize`: the model under its adapter wrapper, ...
    inner = target.inner
    install(model, options.memory, inner)
    if options.memory.tiled_mlp:
        apply_tiled_mlp(model, options.memory.mlp_tile_size, inner=inner, blocks=target.blocks_in(model))
    if options.memory.fused_rms_norm:
        apply_fused_rms_norm(model, inner)
    return model
