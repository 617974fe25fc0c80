"""What `prepare` applies to one model besides the mesh: the third argument of every ``apply_x(model, mesh, options)``.

Every setting the steps read comes from here -- the handlers of the `ParallelismConfig` (``tp_handler``,
``cp_handler``, ``pp_handler``), whether FSDP2 wraps the model (``fsdp``, decided once by the Accelerator), the
Accelerator's and `prepare`'s own; the mesh gives the sizes, coordinates and groups only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..configuration.handlers import PipelineParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig
from ..configuration.dtypes import compute_dtype
from ..configuration.plugins import AORecipeKwargs, FullyShardedDataParallelPlugin, TorchDynamoPlugin
from .memory.config import MemoryKwargs
from .target import Target


@dataclass(frozen=True)
class PrepareOptions:
    device: torch.device  # this rank's device
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    mixed_precision: str = "no"  # one of config.MIXED_PRECISION
    tp_plan: Mapping[str, str] | None = None  # prepare(model, tp_plan=...): overrides the plan's other sources
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)  # DistributedDataParallelKwargs, where DDP wraps
    autocast_kwargs: Mapping[str, Any] = field(default_factory=dict)  # AutocastKwargs, where autocast casts
    dynamo_plugin: TorchDynamoPlugin | None = None  # compile the blocks or the model (`compile`)
    fp8_recipe: AORecipeKwargs | None = None  # mixed_precision="fp8": torchao's conversion (`fp8`)
    memory: MemoryKwargs = field(default_factory=MemoryKwargs)  # chunked loss, tiled MLPs (`memory`)
    # The ParallelismConfig's handlers, and whether FSDP2 wraps the model (`data_parallel.uses_fsdp`, decided once by
    # the Accelerator).
    fsdp: bool = False
    tp_handler: TorchTensorParallelConfig = field(default_factory=TorchTensorParallelConfig)
    cp_handler: TorchContextParallelConfig = field(default_factory=TorchContextParallelConfig)
    pp_handler: PipelineParallelConfig = field(default_factory=PipelineParallelConfig)
    # For a model whose call runs backward itself (pipeline stages): the factor this rank's loss is weighted by
    # (the Accelerator's `GradientState.loss_factor`, `ndparallel.training.loss`) and whether the current micro-step
    # ends the
    # optimizer step. Read at every step, so they are functions.
    loss_factor: Callable[[], float] = lambda: 1.0
    sync_gradients: Callable[[], bool] = lambda: True
    # The model resolved once by `parallelize` at its entry (`target.Target`: the adapter wrapper peeled, its family,
    # the tensor-parallel plan), read by every step; None until then.
    target: Target | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype mixed precision computes in (None: no mixed precision)."""
        return compute_dtype(self.mixed_precision)
