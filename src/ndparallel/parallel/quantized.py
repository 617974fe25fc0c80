"""Models loaded quantized by bitsandbytes (``load_in_8bit`` / ``load_in_4bit``, e.g. for QLoRA): where they may be
trained. transformers records where ``device_map`` put each part (``hf_device_map``); a quantized model is trained
where it was loaded, so every part must be on this process's device -- not offloaded to the CPU (unless
bitsandbytes' multi-backend build runs its layers there) or to disk, and not spread over devices -- as Accelerate
requires. Checked before any collective."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.mesh import ParallelMesh
from .options import PrepareOptions


def _bitsandbytes_on_cpu() -> bool:
    """Whether the installed bitsandbytes runs its quantized layers on the CPU (its multi-backend build)."""
    try:
        import bitsandbytes
    except ImportError:
        return False
    return "multi_backend" in getattr(bitsandbytes, "features", set())


def _device(where: Any) -> torch.device | str:
    """A ``hf_device_map`` value as a device ("disk" stays a word; an int is a GPU index)."""
    if where == "disk":
        return "disk"
    return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)


def check_quantized(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Refuse a bitsandbytes-quantized model that was loaded offloaded, or on other devices than this process's."""
    placement = getattr(model, "hf_device_map", None)
    if not placement or not (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)):
        return
    places = {str(w) for w in placement.values()}
    if "disk" in places or ("cpu" in places and not _bitsandbytes_on_cpu()):
        raise ValueError(
            f"prepare(): you can't train a model loaded in 8-bit or 4-bit precision with CPU or disk offload: its "
            f"hf_device_map puts modules on {sorted(places)}, and bitsandbytes' quantized layers train only on the "
            f"device they were loaded on; load it with device_map={{'': '{options.device}'}} (this process's device)")
    here = options.device
    others = sorted({str(w) for w in placement.values() if (_device(w).type, _device(w).index or 0) != (
        here.type, here.index or 0)})
    if others:
        raise ValueError(
            f"prepare(): this model was loaded in 8-bit or 4-bit precision on {others}, and this process trains on "
            f"{here}: a quantized model is trained where it was loaded; load it with device_map={{'': '{here}'}}")
