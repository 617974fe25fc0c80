"""PEFT models out of any layout: the adapter in PEFT's own format, or the model with its LoRA merged in.

A model `prepare` made of a ``PeftModel`` holds the frozen base and the adapter's small layers sharded, split or
spread over pipeline stages like any other parameters. Saving it writes what PEFT itself writes:

- `adapter_state_dict`: the tensors PEFT saves for the adapter (the same ones ``get_peft_model_state_dict``
  picks, found by running PEFT's own selection on shape-only placeholders of this rank's tensors), gathered in full
  -- only those, not the base -- on the main process. ``PeftModel.save_pretrained(dir, state_dict=...)`` then writes
  ``adapter_config.json`` and the adapter weights, which ``PeftModel.from_pretrained`` loads.
- `merged_state_dict`: every weight of the adapted transformers model under its own names, with each LoRA layer's
  update merged into its base weight, ``W + s * B @ A`` (transposed for transformers' Conv1D), and bias
  ``b + s * B.bias`` where B has one: what ``merge_and_unload`` gives, loadable by plain transformers. Refused for
  DoRA (its magnitude rescales the merged weight) and for adapters other than LoRA.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel import interface
from ..parallel.adapted import adapter_free, is_peft_model
from .storage import rank

_LORA_PART = re.compile(r"^(?P<layer>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.(?P<what>weight|bias)$")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def adapter_keys(peft_model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """The keys of `state` (the PEFT model's own names) that PEFT saves for its active adapter."""
    from peft import get_peft_model_state_dict

    placeholders = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    owner = {id(v): k for k, v in placeholders.items()}
    picked = get_peft_model_state_dict(peft_model, state_dict=placeholders,
                                       adapter_name=getattr(peft_model, "active_adapter", "default"))
    return sorted(owner[id(v)] for v in picked.values() if id(v) in owner)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the adapter's tensors in full on the main process (an empty dict elsewhere), under the PEFT
    model's names (adapter name included), ready for ``PeftModel.save_pretrained(dir, state_dict=...)``."""
    parts = interface(model)
    parts.release_gathered()
    peft_model = parts.unwrapped()
    state = peft_model.state_dict()
    full = {key: _full(state[key]) for key in adapter_keys(peft_model, state)}  # same keys on every rank of a part
    if not parts.holds_every_parameter:
        full = parts.gather_parts(full)
    return full if rank() == 0 else {}


def _lora_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """This rank's LoRA layers, by name in the PEFT model; raises for layers that cannot be merged."""
    out = {}
    for name, module in peft_model.named_modules():
        if not isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
            if isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters"):
                raise ValueError(f"merging adapters: {name!r} is a {type(module).__name__} adapter; ndparallel "
                                 "merges LoRA adapters only (save the adapter itself instead)")
            continue
        if len(getattr(module, "lora_magnitude_vector", {})) or len(getattr(module, "lora_embedding_A", {})):
            raise ValueError(f"merging adapters: {name!r} is a DoRA or embedding LoRA adapter, which ndparallel does "
                             "not merge; save the adapter itself (merge_adapters=False) and merge with PEFT")
        out[name] = module
    return out


def merged_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """Collective: the adapted transformers model's full weights with the active LoRA adapters merged in, on the main
    process (an empty dict elsewhere), and that transformers model (whose ``save_pretrained`` writes them)."""
    parts = interface(model)
    parts.release_gathered()
    peft_model = parts.unwrapped()
    base = adapter_free(peft_model)
    prefix = next(f"{name}." for name, m in peft_model.named_modules() if m is base).lstrip(".")
    active = peft_model.active_adapters if isinstance(peft_model.active_adapters, list) else \
        [peft_model.active_adapters]
    layers = _lora_layers(peft_model)
    # Each layer's scaling and orientation, as tensors so that pipeline stages can hand theirs to rank 0.
    settings = {f"{name}#{adapter}": torch.tensor([float(layer.scaling[adapter]),
                                                   float(getattr(layer, "fan_in_fan_out", False))])
                for name, layer in layers.items() for adapter in active if adapter in layer.lora_A}
    state = {key: _full(value) for key, value in peft_model.state_dict().items()}
    if not parts.holds_every_parameter:
        state, settings = parts.gather_parts(state), parts.gather_parts(settings)
    if rank() != 0:
        return {}, base
    merged: dict[str, torch.Tensor] = {}
    lora: dict[tuple[str, str, str, str], torch.Tensor] = {}
    for key, value in state.items():
        match = _LORA_PART.match(key)
        if match:
            lora[match["layer"], match["ab"], match["adapter"], match["what"]] = value
        elif ".lora_" not in key:
            merged[key.removeprefix(prefix).replace(".base_layer.", ".")] = value.clone()
    for tag, setting in settings.items():
        layer, adapter = tag.rsplit("#", 1)
        scale, transposed = float(setting[0]), bool(setting[1])
        a, b = lora[layer, "A", adapter, "weight"], lora[layer, "B", adapter, "weight"]
        delta = (b.float() @ a.float()) * scale
        target = layer.removeprefix(prefix)
        weight = merged[f"{target}.weight"]
        merged[f"{target}.weight"] = (weight.float() + (delta.T if transposed else delta)).to(weight.dtype)
        bias = lora.get((layer, "B", adapter, "bias"))
        if bias is not None:
            merged[f"{target}.bias"] = (merged[f"{target}.bias"].float() + bias.float() * scale).to(bias.dtype)
    return merged, base


def save_adapter(model: nn.Module, unwrapped: nn.Module, save_directory: Any, merge_adapters: bool,
                 safe_serialization: bool = True) -> None:
    """Collective: write a PEFT model as PEFT does (the adapter), or merged as a transformers model."""
    if merge_adapters:
        state, base = merged_state_dict(model)
        if rank() == 0:
            base.save_pretrained(save_directory, state_dict=state, safe_serialization=safe_serialization)
        return
    state = adapter_state_dict(model)
    if rank() == 0:
        unwrapped.save_pretrained(save_directory, state_dict=state, safe_serialization=safe_serialization)
