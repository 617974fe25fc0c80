"""`save_state` / `load_state`: everything needed to continue a run exactly, under this or another layout.

On disk (``<dir>/``; see `storage` for how it appears atomically):

    ndparallel_checkpoint.json   format, layout, world size, step, versions, every model's tensor names and
                                 shapes, every file's size and CRC32; written last, so its presence means "complete"
    model_<i>/                   a torch.distributed.checkpoint (DCP) directory, plus config.json of HF models;
                                 with FULL_STATE_DICT instead one ``state.pt`` written by rank 0
    optimizer_<i>/               the same for each optimizer
    scheduler_<i>.pt, scaler.pt, custom_checkpoint_<i>.pt    rank 0, torch.save (loaded with weights_only=True)
    dataloaders.json, gradient_state.json                    rank 0
    random_states_<rank>.pt      every rank's Python / NumPy / torch (/ CUDA) generator states
    optimizer_<i>_rank_<rank>.pt instead of optimizer_<i>/ for an optimizer of no single prepared model: every rank's
                                 state by position, which loads only under the same layout (`positional`)

Resharding. Model and optimizer states go through `torch.distributed.checkpoint.state_dict`
(`get_state_dict` / `set_state_dict`), whose keys are the parameters' names in the unwrapped model and whose
values are DTensors with *global* shapes; DCP reads into whatever sharding the loading model has. So a checkpoint
saved under one ``ParallelismConfig`` loads under any other (world size, dp_replicate / dp_shard / tp mix, one
process). The data loaders' positions are counted in samples of the pass (see `ndparallel.training.data`), which mean
the same thing under any data-parallel size. Random states are per rank: under another world size every rank
continues rank 0's streams.

Everything is checked before anything is loaded: the metadata and what it was saved from (rank 0, verdict
broadcast), every file's size and CRC32 (each rank a share), DCP's metadata, and the values of the small files
(`validate`). A bad checkpoint raises the same `CheckpointError` on every rank, instead of hanging one of them,
and leaves the prepared objects as they were. ``load_state()`` of a project skips a damaged newest checkpoint
for the newest one that verifies. A save writes into a staging directory (`storage`); a failed write raises on
every rank, saying why (disk full, permission), and leaves previous checkpoints untouched.

What is saved is the Accelerator's `ndparallel.training.prepared.PreparedObjects`; the run's settings that the metadata
records come as a `RunRecord`.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._version import __version__
from ..configuration.parallelism import ParallelismConfig
from ..parallel import interface, state_module, unwrap
from ..training.prepared import PreparedObjects
from ..distributed.runtime import heartbeat
from . import background, positional, storage, validate, verify
from .manifest import model_tensors, tied_names
from .project import (
    ProjectConfiguration,
    checkpoint_number,
    next_number,
    prune,
)
from .state_dicts import flat_optimizer_state, sharded_state_dicts
from .storage import (
    CheckpointError,
    agree,
    on_main,
    rank,
    world_size,
)

SHARDED, FULL = validate.SHARDED, validate.FULL


@dataclass(frozen=True)
class RunRecord:
    """The Accelerator's settings a checkpoint records (and `save_state` follows)."""

    parallelism: ParallelismConfig
    device_type: str
    mixed_precision: str
    gradient_accumulation_steps: int
    state_dict_type: str = SHARDED  # the FSDP plugin's: how models and optimizers are written


FLAT = "flat"  # the checkpoint's optimizer states are keyed by parameter name (`state_dicts.flat_optimizer_state`)


def _hf_config_files(model: torch.nn.Module, directory: Path) -> None:
    """Rank 0: config.json (and generation_config.json) of a Hugging Face model, for `merge-weights`."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(directory / "config.json")
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    if generation is not None and hasattr(generation, "to_json_file") and can_generate:
        generation.to_json_file(directory / "generation_config.json")


def _versions() -> dict[str, str]:
    out = {"ndparallel": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


# ---- random states -------------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- writing and reading model / optimizer states ---------------------------------------------------------------
def _write_state(state: dict[str, Any], directory: Path, full: bool) -> None:
    if full:  # rank 0 holds the whole state (get_*_state_dict with full_state_dict=True, cpu_offload=True)
        if rank() == 0:
            directory.mkdir(exist_ok=True)
            with open(directory / "state.pt", "wb") as f:  # a Python file: a full disk raises OSError(ENOSPC)
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
                 process_group=storage.group())


def _read_state(state: dict[str, Any], directory: Path, full: bool, what: str) -> dict[str, Any]:
    """Fill `state` (sharded: this rank's DTensors) from `directory`; full: rank 0 reads the whole state."""
    if full:
        error, loaded = None, {}
        if rank() == 0:
            try:
                loaded = storage.load_torch_file(directory / "state.pt", what)
            except CheckpointError as exc:
                error = exc
        agree(error)
        return loaded
    try:
        dcp.load(state, storage_reader=storage.safe_reader(directory), planner=storage.safe_load_planner())
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - the same one on every rank (a BaseException)
        failures = getattr(exc, "failures", None)  # DCP's: {rank: (exception, traceback)}
        cause = next(iter(failures.values()))[0] if failures else exc
        raise CheckpointError(f"checkpoint {directory.parent}: reading {what} from {directory.name}/ failed: "
                              f"{type(cause).__name__}: {str(cause)[:2000]}") from None
    return state


def _written(what: str, directory: Path, write: Callable[[], None]) -> None:
    """Collective: run `write` on every rank; if it failed anywhere, raise on every rank a `CheckpointError` that
    says why in plain words (no space, permission...; `storage.write_error`)."""
    error: BaseException | None = None
    heartbeat(f"save_state: writing {what}")  # a long save is progress for `ndparallel launch --stall-timeout`
    try:
        write()
    except (TypeError, CheckpointError) as exc:  # a state that a safe load would refuse: its own clear message
        error = exc
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - OSError, torch's writer, DCP's wrapper
        error = storage.write_error(exc, directory, what)
    agree(error)


# ---- save --------------------------------------------------------------------------------------------------------
def save_state(prepared: PreparedObjects, run: RunRecord, project: ProjectConfiguration,
               output_dir: str | Path | None = None, async_save: bool = False,
               before_write: Callable[[Path], None] | None = None) -> Path:
    """Collective: write a checkpoint of everything `prepared` holds; return its directory (see the module doc).

    An existing `output_dir` is replaced only if it is empty or a complete ndparallel checkpoint; anything else
    is refused on every rank before anything is written. A failed write raises on every rank, saying why, and
    removes this save's partial files; previous checkpoints are untouched.

    With `async_save`, the state is copied to host memory here and written by a thread of this rank (its
    collectives on a process group of their own, `storage.collectives_on`), while training goes on: the next save,
    `load_state` and `background.wait` wait for it, and raise its error if it failed. Until it commits, the newest
    complete checkpoint is the one before.

    `before_write(staging)` runs on every rank once the staging directory exists (Accelerate's save-state pre-hooks:
    files it writes there are checksummed and committed with the checkpoint); if it raises on any rank, every rank
    raises and nothing is committed."""
    background.wait()
    automatic = project.automatic_checkpoint_naming
    if automatic:
        if output_dir is not None:
            warnings.warn(f"save_state({str(output_dir)!r}): ignored, automatic_checkpoint_naming writes to "
                          f"{project.checkpoints_dir}", stacklevel=3)
    elif output_dir is None:
        raise ValueError("save_state() needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
    if not prepared.gradient_state.sync_gradients:
        warnings.warn("save_state() in the middle of a gradient-accumulation window: the gradients accumulated so far "
                      "are not saved; save after the optimizer step", stacklevel=3)
    prepared.release_gathered()  # after an evaluation forward: the parameters are the optimizer's again
    owners = positional.agreed_owners(prepared)  # None: an optimizer of no single prepared model: saved by position
    by_position = positional.saved_states(prepared, owners)  # copied now (this rank's own)
    _check_layout(prepared, run.state_dict_type == FULL)

    def make_staging() -> tuple[Path, Path, str]:
        if automatic:  # the next number above every checkpoint_<i> already there: never an old run's name
            final = project.checkpoints_dir / f"checkpoint_{next_number(project.checkpoints_dir, project.iteration)}"
        else:
            final = Path(output_dir)
        staging = storage.prepare_staging(final)
        return final, staging, storage.mark_shared(staging)

    final, staging, mark = on_main(make_staging)
    storage.check_shared(staging, mark)  # every node sees the directory (a shared filesystem), or every rank raises
    started = time.perf_counter()
    try:
        if before_write is not None:
            _run_hook(before_write, staging, "save_state")
        parts = _parts(prepared, run, project, final, owners, by_position, staged=async_save)
    except BaseException:
        storage.discard_staging(staging)
        raise
    if async_save:
        background.start(lambda: _write_parts(parts, run, project, final, staging, started), final)
    else:
        _write_parts(parts, run, project, final, staging, started)
    return final


def _run_hook(hook: Callable[[Path], None], directory: Path, what: str) -> None:
    """Collective: run a user's hook on this rank; if it raised on any rank, raise on every rank (naming it)."""
    error = None
    try:
        hook(directory)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they would hang in the next collective
        error = f"a {what} pre-hook raised on rank {rank()}: {type(exc).__name__}: {exc}"
    storage.agree(error)


@dataclass
class _Parts:
    """What one checkpoint writes: each model's and optimizer's state (made when written, or already copied to host
    memory for a background write), the small files' bytes, and the metadata but for the files' checksums."""

    states: list[tuple[str, str, Callable[[], dict[str, Any]], torch.nn.Module | None]]  # what, directory, state, HF model
    small: dict[str, bytes | Callable[[], bytes]]  # file name -> its bytes, or how to make them
    metadata: dict[str, Any]


def _parts(prepared: PreparedObjects, run: RunRecord, project: ProjectConfiguration, final: Path,
           owners: list[int | None], by_position: dict[int, dict[str, Any]], staged: bool) -> _Parts:
    """Collective when `staged` (the states are made and copied to host memory now); the small files are read now
    either way, so that what is written is the state of this moment. `by_position`: this rank's states of the
    optimizers of no single prepared model (`positional`), written as this rank's own files."""
    full = run.state_dict_type == FULL
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    # Sharded optimizer states are written flat, keyed by parameter name (`state_dicts.flat_optimizer_state`).
    optimizer_options = StateDictOptions(full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=not full)
    states: list[tuple[str, str, Callable[[], dict[str, Any]], torch.nn.Module | None]] = []
    for i, model in enumerate(prepared.models):
        states.append((f"model {i}", f"model_{i}", functools.partial(get_model_state_dict, state_module(model),
                                                                      options=options), unwrap(model)))
    # An optimizer that has not stepped yet has no state; torch's get_optimizer_state_dict gives it one by stepping
    # it with zero gradients and lr 0 (Adam's step count becomes 1, which shifts its bias correction from then on).
    # Such an optimizer is left as it was, and the checkpoint says so (load_state restores it without state).
    fresh = [j for j, opt in enumerate(prepared.optimizers) if not opt.optimizer.state]

    def optimizer_state(j: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
        opt, owner = prepared.optimizers[j], prepared.models[owners[j]]  # type: ignore[index] - not a positional one
        if state is None:
            state = get_optimizer_state_dict(state_module(owner), opt.optimizer, options=optimizer_options)
        elif not full:
            state = flat_optimizer_state(state)
        if j in fresh:
            opt.optimizer.state.clear()
        return _renamed(state, _tied_copy_names(owner))

    for j in range(len(prepared.optimizers)):
        if owners[j] is not None:
            states.append((f"optimizer {j}", f"optimizer_{j}", functools.partial(optimizer_state, j), None))
    tables = None
    if staged:  # a copy in host memory, made now: training may change the parameters as soon as this returns
        made: dict[str, dict[str, Any]] = {}
        for i, model in enumerate(prepared.models):
            mine = [j for j, owner in enumerate(owners) if owner == i]
            if len(mine) == 1:  # one call for a model and its optimizer: torch checks its options once (~5x faster)
                j = mine[0]
                if full:
                    made[f"model_{i}"], optimizer = get_state_dict(
                        state_module(model), prepared.optimizers[j].optimizer, options=options)
                else:  # the same dicts, without working out every name again (`state_dicts`)
                    made[f"model_{i}"], optimizer = sharded_state_dicts(state_module(model),
                                                                        prepared.optimizers[j].optimizer)
                made[f"optimizer_{j}"] = optimizer_state(j, optimizer)
        copies = [background.host_copy(made[name] if name in made else make(), name) for _, name, make, _ in states]
        made.clear()
        states = [(what, name, functools.partial(lambda copy: copy, copy), model)
                  for (what, name, _, model), copy in zip(states, copies)]
        tables = [model_tensors(m, copies[i]) for i, m in enumerate(prepared.models)]
    small: dict[str, bytes | Callable[[], bytes]] = {}
    if rank() == 0:
        for k, scheduler in enumerate(prepared.schedulers):
            small[f"scheduler_{k}.pt"] = storage.torch_bytes(scheduler.state_dict(), f"LR scheduler {k}")
        if prepared.scaler is not None:
            small["scaler.pt"] = storage.torch_bytes(prepared.scaler.state_dict(), "grad scaler")
        for k, obj in enumerate(prepared.custom_objects):
            small[f"custom_checkpoint_{k}.pt"] = storage.torch_bytes(
                obj.state_dict(), f"registered object {k} ({type(obj).__name__})")
        small["dataloaders.json"] = storage.json_bytes([dl.state_dict() for dl in prepared.dataloaders])
        small["gradient_state.json"] = storage.json_bytes(prepared.gradient_state.state_dict())
    own = {f"random_states_{rank()}.pt": (_rng_state(), "RNG state", False)}  # every rank its own, of now
    for j, state in by_position.items():
        own[positional.file_name(j, rank())] = (state, f"optimizer {j}", True)
    for file, (state, what, check) in own.items():  # a background save serialises them in its writer thread
        serialise = functools.partial(storage.torch_bytes, state, what, check=check)
        small[file] = serialise if staged else serialise()
    metadata = {
        "format": storage.FORMAT, "format_version": storage.FORMAT_VERSION, "complete": True,
        "step": prepared.gradient_state.optimizer_steps,
        "iteration": checkpoint_number(final) if project.automatic_checkpoint_naming else None,
        "world_size": world_size(), "parallelism": run.parallelism.to_dict(), "device": run.device_type,
        "state_dict_type": SHARDED if not full else FULL, "mixed_precision": run.mixed_precision,
        "gradient_accumulation_steps": run.gradient_accumulation_steps, "versions": _versions(),
        **verify.components(prepared), "model_tensors": tables or [model_tensors(m) for m in prepared.models],
        "model_tied": [tied_names(unwrap(m)) for m in prepared.models], "optimizer_models": owners,
        "fresh_optimizers": fresh, "optimizer_layout": "nested" if full else FLAT,
    }
    return _Parts(states, small, metadata)


def _write_parts(parts: _Parts, run: RunRecord, project: ProjectConfiguration, final: Path, staging: Path,
                 started: float) -> None:
    """Collective: write every file into `staging`, checksum them, then (rank 0) commit it as `final`; on a failure,
    every rank removes the staging directory and raises."""
    full = run.state_dict_type == FULL
    try:
        for what, name, make, model in parts.states:
            state = make()

            def write(state: dict[str, Any] = state, name: str = name, model: torch.nn.Module | None = model) -> None:
                _write_state(state, staging / name, full)
                if rank() == 0 and model is not None:
                    _hf_config_files(model, staging / name)
            _written(what, final.parent, write)
            del state

        def write_small() -> None:
            for file, data in parts.small.items():
                storage.write_bytes(staging / file, data() if callable(data) else data)
        _written("the small states (schedulers, data loaders, random states...)", final.parent, write_small)
        storage.barrier()  # every rank's files are written before they are checksummed
        metadata = {**parts.metadata, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "files": storage.checksum_files(staging),
                    "save_seconds": round(time.perf_counter() - started, 3)}

        def finish() -> None:
            storage.commit(staging, final, metadata)
            if project.automatic_checkpoint_naming:
                try:
                    prune(final.parent, project.total_limit, keep=final)
                except OSError as exc:  # the new checkpoint is complete: deleting old ones is not worth failing over
                    warnings.warn(f"save_state: could not delete old checkpoints beyond total_limit="
                                  f"{project.total_limit} in {final.parent}: {exc}", stacklevel=2)

        on_main(finish)
    except BaseException:
        storage.discard_staging(staging)
        raise
    if project.automatic_checkpoint_naming:  # the next automatic name comes after this one, once it is written
        project.iteration = checkpoint_number(final) + 1


# ---- load --------------------------------------------------------------------------------------------------------
def _tied_copy_names(model: torch.nn.Module) -> dict[str, str]:
    """Under pipeline stages, {the last stage's copy of a tied weight: the weight's first name}: the copy's optimizer
    state is written under the first name (both copies' states are equal), as an unsplit tied model's optimizer keeps
    it, so optimizer checkpoints look alike under every layout (`PreparedModel.tied_copy_names`)."""
    return interface(model).tied_copy_names()


def _tied_aliases(model: torch.nn.Module, directory: Path) -> dict[str, str]:
    """{this rank's name: the name to read its optimizer state under} for the last stage's copy of a tied weight,
    where the checkpoint has no state under this rank's name (every checkpoint: see `_tied_copy_names`)."""
    names = _tied_copy_names(model)
    if not names:
        return {}
    keys = storage.read_dcp_metadata(directory).state_dict_metadata
    return {name: first for name, first in names.items() if not any(k.startswith(f"state.{name}.") for k in keys)}


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state dict with parameter names replaced by `names` (in its state and its groups), nested or flat
    (`state_dicts.flat_optimizer_state`)."""
    if not names or not state:
        return state
    if "state" in state and "param_groups" in state:
        return {**state, "state": {names.get(k, k): v for k, v in state["state"].items()},
                "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]}
                                 for g in state["param_groups"]]}
    renamed = {}
    for key, value in state.items():
        section, _, rest = key.partition(".")
        name = next((n for n in names if rest.startswith(f"{n}.")), None)
        renamed[f"{section}.{names[name]}{rest[len(name):]}" if name is not None else key] = value
    return renamed


def _check_layout(prepared: PreparedObjects, full: bool) -> None:
    if full and any(not interface(m).holds_every_parameter for m in prepared.models):
        raise ValueError("FULL_STATE_DICT checkpoints are written and read by rank 0, which holds only the first "
                         "pipeline stage: with pipeline stages use SHARDED_STATE_DICT (the default), which any "
                         "layout loads; `ndparallel merge-weights` makes full weights of it")


def _check_optimizer_layout(prepared: PreparedObjects, meta: dict[str, Any], path: Path) -> None:
    """Refuse what a nested optimizer state saved under pipeline stages cannot give to stages: one stage's groups."""
    saved_stages = (meta.get("parallelism") or {}).get("pp_size", 1)
    if (meta.get("optimizer_layout") != FLAT and meta["state_dict_type"] != FULL and saved_stages > 1 and prepared.optimizers
            and any(not interface(m).holds_every_parameter for m in prepared.models)):
        raise CheckpointError(
            f"checkpoint {path} was written under pipeline stages by an earlier ndparallel, whose optimizer state "
            "was nested by parameter group: it holds the parameter-group settings (lr, betas, ...) of one stage only, so it cannot resume "
            "under pipeline stages; load it once in a layout without pipeline stages, save_state again, and resume "
            "from that checkpoint")


def load_state(prepared: PreparedObjects, project: ProjectConfiguration, input_dir: str | Path | None = None,
               before_load: Callable[[Path], None] | None = None,
               parallelism: ParallelismConfig | None = None) -> Path:
    """Collective: restore everything `save_state` wrote into the `prepared` objects; return the directory.

    Every file is checked (checksums, then the values of the small files) before anything is loaded, so a bad
    checkpoint raises the same `CheckpointError` on every rank and leaves `prepared` as it was. Without
    `input_dir` (automatic naming), a damaged newest checkpoint is skipped, with a warning, for the newest one that
    verifies; with `input_dir`, it raises. `before_load(directory)` runs on every rank once the checkpoint has
    verified, before anything is loaded (Accelerate's load-state pre-hooks). `parallelism`: this run's, which an
    optimizer saved by position must have been saved under (`positional`)."""
    background.wait()  # a background save under way first commits (or fails)
    prepared.release_gathered()  # a gathered copy left by an evaluation forward would not see the loaded values
    fields = None if parallelism is None else parallelism.to_dict()  # what the checkpoint's record is compared with
    if input_dir is not None:
        path = Path(input_dir)
        meta, small = verify.check(prepared, path, fields)
    else:
        path, meta, small = verify.check_newest(prepared, project, fields)
    _check_layout(prepared, meta["state_dict_type"] == FULL)
    _check_optimizer_layout(prepared, meta, path)
    if before_load is not None:
        _run_hook(before_load, path, "load_state")

    # Objects whose load_state_dict may still refuse a state (a data loader under another kind of batching, a
    # user's object) go first, and are all put back if one refuses: then nothing has been touched.
    error, what = None, ""
    try:
        with validate.restorable() as load:
            for k, (loader, state) in enumerate(zip(prepared.dataloaders, small["dataloaders"])):
                what = f"data loader {k}"
                load(loader, state, True)
            for k, (obj, state) in enumerate(zip(prepared.custom_objects, small["custom"])):
                what = f"registered object {k} ({type(obj).__name__})"
                load(obj, state)
            for j, state in small["positional"].items():  # optimizers saved by position (`positional`)
                what = f"optimizer {j}"
                load(prepared.optimizers[j].optimizer, positional.torch_state(state, prepared.optimizers[j].optimizer))
            for k, (scheduler, state) in enumerate(zip(prepared.schedulers, small["schedulers"])):
                what = f"LR scheduler {k}"
                load(scheduler, state)
            if prepared.scaler is not None:
                what = "grad scaler"
                load(prepared.scaler, small["scaler"])
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, with the object named
        error = CheckpointError(f"checkpoint {path}: {what} refused its saved state: {type(exc).__name__}: {exc}")
    agree(error)

    full = meta["state_dict_type"] == FULL
    read_options = StateDictOptions(full_state_dict=full, cpu_offload=full, broadcast_from_rank0=full)
    for i, model in enumerate(prepared.models):
        heartbeat(f"load_state: reading model {i}")
        model = state_module(model)
        state = {} if full else get_model_state_dict(model)
        state = _read_state(state, path / f"model_{i}", full, f"model {i}")
        set_model_state_dict(model, state, options=read_options)
        del state
    # Written flat since the layout was recorded; before, nested (which kept one stage's parameter groups).
    flat = meta.get("optimizer_layout") == FLAT
    optimizer_options = StateDictOptions(full_state_dict=full, cpu_offload=full, broadcast_from_rank0=full,
                                         flatten_optimizer_state_dict=flat)
    for j, opt in enumerate(prepared.optimizers):
        if meta["optimizer_models"][j] is None:  # loaded by position above
            continue
        owner = prepared.models[meta["optimizer_models"][j]]
        model = state_module(owner)
        state = {} if full else get_optimizer_state_dict(
            model, opt.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        aliases = {} if full else _tied_aliases(owner, path / f"optimizer_{j}")
        state = _read_state(_renamed(state, aliases), path / f"optimizer_{j}", full, f"optimizer {j}")
        state = _renamed(state, {saved: name for name, saved in aliases.items()})
        set_optimizer_state_dict(model, opt.optimizer, state, options=optimizer_options)
        if j in meta.get("fresh_optimizers", ()):  # saved before its first step (see save_state): no state then
            opt.optimizer.state.clear()
        del state

    prepared.gradient_state.load_state_dict(small["gradient_state"])  # values checked in verify.read_small
    rng_crcs = {info["crc32"] for name, info in meta["files"].items() if name.startswith("random_states_")}
    if meta["world_size"] != world_size() and len(rng_crcs) > 1:
        warnings.warn(f"checkpoint saved by {meta['world_size']} process(es) with different random states, loaded by "
                      f"{world_size()}: every rank continues the random streams of rank 0", stacklevel=3)
    _set_rng_state(small["rng"])
    number = checkpoint_number(path)
    if project.automatic_checkpoint_naming and number is not None:
        project.iteration = number + 1  # save_state goes higher still if the folder holds higher numbers
    storage.barrier()
    return path
