"""Applying parallelisms to one model, in a fixed order.

Order (outermost wrapper last): pipeline stages -> tensor parallel -> attention for CP/SP -> activation
checkpointing -> compile -> FSDP2 / DDP. Each step is its own module; `parallelize` only calls them in order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..config import FullyShardedDataParallelPlugin
from ..mesh import ParallelMesh
from .activation_checkpointing import apply_activation_checkpointing
from .context import apply_context_parallel, check_context_parallel
from .data import apply_data_parallel, block_classes, broadcast_module_states, uses_fsdp
from .precision import apply_autocast
from .tensor import apply_tensor_parallel, check_not_sharded, tensor_parallel_styles

# Axes whose parallelism has not landed yet: prepare() refuses them rather than silently ignoring them.
NOT_YET_IMPLEMENTED: dict[str, str] = {}


def check_supported(mesh: ParallelMesh, axes: tuple[str, ...] = tuple(NOT_YET_IMPLEMENTED)) -> None:
    for axis in axes:
        what = NOT_YET_IMPLEMENTED[axis]
        if mesh.size(axis) > 1:
            raise NotImplementedError(
                f"{axis}_size={mesh.size(axis)}: {what} is not implemented in this version of ndparallel; "
                "supported now: dp_replicate_size, dp_shard_size, tp_size, cp_size and sp_size (DDP, FSDP2, HSDP, TP, "
                "CP, Ulysses SP)"
            )


def parallelize(model: nn.Module, mesh: ParallelMesh, plugin: FullyShardedDataParallelPlugin | None,
                dtype: torch.dtype | None, device: torch.device,
                tp_plan: Mapping[str, str] | None = None) -> nn.Module:
    """Apply every configured parallelism to `model` and return the module to train."""
    check_supported(mesh)
    tp_styles = {}
    if mesh.size("tp") > 1:  # checks only, on every rank, before the first collective
        check_not_sharded(model, mesh["tp"])
        tp_styles = tensor_parallel_styles(model, mesh.size("tp"), mesh.config.tp_handler, tp_plan)
    if mesh.size("cp") > 1 or mesh.size("sp") > 1:  # likewise: attention CP/SP cannot make exact is refused here
        check_context_parallel(model, mesh)
    # To this rank's device; tensors on the meta device (weights loaded after parallelisation, see
    # ndparallel.checkpoint.pretrained) stay there.
    model._apply(lambda t: t if t.is_meta else t.to(device))
    # Every rank starts from rank 0's weights, so ranks that were initialised differently still train one model
    # (each tensor-parallel rank then slices its own shard of the same full weights, without communicating).
    broadcast_module_states(model)
    # 1. Pipeline stages: not yet.
    # 2. Tensor parallel over ``tp``, from the plan (parameters it covers become DTensors sharded over tp).
    if tp_styles:
        model = apply_tensor_parallel(model, mesh["tp"], tp_styles, mesh.config.tp_handler.loss_parallel)
    # 3. Context / Ulysses sequence parallel: attention over sequences sharded on ``cp x sp`` (ndparallel.attention).
    if mesh.size("cp") > 1 or mesh.size("sp") > 1:
        model = apply_context_parallel(model, mesh, mesh.config.cp_handler)
    # 4. Activation checkpointing of the transformer blocks.
    if plugin is not None and plugin.activation_checkpointing:
        apply_activation_checkpointing(model, block_classes(model, plugin.transformer_cls_names_to_wrap))
    # 5. Compile: not offered yet.
    # 6. Mixed precision outside FSDP2 is autocast; FSDP2 casts through its MixedPrecisionPolicy instead.
    if dtype is not None and not uses_fsdp(mesh, plugin):
        apply_autocast(model, dtype, device.type)
    # 7. Data parallel, outermost.
    return apply_data_parallel(model, mesh, plugin, dtype, device)
