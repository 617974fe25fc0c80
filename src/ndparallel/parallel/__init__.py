"""Applying parallelisms to one model, in a fixed order.

Order (outermost wrapper last): pipeline stages -> tensor parallel -> attention for CP/SP -> activation
checkpointing -> compile -> FSDP2 / DDP. Each step is its own module; `parallelize` only calls them in order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FullyShardedDataParallelPlugin
from ..mesh import ParallelMesh
from .activation_checkpointing import apply_activation_checkpointing
from .data import apply_data_parallel, block_classes, uses_fsdp
from .precision import apply_autocast

# Axes whose parallelism has not landed yet: prepare() refuses them rather than silently ignoring them.
NOT_YET_IMPLEMENTED = {
    "tp": "tensor parallelism",
    "cp": "context parallelism",
    "sp": "Ulysses sequence parallelism",
}


def check_supported(mesh: ParallelMesh, axes: tuple[str, ...] = tuple(NOT_YET_IMPLEMENTED)) -> None:
    for axis in axes:
        what = NOT_YET_IMPLEMENTED[axis]
        if mesh.size(axis) > 1:
            raise NotImplementedError(
                f"{axis}_size={mesh.size(axis)}: {what} is not implemented in this version of ndparallel; "
                f"supported now: dp_replicate_size and dp_shard_size (DDP, FSDP2, HSDP)"
            )


def parallelize(model: nn.Module, mesh: ParallelMesh, plugin: FullyShardedDataParallelPlugin | None,
                dtype: torch.dtype | None, device: torch.device) -> nn.Module:
    """Apply every configured parallelism to `model` and return the module to train."""
    check_supported(mesh)
    model = model.to(device)
    # 1-3. Pipeline stages, tensor parallel, CP/SP attention: not yet (check_supported refused them).
    # 4. Activation checkpointing of the transformer blocks.
    if plugin is not None and plugin.activation_checkpointing:
        apply_activation_checkpointing(model, block_classes(model, plugin.transformer_cls_names_to_wrap))
    # 5. Compile: not offered yet.
    # 6. Mixed precision outside FSDP2 is autocast; FSDP2 casts through its MixedPrecisionPolicy instead.
    if dtype is not None and not uses_fsdp(mesh, plugin):
        apply_autocast(model, dtype, device.type)
    # 7. Data parallel, outermost.
    return apply_data_parallel(model, mesh, plugin, dtype, device)
