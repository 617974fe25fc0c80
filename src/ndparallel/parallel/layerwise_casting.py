"""`attach_layerwise_casting_hooks` (Accelerate's `accelerate.big_modeling` function): keep weights in a small dtype
between uses, for inference."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

# The layers whose weights are cast (Accelerate's list): the others keep their dtype.
CASTABLE_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                   nn.Linear)


class _Cast:
    """Forward pre-hook (to the compute dtype) or forward hook (back to the storage dtype) of one layer."""

    def __init__(self, dtype: torch.dtype, non_blocking: bool) -> None:
        self.dtype, self.non_blocking = dtype, non_blocking

    def __call__(self, module: nn.Module, *_: Any) -> None:
        module.to(self.dtype, non_blocking=self.non_blocking)


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: str | tuple[str, ...] | list[str] | None = None,
                                   skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
                                   non_blocking: bool = False) -> None:
    """Store the weights of `module`'s linear and convolution layers in `storage_dtype` (say
    ``torch.float8_e4m3fn``: a quarter of fp32's memory) and cast each to `compute_dtype` for its own forward only,
    back to storage after. Weights are rounded to `storage_dtype` once, here: for inference. Submodules whose class
    is in `skip_modules_classes`, or whose name matches a regular expression of `skip_modules_pattern`, are left as
    they are (with everything inside them). Accelerate's function, same arguments and meaning."""
    if not (isinstance(storage_dtype, torch.dtype) and isinstance(compute_dtype, torch.dtype)):
        raise TypeError("attach_layerwise_casting_hooks: storage_dtype and compute_dtype must be torch dtypes, got "
                        f"{storage_dtype!r} and {compute_dtype!r}")
    if not (storage_dtype.is_floating_point and compute_dtype.is_floating_point):
        raise ValueError(f"attach_layerwise_casting_hooks: storage {storage_dtype} and compute {compute_dtype} must "
                         "both be floating-point dtypes")
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    _attach(module, "", storage_dtype, compute_dtype, patterns, tuple(skip_modules_classes or ()), non_blocking)


def _attach(module: nn.Module, name: str, storage: torch.dtype, compute: torch.dtype, patterns: tuple[str, ...],
            classes: tuple[type[nn.Module], ...], non_blocking: bool) -> None:
    if (classes and isinstance(module, classes)) or any(re.search(p, name) for p in patterns):
        return
    if isinstance(module, CASTABLE_LAYERS):
        module.to(storage)
        module.register_forward_pre_hook(_Cast(compute, non_blocking))
        module.register_forward_hook(_Cast(storage, non_blocking))
        return
    for child_name, child in module.named_children():
        _attach(child, f"{name}.{child_name}" if name else child_name, storage, compute, patterns, classes,
                non_blocking)


__all__ = ["CASTABLE_LAYERS", "attach_layerwise_casting_hooks"]
