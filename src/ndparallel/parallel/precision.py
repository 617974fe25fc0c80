"""Mixed precision: fp32 master weights, and autocast where FSDP2 does not cast.

Under mixed precision the trainable parameters are kept in fp32 -- a model loaded in bf16 is upcast before it is
sharded, as Accelerate does -- and the forward computes in the mixed-precision dtype: through FSDP2's
`MixedPrecisionPolicy` (`data_parallel`) where FSDP2 wraps the model, through ``torch.autocast`` otherwise. Without
the upcast a bf16 model's optimizer would update bf16 weights, whose 8-bit mantissa swallows most small updates: the
run stops learning without a word. fp16 also needs a gradient scaler, which the Accelerator owns.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from ..distributed.mesh import ParallelMesh
from .options import PrepareOptions


def apply_master_weights(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Upcast trainable floating-point parameters below fp32 to fp32 when mixed precision is on."""
    if options.dtype is None:
        return model
    upcast = [name for name, p in model.named_parameters()
              if p.requires_grad and p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16)]
    if upcast:
        for name, param in model.named_parameters():
            if name in upcast:
                param.data = param.data.to(torch.float32)
        if torch.distributed.get_rank() == 0:
            warnings.warn(f"mixed_precision={options.mixed_precision!r}: {len(upcast)} trainable parameter(s) held in "
                          "bf16/fp16 (e.g. a model loaded with torch_dtype=torch.bfloat16) are upcast to fp32 master "
                          f"weights; the forward still computes in {options.mixed_precision} (first: {upcast[0]})",
                          stacklevel=4)
    return model


def apply_autocast(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Run ``model.forward`` under ``torch.autocast`` in the mixed-precision dtype, unless FSDP2 casts instead."""
    dtype = options.dtype
    if dtype is None or options.fsdp:
        return model
    kwargs = dict(options.autocast_kwargs)
    enabled = kwargs.pop("enabled", True)
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kw):
        with torch.autocast(device_type=options.device.type, dtype=dtype, enabled=enabled, **kwargs):
            return forward(*args, **kw)

    model.forward = autocast_forward
    return model
