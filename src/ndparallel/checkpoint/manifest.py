"""What a checkpoint says about its contents, read and compared before anything is loaded: the metadata file of a
complete checkpoint, the tensor names and shapes of a model's state, and its tied parameter names. Shared by
`training_state` (save_state / load_state), `export` (merge-weights) and `load_pretrained` (loading safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..parallel import interface, state_module
from . import storage
from .storage import CheckpointError, CheckpointNotFoundError


def tensor_shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> global shape of every tensor of a state dict."""
    return {name: list(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}


def model_tensors(model: nn.Module, state: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """Name -> global shape of every tensor of a prepared model's state dict (`state`, when the caller has it),
    under the model's own names. Collective for a model with pipeline stages: each rank holds its stages' tensors,
    gathered here into the whole model's table (every rank calls it)."""
    shapes = tensor_shapes(get_model_state_dict(state_module(model)) if state is None else state)
    if not interface(model).holds_every_parameter and dist.is_initialized():
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, shapes)
        shapes = {name: shape for part in parts for name, shape in part.items()}
    return shapes


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier name (tied weights): {later name: first name}."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _listing(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def compare_tensors(saved: dict[str, list[int]], expected: dict[str, list[int]], what: str) -> str | None:
    """A message listing missing, unexpected and mismatched tensors, or None when names and shapes agree."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [f"{n}: checkpoint {tuple(saved[n])} vs model {tuple(expected[n])}"
              for n in sorted(set(saved) & set(expected)) if list(saved[n]) != list(expected[n])]
    if not (missing or unexpected or shapes):
        return None
    parts = [f"{what} does not match the model (a checkpoint of another model?)"]
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the model are not in the checkpoint: {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the checkpoint are not in the model: {_listing(unexpected)}")
    if shapes:
        parts.append(f"{len(shapes)} tensor(s) differ in shape: {_listing(shapes)}")
    return "; ".join(parts)


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint at `path`, or a `CheckpointError` saying what is wrong."""
    if not path.exists():
        partial = storage.staging_dir(path)
        hint = f" (an interrupted save left {partial.name})" if partial.exists() else ""
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    meta_path = path / storage.METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {storage.METADATA_FILE} (a save that did "
                              "not finish, or not an ndparallel checkpoint)")
    meta = storage.read_json(meta_path, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != storage.FORMAT:
        raise CheckpointError(f"{meta_path} is not ndparallel checkpoint metadata")
    if meta.get("format_version", 0) > storage.FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {meta['format_version']}, newer than this "
                              f"ndparallel reads ({storage.FORMAT_VERSION}); upgrade ndparallel")
    if not meta.get("complete"):
        raise CheckpointError(f"checkpoint {path} is incomplete (its metadata is not marked complete)")
    return meta
