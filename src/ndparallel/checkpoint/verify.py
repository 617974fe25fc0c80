"""Everything checked before a checkpoint loads (`load_state`): what it was saved from against what is prepared,
every file's size and CRC32, DCP's metadata, the small states' values (`validate`); and, without a directory, the
newest complete checkpoint of a project that verifies. A bad checkpoint raises the same `CheckpointError` on every
rank and leaves the prepared objects untouched."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..parallel import unwrap
from ..training.prepared import PreparedObjects
from ..distributed.runtime import heartbeat
from . import positional, storage, validate
from .manifest import compare_tensors, model_tensors, read_metadata
from .project import ProjectConfiguration, complete_checkpoints
from .storage import (
    CheckpointError,
    CheckpointNotFoundError,
    agree,
    on_main,
    rank,
    world_size,
)

SHARDED = validate.SHARDED


def class_name(model: torch.nn.Module) -> str:
    """The model's own class name (FSDP2 swaps in a subclass named ``FSDP<name>``)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def components(prepared: PreparedObjects) -> dict[str, Any]:
    """What a checkpoint of these objects holds, as compared at load time."""
    return {
        "models": [class_name(unwrap(m)) for m in prepared.models],
        "optimizers": [type(o.optimizer).__name__ for o in prepared.optimizers],
        "param_groups": [len(o.param_groups) for o in prepared.optimizers],
        "schedulers": [type(s.scheduler).__name__ for s in prepared.schedulers],
        "dataloaders": len(prepared.dataloaders),
        "custom_objects": [type(o).__name__ for o in prepared.custom_objects],
        "scaler": prepared.scaler is not None,
    }


def read_and_compare(prepared: PreparedObjects, path: Path, tables: list[dict[str, list[int]]],
                     parallelism: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0: the checkpoint's metadata if `prepared` can load it, else a `CheckpointError` naming the problem.
    `tables`: the prepared models' tensors (`manifest.model_tensors`, collective); `parallelism`: this run's
    ``ParallelismConfig.to_dict()``, which optimizers saved by position must have been saved under (`positional`)."""
    meta = read_metadata(path)
    mine = components(prepared)
    keys = ("models", "optimizers", "schedulers", "dataloaders", "custom_objects", "scaler")
    if any(meta.get(k) != mine[k] for k in keys):
        def describe(c: dict[str, Any]) -> str:
            return (f"models {c.get('models')}, optimizers {c.get('optimizers')}, LR schedulers {c.get('schedulers')}, "
                    f"{c.get('dataloaders')} data loader(s), registered objects {c.get('custom_objects')}, "
                    f"grad scaler {'yes' if c.get('scaler') else 'no'}")
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded into this Accelerator: it holds {describe(meta)}; this Accelerator "
            f"has {describe(mine)}. Prepare (and register_for_checkpointing) the same kinds of objects, in the same "
            "order, before load_state")
    if meta.get("param_groups") != mine["param_groups"]:
        raise CheckpointError(f"checkpoint {path}: the optimizers had {meta.get('param_groups')} parameter groups, "
                              f"these have {mine['param_groups']}")
    validate.check_metadata(meta, path, len(prepared.models), len(prepared.optimizers))
    positional.check_owners(prepared, meta, path)
    positional.check_layout(meta, path, parallelism)
    for i, expected in enumerate(tables):
        problem = compare_tensors(meta["model_tensors"][i], expected, f"checkpoint {path}: model {i}")
        if problem:
            raise CheckpointError(problem)
    return meta


def check_dcp_metadata(prepared: PreparedObjects, path: Path, meta: dict[str, Any]) -> None:
    """Rank 0: read DCP's own (pickled) metadata files safely, so a bad one fails here and not inside DCP."""
    if meta["state_dict_type"] == SHARDED:
        names = [f"model_{i}" for i in range(len(prepared.models))]
        named = [j for j, owner in enumerate(meta["optimizer_models"]) if owner is not None]  # DCP; not positional
        for name in names + [f"optimizer_{j}" for j in named]:
            storage.read_dcp_metadata(path / name)


def read_small(prepared: PreparedObjects, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """This rank's small states from `path`, each checked (`validate`); raises `CheckpointCorruptError`."""
    small: dict[str, Any] = {}
    small["schedulers"] = [storage.load_torch_file(path / f"scheduler_{k}.pt", f"LR scheduler {k}")
                           for k in range(len(prepared.schedulers))]
    for k, state in enumerate(small["schedulers"]):
        validate.check_mapping(state, path, f"scheduler_{k}.pt")
    small["scaler"] = storage.load_torch_file(path / "scaler.pt", "grad scaler") if prepared.scaler else None
    if prepared.scaler is not None:
        validate.check_scaler(small["scaler"], path)
    small["custom"] = [storage.load_torch_file(path / f"custom_checkpoint_{k}.pt", f"registered object {k}")
                       for k in range(len(prepared.custom_objects))]
    small["dataloaders"] = storage.read_json(path / "dataloaders.json", "data loader positions")
    validate.check_dataloaders(small["dataloaders"], path, len(prepared.dataloaders))
    small["gradient_state"] = storage.read_json(path / "gradient_state.json", "gradient state")
    validate.check_gradient_state(small["gradient_state"], path)
    small["positional"] = {}  # optimizers saved by position: this rank's own file (same world size: `check_layout`)
    for j, owner in enumerate(meta["optimizer_models"]):
        if owner is None:
            file = positional.file_name(j, rank())
            state = storage.load_torch_file(path / file, f"optimizer {j}")
            positional.check_parameters(state, prepared.optimizers[j].optimizer, path, j, file)
            small["positional"][j] = state
    rng_file = f"random_states_{rank() if meta['world_size'] == world_size() else 0}.pt"
    small["rng"] = storage.load_torch_file(path / rng_file, "RNG state")
    validate.check_rng(small["rng"], path, rng_file)
    return small


def check(prepared: PreparedObjects, path: Path, parallelism: dict[str, Any] | None = None
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: everything about `path` that can be checked without touching `prepared` -- metadata, every
    file's size and CRC32, DCP metadata, the small states; returns (metadata, this rank's small states).
    `parallelism`: see `read_and_compare`."""
    heartbeat(f"load_state: checking {path.name}")
    tables = [model_tensors(m) for m in prepared.models]  # collective under pipeline stages
    meta = on_main(lambda: read_and_compare(prepared, path, tables, parallelism))
    storage.verify_files(path, meta["files"])  # sizes and CRC32s, each rank a share of the files
    on_main(lambda: check_dcp_metadata(prepared, path, meta))
    error, small = None, {}
    try:
        small = read_small(prepared, path, meta)
    except CheckpointError as exc:
        error = exc
    agree(error)
    return meta, small


def candidates(project: ProjectConfiguration) -> list[Path]:
    if not project.automatic_checkpoint_naming:
        raise ValueError("load_state() needs an input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True) "
                         "to find the newest checkpoint")
    found = on_main(lambda: complete_checkpoints(project.checkpoints_dir))
    if not found:
        raise CheckpointNotFoundError(f"no complete checkpoint in {project.checkpoints_dir}")
    return found[::-1]


def check_newest(prepared: PreparedObjects, project: ProjectConfiguration, parallelism: dict[str, Any] | None = None
                 ) -> tuple[Path, dict, dict]:
    """Collective: the newest checkpoint of the project that verifies, warning (rank 0) about each newer one that
    is damaged; one that does not fit `prepared` (another model...) raises, as an explicit path does."""
    skipped: list[str] = []
    found = candidates(project)
    for i, path in enumerate(found):
        try:
            meta, small = check(prepared, path, parallelism)
        except (storage.CheckpointCorruptError, CheckpointNotFoundError) as exc:
            skipped.append(f"{path.name}: {exc}")
            if rank() == 0:
                then = f"trying {found[i + 1].name}" if i + 1 < len(found) else "no older checkpoint left"
                warnings.warn(f"load_state(): skipping {path}, it is damaged: {exc}; {then}", stacklevel=4)
            continue
        return path, meta, small
    raise CheckpointError(f"no checkpoint in {project.checkpoints_dir} can be loaded, all are damaged: "
                          + " | ".join(skipped))
