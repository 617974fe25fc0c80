"""Activation checkpointing: recompute each block's activations in backward instead of keeping them.

Uses torch's composable `checkpoint`, which leaves parameter names unchanged (optimizer remapping and
checkpoints see the same FQNs as the unwrapped model) and composes with `fully_shard` applied afterwards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_activation_checkpointing(model: nn.Module, blocks: list[type[nn.Module]]) -> nn.Module:
    if not blocks:
        raise ValueError(
            f"activation_checkpointing needs block classes to checkpoint, and {type(model).__name__} names none: "
            "set FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[...])"
        )
    for module in model.modules():
        if isinstance(module, tuple(blocks)) and module is not model:
            checkpoint(module)
    return model
