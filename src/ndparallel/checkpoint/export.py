"""Full weights out of any layout: `get_state_dict`, `save_model` (a Hugging Face directory) and `merge_weights`.

`save_model` writes what ``transformers``' ``save_pretrained`` writes -- ``config.json`` (and
``generation_config.json``), ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` shards of at most
``max_shard_size`` with ``model.safetensors.index.json`` -- so ``AutoModelForCausalLM.from_pretrained`` loads it.
Parameters are gathered one at a time (`DTensor.full_tensor`, a collective every rank joins) and rank 0 keeps at
most one shard in memory. Tied parameters are written once, under their first name, as ``save_pretrained`` does.
Weights that Accelerate's big-model offloading keeps outside the model (on the meta device in it) are read from their
hook's weights map as they are written (`ndparallel.checkpoint.offloaded`); other meta tensors are refused first.

`merge_weights` (``ndparallel merge-weights``) does the same offline, in one process, from the ``model_<i>``
directory of a checkpoint written by ``save_state``, reading one output shard at a time.
"""

from __future__ import annotations

import re
import shutil
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..distributed.agreement import monitored_barrier
from ..parallel import PreparedModel, interface
from ..tracking import progress_bar
from . import storage
from .manifest import read_metadata, tied_names
from .offloaded import OffloadedWeights
from .storage import CheckpointError, on_main, rank

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
HF_CONFIG_FILES = ("config.json", "generation_config.json")


def parse_size(size: int | str) -> int:
    """Bytes in ``"10GB"`` (10**9 per GB, as transformers), ``"500MiB"``, or an int."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size must be a positive int or a size like '10GB' or '500MiB', got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group names, in order, into shards of at most `max_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []


def shard_file_names(count: int, safe: bool) -> list[str]:
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    if count == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{k + 1:05d}-of-{count:05d}.{ext}" for k in range(count)]


def write_shard(tensors: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    if safe:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int, safe: bool) -> None:
    files = set(weight_map.values())
    if len(files) > 1:
        name = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
        storage.write_json(directory / name, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors)."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    if tensor.device.type != mesh.device_type:  # CPU-offloaded shards under a GPU mesh: gather on the device
        local = tensor.to_local().to(mesh.device_type)
        tensor = DTensor.from_local(local, mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride())
    return tensor.full_tensor()


def get_state_dict(model: nn.Module, unwrap: bool = True, call: str = "get_state_dict") -> dict[str, torch.Tensor]:
    """The full state dict: on the main process when parameters are sharded or split into pipeline stages (an empty
    dict elsewhere), on every rank otherwise. Collective when sharded: every rank first meets in a monitored barrier
    named `call` (the caller's name for it), so a call made on the main process only fails, naming it, as soon as
    another rank reaches another of the library's collective calls
    (`ndparallel.distributed.agreement.monitored_barrier`). Keys are the unwrapped model's names (unless
    ``unwrap=False``)."""
    parts = interface(model)
    parts.release_gathered()
    if not parts.holds_every_parameter:
        monitored_barrier(call)
        return _parts_state_dict(parts)
    sharded = any(isinstance(t, DTensor) for t in model.state_dict().values())
    if sharded:
        monitored_barrier(call)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if unwrap:
        return get_model_state_dict(model)
    return model.state_dict()


def _parts_state_dict(parts: PreparedModel) -> dict[str, torch.Tensor]:
    """Collective, for a model whose parts live on different ranks (pipeline stages): the full weights of every part,
    on rank 0 (an empty dict elsewhere). Each part's ranks gather their part's tensors in full, then the model sends
    the parts to rank 0 (`PreparedModel.gather_parts`)."""
    state = {name: _full(t).detach().cpu() for name, t in get_model_state_dict(parts.state_module()).items()}
    return parts.gather_parts(state)


def _progress(total: int, desc: str) -> Any:
    return progress_bar(total=total, desc=desc, unit="B", unit_scale=True, main_process=rank() == 0, file=sys.stderr)


def save_model(model: nn.Module, unwrapped: nn.Module, save_directory: str | Path, max_shard_size: int | str = "10GB",
               safe_serialization: bool = True) -> Path:
    """Collective: write `model`'s full weights (any layout) as a Hugging Face directory; see the module doc."""
    max_bytes = parse_size(max_shard_size)
    final = Path(save_directory)
    monitored_barrier("save_model")  # every rank, or an error naming the call (see `get_state_dict`)
    # This rank's shards, named as in the unwrapped model; under pipeline stages the stages' full weights gathered
    # on rank 0 (plain tensors: the loop below then gathers nothing and only rank 0 has names to write).
    parts = interface(model)
    parts.release_gathered()
    state = _parts_state_dict(parts) if not parts.holds_every_parameter else get_model_state_dict(model)
    tied = tied_names(unwrapped)
    names = [n for n in state if n not in tied]
    offloaded = OffloadedWeights(unwrapped, state)  # Accelerate's big-model offloading: weights outside the model
    offloaded.check(names)
    sizes = [(n, state[n].numel() * state[n].element_size()) for n in names]
    shards = plan_shards(sizes, max_bytes)
    files = shard_file_names(len(shards), safe_serialization)
    staging = on_main(lambda: storage.prepare_staging(final, storage.EXPORT))
    weight_map: dict[str, str] = {}
    bar = _progress(sum(s for _, s in sizes), f"save_model {final.name}")
    for shard, file in zip(shards, files):
        tensors = {}
        for name in shard:
            if name in offloaded:  # read from its hook's weights map, on rank 0 only (no collective)
                if rank() != 0:
                    continue
                full = offloaded.read(name, state[name])
            else:
                full = _full(state[name])
            if rank() == 0:
                tensors[name] = full.detach().to("cpu").contiguous()
                weight_map[name] = file
                bar.update(full.numel() * full.element_size())
            del full
        if rank() == 0:
            write_shard(tensors, staging / file, safe_serialization)
        del tensors
    bar.close()

    def finish() -> None:
        write_index(staging, weight_map, sum(s for _, s in sizes), safe_serialization)
        config = getattr(unwrapped, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(staging)
        generation = getattr(unwrapped, "generation_config", None)
        if generation is not None and getattr(unwrapped, "can_generate", lambda: False)():
            generation.save_pretrained(staging)
        storage.commit(staging, final, None, storage.EXPORT)

    on_main(finish)
    return final


# ---- offline -------------------------------------------------------------------------------------------------------
def _model_dir(checkpoint: Path, model_index: int) -> tuple[Path, dict[str, str]]:
    """The model directory of a checkpoint (verified) and its tied names; a bare DCP directory works too."""
    if (checkpoint / ".metadata").is_file() and not (checkpoint / storage.METADATA_FILE).exists():
        return checkpoint, {}
    meta = read_metadata(checkpoint)
    count = len(meta.get("models", []))
    if not 0 <= model_index < count:
        raise CheckpointError(f"checkpoint {checkpoint} holds {count} model(s); there is no model {model_index}")
    prefix = f"model_{model_index}/"
    storage.verify_files(checkpoint, {k: v for k, v in meta["files"].items() if k.startswith(prefix)})
    tied = (meta.get("model_tied") or [{}] * count)[model_index]
    return checkpoint / f"model_{model_index}", tied


def merge_weights(checkpoint_dir: str | Path, output_dir: str | Path, model_index: int = 0,
                  max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> Path:
    """Convert model `model_index` of a sharded (or full) checkpoint into a Hugging Face directory, offline."""
    max_bytes = parse_size(max_shard_size)
    model_dir, tied = _model_dir(Path(checkpoint_dir), model_index)
    final = Path(output_dir)
    full_file = model_dir / "state.pt"
    if full_file.is_file():
        full_state = storage.load_torch_file(full_file, "full model state")
        entries = {n: (tuple(t.shape), t.dtype) for n, t in full_state.items() if n not in tied}
    else:
        full_state = None
        metadata = storage.read_dcp_metadata(model_dir)
        entries = {n: (tuple(m.size), m.properties.dtype) for n, m in metadata.state_dict_metadata.items()
                   if hasattr(m, "size") and n not in tied}
    if not entries:
        raise CheckpointError(f"{model_dir} holds no tensors")

    def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

    sizes = [(n, nbytes(*entries[n])) for n in entries]
    shards = plan_shards(sizes, max_bytes)
    files = shard_file_names(len(shards), safe_serialization)
    staging = storage.prepare_staging(final, storage.EXPORT)
    weight_map: dict[str, str] = {}
    bar = _progress(sum(s for _, s in sizes), f"merge-weights {final.name}")
    for shard, file in zip(shards, files):
        if full_state is not None:
            tensors = {n: full_state[n].contiguous() for n in shard}
        else:
            tensors = {n: torch.empty(entries[n][0], dtype=entries[n][1]) for n in shard}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(tensors, storage_reader=storage.safe_reader(model_dir),
                         planner=storage.safe_load_planner(), no_dist=True)
        write_shard(tensors, staging / file, safe_serialization)
        weight_map.update(dict.fromkeys(shard, file))
        bar.update(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors
    bar.close()
    write_index(staging, weight_map, sum(s for _, s in sizes), safe_serialization)
    for name in HF_CONFIG_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, staging / name)
    storage.commit(staging, final, None, storage.EXPORT)
    return final


def describe_output(directory: Path) -> str:
    files = sorted(p.name for p in directory.iterdir())
    total = sum(p.stat().st_size for p in directory.iterdir())
    return f"{directory}: {len(files)} file(s), {total / 2**20:,.1f} MiB ({', '.join(files)})"


__all__ = ["get_state_dict", "merge_weights", "parse_size", "save_model"]
