"""Compilation (``Accelerator(dynamo_plugin=TorchDynamoPlugin(...))``): regional or whole-model ``torch.compile``.

Regional (``use_regional_compilation=True``): each transformer block is compiled in place (``nn.Module.compile``:
parameter names, state dicts and checkpoints stay those of the uncompiled model) after tensor parallelism and
activation checkpointing and before FSDP2 wraps it; the blocks share their compiled code, so the cold start
compiles one block rather than the model. Whole-model: the prepared model itself is compiled in place, last.
What the compiler must not trace is kept out of the graph deliberately (``torch.compiler.disable``): the
context/sequence-parallel attention entry points (their collectives and the per-batch sharding state they read) and
the models' input checks -- a graph break around attention, and no recompilation from step to step.
"""

from __future__ import annotations

from torch import nn

from ..distributed.mesh import ParallelMesh
from .options import PrepareOptions
from .target import target_of


def _enabled(options: PrepareOptions):
    plugin = options.dynamo_plugin
    return plugin if plugin is not None and plugin.enabled else None


def _blocks(model: nn.Module, options: PrepareOptions) -> list[nn.Module]:
    """The transformer blocks regional compilation compiles: those the FSDP wrap policy would wrap."""
    return target_of(model, options).blocks_in(model)


def check_compilation(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Refuse regional compilation of a model without repeated blocks, before any collective."""
    plugin = _enabled(options)
    if plugin is None or not plugin.use_regional_compilation:
        return
    if not _blocks(model, options):
        raise ValueError(
            f"TorchDynamoPlugin(use_regional_compilation=True): {type(model).__name__} has no repeated blocks to "
            "compile (no _no_split_modules); name them with FullyShardedDataParallelPlugin("
            "transformer_cls_names_to_wrap=[...]), or compile the whole model (use_regional_compilation=False)")


def apply_regional_compilation(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Compile every transformer block in place (a no-op unless regional compilation is on)."""
    plugin = _enabled(options)
    if plugin is None or not plugin.use_regional_compilation:
        return model
    for block in _blocks(model, options):
        block.compile(**plugin.to_compile_kwargs())
    return model


def apply_model_compilation(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Compile the whole prepared model in place (a no-op unless compilation is on and not regional)."""
    plugin = _enabled(options)
    if plugin is None or plugin.use_regional_compilation:
        return model
    model.compile(**plugin.to_compile_kwargs())
    return model
