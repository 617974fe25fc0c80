"""Mixed precision outside FSDP2: autocast around the model's forward.

Under FSDP2 the `MixedPrecisionPolicy` casts parameters instead (see `data_parallel`). fp16 also needs a
gradient scaler, which the Accelerator owns.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..mesh import ParallelMesh
from .data_parallel import uses_fsdp
from .options import PrepareOptions


def apply_autocast(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Run ``model.forward`` under ``torch.autocast`` in the mixed-precision dtype, unless FSDP2 casts instead."""
    dtype = options.dtype
    if dtype is None or uses_fsdp(mesh.config, options.fsdp_plugin):
        return model
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=options.device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return model
