"""Activation checkpointing: recompute each block's activations in backward instead of keeping them.

Uses torch's composable `checkpoint`, which leaves parameter names unchanged (optimizer remapping and
checkpoints see the same FQNs as the unwrapped model) and composes with `fully_shard` applied afterwards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from ..mesh import ParallelMesh
from .blocks import block_classes, blocks_of
from .options import PrepareOptions


def apply_activation_checkpointing(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Checkpoint every transformer block when ``FullyShardedDataParallelPlugin(activation_checkpointing=True)``."""
    plugin = options.fsdp_plugin
    if plugin is None or not plugin.activation_checkpointing:
        return model
    blocks = block_classes(model, plugin.transformer_cls_names_to_wrap)
    if not blocks:
        raise ValueError(
            f"activation_checkpointing needs block classes to checkpoint, and {type(model).__name__} names none: "
            "set FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[...])"
        )
    for module in blocks_of(model, blocks):
        checkpoint(module)
    return model
