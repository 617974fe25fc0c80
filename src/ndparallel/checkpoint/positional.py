"""Optimizers of no single prepared model: their state saved by position, each rank its own, loaded only under the
layout it was saved under.

An optimizer prepared with the model whose parameters it updates is saved under that model's parameter names
(`training_state`): names, with DTensors of global shapes, are what let a checkpoint load under another layout. An
optimizer whose parameters belong to no single prepared model -- built for a model that was not prepared, or
spanning two models -- has no such names. As Accelerate does, its ``state_dict()`` is then saved by position (the
i-th parameter of its groups, in order): here every rank writes its own, ``optimizer_<j>_rank_<r>.pt``, with the
local shape (and, for a DTensor, the global shape, mesh and placements) of each parameter it held.

A position means the same parameter, and a local shard the same slice, only under the same layout. So such a state
loads only with the same world size and ``ParallelismConfig`` as it was saved with (`check_layout`), and only into
parameters of the same shapes and placements (`check_parameters`); anything else is refused, before anything is
loaded, saying so -- loading it elsewhere would hand each rank another shard's, or another rank's, state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..parallel import unwrap
from ..training.prepared import PreparedObjects
from .storage import CheckpointError, agree, on_main, rank, world_size
from .validate import check_mapping, fail

_KEYS = ("state", "param_groups", "parameters", "dtensors")


def owners(prepared: PreparedObjects) -> list[int | None]:
    """For each prepared optimizer, the index of the prepared model whose parameters it updates; None for one whose
    parameters belong to no single prepared model (its state is saved by position)."""
    params = [{id(p) for p in m.parameters()} for m in prepared.models]
    found: list[int | None] = []
    for opt in prepared.optimizers:
        mine = {id(p) for group in opt.param_groups for p in group["params"]}
        found.append(next((i for i, ps in enumerate(params) if mine <= ps), None))
    return found


def agreed_owners(prepared: PreparedObjects) -> list[int | None]:
    """Collective: `owners`, the same on every rank (or the same `CheckpointError` on every rank)."""
    mine = owners(prepared)
    first = on_main(lambda: mine)
    agree(None if first == mine else f"optimizer owners differ between ranks: rank 0 has {first}, rank {rank()} has "
                                     f"{mine} (the index of the prepared model whose parameters each optimizer "
                                     "updates); prepare the same objects in the same order on every rank")
    return mine


def saved_states(prepared: PreparedObjects, found: list[int | None]) -> dict[int, dict[str, Any]]:
    """Collective: this rank's `saved_state` of each optimizer whose owner in `found` is None, copied now; an error on
    any rank raises on every rank."""
    states, error = {}, None
    try:
        for j, owner in enumerate(found):
            if owner is None:
                states[j] = saved_state(prepared.optimizers[j].optimizer, j)
    except CheckpointError as exc:
        error = exc
    agree(error)
    return states


def file_name(j: int, rank: int) -> str:
    return f"optimizer_{j}_rank_{rank}.pt"


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order ``state_dict()`` numbers them: group by group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _describe(param: torch.Tensor) -> dict[str, Any]:
    """What a position must still point at: the local shape, and for a DTensor its global shape, mesh (the ranks, and
    the dimension names) and placements."""
    if not isinstance(param, DTensor):
        return {"shape": list(param.shape)}
    mesh = param.device_mesh
    return {"shape": list(param.to_local().shape), "global_shape": list(param.shape), "mesh": mesh.mesh.tolist(),
            "mesh_dims": list(mesh.mesh_dim_names or ()), "placements": repr(tuple(param.placements))}


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def saved_state(optimizer: torch.optim.Optimizer, j: int) -> dict[str, Any]:
    """This rank's state of optimizer `j` by position, copied to host memory now: torch's ``state_dict()`` with each
    DTensor value replaced by its local shard (listed in ``dtensors`` with its global shape and stride), and each
    parameter's description (`_describe`)."""
    params = _parameters(optimizer)
    state = optimizer.state_dict()
    dtensors: list[list[Any]] = []
    per_param: dict[int, dict[str, Any]] = {}
    for index, values in state["state"].items():
        param, copied = params[index], {}
        for key, value in values.items():
            if isinstance(value, DTensor):
                if not (isinstance(param, DTensor) and value.device_mesh == param.device_mesh
                        and value.placements == param.placements):
                    raise CheckpointError(
                        f"optimizer {j}: its state {key!r} of parameter {index} is a DTensor laid out unlike the "
                        "parameter, which a state saved by position cannot describe; prepare the optimizer together "
                        "with the model whose parameters it updates (its state is then saved by parameter name)")
                dtensors.append([index, key, list(value.shape), list(value.stride())])
                value = value.to_local()
            copied[key] = _copy(value)
        per_param[index] = copied
    return {"state": per_param, "param_groups": _copy(state["param_groups"]),
            "parameters": [_describe(p) for p in params], "dtensors": dtensors}


def _layouts(saved: tuple[int, dict[str, Any] | None], now: tuple[int, dict[str, Any] | None]) -> tuple[str, str]:
    """Both layouts in short: the process count and the ``ParallelismConfig`` fields that differ (the sizes above 1
    where none differs)."""
    (n_saved, p_saved), (n_now, p_now) = saved, now
    p_saved, p_now = p_saved or {}, p_now or {}
    keys = [k for k in dict.fromkeys([*p_saved, *p_now]) if p_saved.get(k) != p_now.get(k)] if p_now else []
    if not keys:
        keys = [k for k in p_saved if k.endswith("_size") and p_saved[k] != 1]

    def one(processes: int, parallelism: dict[str, Any]) -> str:
        fields = ", ".join(f"{k}={parallelism[k]!r}" for k in keys if k in parallelism)
        return f"{processes} process(es)" + (f", ParallelismConfig({fields})" if fields else "")
    return one(n_saved, p_saved), one(n_now, p_now)


def check_layout(meta: dict[str, Any], path: Path, parallelism: dict[str, Any] | None) -> None:
    """Rank 0 (before anything is loaded): a checkpoint with optimizers saved by position loads only under the world
    size and ``ParallelismConfig`` it was saved under (`parallelism`: this run's, None when the caller has none to
    compare, then the world size and `check_parameters` decide)."""
    positional = [j for j, owner in enumerate(meta["optimizer_models"]) if owner is None]
    if not positional:
        return
    saved = meta.get("parallelism")
    if meta["world_size"] == world_size() and (parallelism is None or saved == parallelism):
        return
    then, now = _layouts((meta["world_size"], saved), (world_size(), parallelism))
    raise CheckpointError(
        f"checkpoint {path}: optimizer(s) {positional} update parameters of no single prepared model, so their state "
        f"was saved by position, each rank its own, under {then}; positions and shards mean the same only under that "
        f"layout, and this run is under {now}: loading it would give ranks another shard's or another rank's "
        "optimizer state. Resume under the layout it was saved with; to change layouts, prepare each optimizer "
        "together with the model whose parameters it updates (accelerator.prepare(model, optimizer)): its state is "
        "then saved by parameter name, which any layout loads")


def check_owners(prepared: PreparedObjects, meta: dict[str, Any], path: Path) -> None:
    """Rank 0: an optimizer saved under a model's parameter names loads only into an optimizer of that model."""
    now = owners(prepared)
    for j, (saved, current) in enumerate(zip(meta["optimizer_models"], now)):
        if saved is not None and saved != current:
            which = "no single prepared model" if current is None else f"model {current}"
            raise CheckpointError(
                f"checkpoint {path}: optimizer {j} was saved with the parameter names of model {saved} ("
                f"{type(unwrap(prepared.models[saved])).__name__}), but this optimizer updates parameters of {which}; "
                f"prepare optimizer {j} together with model {saved}, as when it was saved")


def check_parameters(state: Any, optimizer: torch.optim.Optimizer, path: Path, j: int, file: str) -> None:
    """This rank: the saved state describes the optimizer's parameters as they are now (count, shapes, placements),
    and its DTensor entries name parameters that are DTensors. Raises `CheckpointError` (not corrupt: the file is
    whole, this run is laid out otherwise)."""
    check_mapping(state, path, file, _KEYS)  # a file that passed its checksum but is not what save_state writes
    kinds = {"state": dict, "param_groups": list, "parameters": list, "dtensors": list}
    if any(not isinstance(state[key], kind) for key, kind in kinds.items()):
        raise fail(path, file, "must hold 'state' as a mapping and 'param_groups', 'parameters', 'dtensors' as lists")
    params = _parameters(optimizer)
    now = [_describe(p) for p in params]
    saved = state["parameters"]
    if now != saved:
        differ = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(now), len(saved)))
        saved_one = saved[differ] if differ < len(saved) else "none"
        now_one = now[differ] if differ < len(now) else "none"
        raise CheckpointError(
            f"checkpoint {path}: optimizer {j} was saved by position (its parameters belong to no single prepared "
            f"model) and its parameters are not laid out as when it was saved: it had {len(saved)} "
            f"parameter(s) here, this one has {len(now)}; parameter {differ} was {saved_one}, is {now_one}. Its "
            "state loads only into the same parameters under the same layout")
    bad = [entry for entry in state["dtensors"] if not (
        isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], int) and 0 <= entry[0] < len(saved)
        and "placements" in saved[entry[0]] and entry[1] in state["state"].get(entry[0], {}))]
    if bad:
        raise fail(path, file, f"lists DTensor states of no DTensor parameter: {bad[:3]}")


def torch_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The saved state as ``optimizer.load_state_dict`` takes it: each local shard listed in ``dtensors`` made a
    DTensor again, on its parameter's mesh and placements (checked equal to the saved ones by `check_parameters`)."""
    params = _parameters(optimizer)
    per_param = {index: dict(values) for index, values in state["state"].items()}
    for index, key, shape, stride in state["dtensors"]:
        param = params[index]
        local = per_param[index][key].to(param.device)
        per_param[index][key] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                   shape=torch.Size(shape), stride=tuple(stride))
    return {"state": per_param, "param_groups": state["param_groups"]}
