"""Mixed precision outside FSDP2: autocast around the model's forward.

Under FSDP2 the `MixedPrecisionPolicy` casts parameters instead (see `parallel.data`). fp16 also needs a
gradient scaler, which the Accelerator owns.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_autocast(model: nn.Module, dtype: torch.dtype, device_type: str) -> nn.Module:
    """Run ``model.forward`` under ``torch.autocast(device_type, dtype)``."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    model._ndparallel_original_forward = forward
    return model
