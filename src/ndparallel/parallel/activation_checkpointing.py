"""Activation checkpointing: recompute blocks' activations in backward instead of keeping them.

Uses torch's composable `checkpoint`, which leaves parameter names unchanged (optimizer remapping and
checkpoints see the same FQNs as the unwrapped model) and composes with `fully_shard` applied afterwards.
``FullyShardedDataParallelPlugin(activation_checkpointing=...)`` says which blocks and what to keep
(`ndparallel.configuration.plugins.ActivationCheckpointing`): every block or every k-th one; all of a block recomputed
("full"), or the outputs of its matrix multiplies and attention kernels kept and the rest recomputed ("selective",
torch's selective checkpointing with a policy over ATen ops). Context- and sequence-parallel attention inside a block is
recomputed with its communication (every rank recomputes the same blocks in the same order), so it stays exact.
``{"offload": True}`` moves the checkpointed blocks' inputs to host memory and back (`memory.offload`).

A Hugging Face model whose config says ``use_cache=True`` (most do) fills a KV cache even in training; the
recomputation in backward would then meet the cache the forward filled (and selective checkpointing fails on it),
so training forwards of a checkpointed model run with ``use_cache=False``, as transformers' own gradient
checkpointing does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..distributed.mesh import ParallelMesh
from ..configuration.plugins import ActivationCheckpointing
from .memory.offload import ActivationOffload, offload_block_inputs
from .options import PrepareOptions
from .target import target_of

OFFLOAD_ATTR = "_ndparallel_activation_offload"  # on the model: its `ActivationOffload` (stats for tests)
_aten = torch.ops.aten
# What "selective" keeps: outputs whose recomputation is the expensive part of a block.
KEPT_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    getattr(_aten, "_scaled_mm", None) and _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,  # what SDPA runs on Hopper GPUs (docs/gpu.md)
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
) if op)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _no_cache_in_training(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    if module.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return args, kwargs


def apply_activation_checkpointing(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Checkpoint the transformer blocks ``FullyShardedDataParallelPlugin(activation_checkpointing=...)`` names."""
    plugin = options.fsdp_plugin
    if plugin is None or not plugin.activation_checkpointing:
        return model
    spec = plugin.activation_checkpointing
    spec = spec if isinstance(spec, ActivationCheckpointing) else ActivationCheckpointing()
    target = target_of(model, options)
    if not target.block_types:
        raise ValueError(
            f"activation_checkpointing needs block classes to checkpoint, and {type(model).__name__} names none: "
            "set FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=[...])"
        )
    checkpointed = [module for i, module in enumerate(target.blocks_in(model)) if i % spec.every == 0]
    for module in checkpointed:
        checkpoint(module, context_fn=_selective_contexts if spec.policy == "selective" else None)
    if spec.offload:  # the checkpointed blocks' inputs to host memory and back (`memory.offload`)
        offload = ActivationOffload(options.device)
        offload_block_inputs(checkpointed, offload)
        object.__setattr__(model, OFFLOAD_ATTR, offload)
    if "use_cache" in inspect.signature(model.forward).parameters:
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
    return model
