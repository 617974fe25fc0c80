"""Weights that Accelerate's big-model offloading keeps outside the model, for `save_model` to write.

Accelerate's ``cpu_offload``, ``disk_offload``, ``dispatch_model`` with an offload map and
``load_checkpoint_and_dispatch`` leave each offloaded parameter (and buffer, with ``offload_buffers``) on the meta
device and attach a hook to its module -- ``AlignDevicesHook`` with ``offload=True`` -- whose ``weights_map`` holds the
real tensors (in CPU memory, or memory-mapped from the offload folder) and loads them for each forward. `save_model`
reads each such tensor from that map as it writes it (`OffloadedWeights.read`), so one tensor at a time is in memory
beyond the shard being written. A meta tensor with no such map behind it holds no values: `save_model` refuses it
before writing anything (`OffloadedWeights.check`).

The hooks are recognised by their attributes (``_hf_hook``; ``offload`` and ``weights_map``; a ``SequentialHook``'s
``hooks``), so this module does not import Accelerate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def _hooks(module: nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])  # a SequentialHook holds several


def is_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


class OffloadedWeights:
    """Where each meta tensor of `model`'s state dict (names as `model.state_dict()` gives them) has its values: the
    weights map of the nearest module, itself or an ancestor, whose hook offloads, and the tensor's name in it."""

    def __init__(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        maps = {prefix: hook.weights_map for prefix, module in model.named_modules() for hook in _hooks(module)
                if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None}
        self.sources: dict[str, tuple[Any, str]] = {}
        self.missing: list[str] = []
        for name, tensor in state.items():
            if not is_meta(tensor):
                continue
            parts = name.split(".")
            for cut in range(len(parts) - 1, -1, -1):  # the owning module first (a hook may place its submodules)
                prefix = ".".join(parts[:cut])
                if prefix in maps:
                    self.sources[name] = (maps[prefix], ".".join(parts[cut:]))
                    break
            else:
                self.missing.append(name)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def check(self, names: list[str]) -> None:
        """Refuse, before anything is written, meta tensors among `names` that no offloading hook holds."""
        missing = set(self.missing)
        empty = [n for n in names if n in missing]
        if empty:
            shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise ValueError(
                f"save_model: {len(empty)} tensor(s) of the model are on the meta device with no values behind them "
                f"({shown}), and no offloading hook (Accelerate's cpu_offload / dispatch_model with an offload map) "
                "holds them; nothing was written. Load the weights into the model first (from_pretrained, "
                "load_checkpoint_and_dispatch, or prepare() for one built under init_empty_weights), then save")

    def read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The values of tensor `name` (on the meta device as `like`), from its hook's weights map, in `like`'s dtype
        as the hook loads it for a forward."""
        weights_map, key = self.sources[name]
        try:
            value = weights_map[key]
        except KeyError:
            raise ValueError(f"save_model: {name} is on the meta device and the offloading hook of its module has no "
                             f"weight {key!r} in its weights map; the model cannot run a forward either") from None
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"save_model: the offloaded weight of {name} has shape {tuple(value.shape)}, the model's "
                             f"tensor {tuple(like.shape)}")
        return value.detach().to("cpu", like.dtype)
