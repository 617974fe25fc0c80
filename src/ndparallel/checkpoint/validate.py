"""Checks of a checkpoint's small files and metadata fields before `load_state` touches anything.

A file can pass its CRC32 and still hold values no save wrote (a hand edit, a bug in another writer, a file
crafted to pass the checksum). Everything `load_state` will hand to an object is checked here first -- types,
ranges, lengths; random generator states are tried on throw-away generators -- so a bad value fails with a
`CheckpointCorruptError` naming the file and the problem, on every rank, before any model or optimizer is
overwritten. `restorable` snapshots the few objects whose own `load_state_dict` may still refuse a state (a data
loader under another kind of batching, a user's registered object), so a refusal leaves them as they were.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from .storage import FORMAT, CheckpointCorruptError

SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _optional_int(value: Any, minimum: int = 0) -> bool:
    return value is None or _is_int(value, minimum)


def fail(path: Path, file: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path}: {file} {problem}. The file matches its recorded checksum, so it was written this way "
        "(edited by hand, or by another program); use another checkpoint")


def check_metadata(meta: dict[str, Any], path: Path, models: int, optimizers: int) -> None:
    """The fields of ``ndparallel_checkpoint.json`` that `load_state` reads, for `models` / `optimizers` objects."""
    file = "ndparallel_checkpoint.json"
    problems = []
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(info, dict) and _is_int(info.get("bytes")) and _is_int(info.get("crc32")) for info in
            files.values()):
        problems.append("'files' must map file names to {'bytes': int, 'crc32': int}")
    elif any(not isinstance(n, str) or PurePosixPath(n).is_absolute() or ".." in PurePosixPath(n).parts
             for n in files):
        problems.append("'files' names a path outside the checkpoint")
    if meta.get("format") != FORMAT:
        problems.append(f"'format' is {meta.get('format')!r}, not {FORMAT!r}")
    if not _is_int(meta.get("world_size"), 1):
        problems.append(f"'world_size' must be an int >= 1, got {meta.get('world_size')!r}")
    if meta.get("state_dict_type") not in (SHARDED, FULL):
        problems.append(f"'state_dict_type' must be {SHARDED!r} or {FULL!r}, got {meta.get('state_dict_type')!r}")
    owners = meta.get("optimizer_models")
    if not (isinstance(owners, list) and len(owners) == optimizers
            and all(o is None or (_is_int(o) and o < models) for o in owners)):
        problems.append(f"'optimizer_models' must list the model index of each of the {optimizers} optimizer(s), "
                        f"got {owners!r} (null: one saved by position)")
    fresh = meta.get("fresh_optimizers", [])  # absent in checkpoints written before it was recorded
    if not (isinstance(fresh, list) and all(_is_int(j) and j < optimizers for j in fresh)):
        problems.append(f"'fresh_optimizers' must list indices of the {optimizers} optimizer(s), got {fresh!r}")
    tensors = meta.get("model_tensors")
    if not (isinstance(tensors, list) and len(tensors) == models and all(
            isinstance(t, dict) and all(isinstance(s, list) and all(_is_int(d) for d in s) for s in t.values())
            for t in tensors)):
        problems.append(f"'model_tensors' must give the tensor shapes of each of the {models} model(s)")
    if problems:
        raise fail(path, file, "is not valid: " + "; ".join(problems))


def check_dataloaders(states: Any, path: Path, count: int) -> None:
    """``dataloaders.json``: one position per prepared data loader (see
    `ndparallel.training.data.PreparedDataLoader`)."""
    file = "dataloaders.json"
    if not isinstance(states, list) or len(states) != count:
        n = len(states) if isinstance(states, list) else type(states).__name__
        raise fail(path, file, f"must be a list of {count} data loader state(s), got {n}")
    for i, state in enumerate(states):
        if not isinstance(state, dict):
            raise fail(path, file, f"entry {i} must be a mapping, got {type(state).__name__}")
        checks = {"epoch": _is_int(state.get("epoch")), "position": _is_int(state.get("position")),
                  "unit": state.get("unit") in ("samples", "batches"),
                  "batch_size": _optional_int(state.get("batch_size"), 1),
                  "num_shards": _optional_int(state.get("num_shards"), 1),
                  "seed": _optional_int(state.get("seed")) if "seed" in state else True,
                  "dataset_length": _optional_int(state.get("dataset_length"))}
        bad = [f"{key}={state.get(key, '<missing>')!r}" for key, ok in checks.items() if not ok]
        if bad:
            raise fail(path, file, f"entry {i} has invalid values: {', '.join(bad)} (epoch and position: ints >= 0; "
                                    "unit: 'samples' or 'batches')")


def check_gradient_state(state: Any, path: Path) -> None:
    """``gradient_state.json``: the counters of `ndparallel.training.loss.GradientState`."""
    if not isinstance(state, dict):
        raise fail(path, "gradient_state.json", f"must be a mapping, got {type(state).__name__}")
    checks = {"step": _is_int(state.get("step")), "num_steps": _is_int(state.get("num_steps")),
              "sync_gradients": isinstance(state.get("sync_gradients"), bool)}
    bad = [f"{key}={state.get(key, '<missing>')!r}" for key, ok in checks.items() if not ok]
    if bad:
        raise fail(path, "gradient_state.json", f"has invalid values: {', '.join(bad)} (step and num_steps: ints "
                                                 ">= 0; sync_gradients: true or false)")


def check_rng(state: Any, path: Path, file: str) -> None:
    """A ``random_states_<rank>.pt``: each generator state is set on a throw-away generator of its kind."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"must be a mapping, got {type(state).__name__}")
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        torch.Generator().set_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            s = state["numpy"]
            np.random.RandomState().set_state((s["name"], s["keys"].numpy().astype("uint32"), s["pos"],
                                               s["has_gauss"], s["gauss"]))
        if "cuda" in state and not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state["cuda"]):
            raise TypeError("'cuda' must be a list of uint8 tensors")
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - whatever the generators refuse
        raise fail(path, file, f"does not hold valid random generator states ({type(exc).__name__}: {exc})") from None


def check_mapping(state: Any, path: Path, file: str, keys: tuple[str, ...] = ()) -> None:
    """A state that must be a mapping (LR scheduler, grad scaler) with at least `keys`."""
    if not isinstance(state, dict):
        raise fail(path, file, f"must hold a mapping, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise fail(path, file, f"lacks {missing}")


def check_scaler(state: Any, path: Path) -> None:
    check_mapping(state, path, "scaler.pt", _SCALER_KEYS)


# ---- loading that can be undone ----------------------------------------------------------------------------------
def _attribute_snapshot(obj: Any) -> Callable[[], None]:
    """Undo for objects whose `load_state_dict` only sets attributes (data loaders, and the sampler they set)."""
    objects = (obj, getattr(obj, "_shard", None))  # a PreparedDataLoader sets its sampler's seed too
    saved = [(o, dict(vars(o))) for o in objects if o is not None and hasattr(o, "__dict__")]

    def undo() -> None:
        for o, attrs in saved:
            vars(o).clear()
            vars(o).update(attrs)
    return undo


def _state_snapshot(obj: Any) -> Callable[[], None]:
    saved = copy.deepcopy(obj.state_dict())
    return lambda: obj.load_state_dict(saved)


@contextmanager
def restorable() -> Iterator[Callable[[Any, Any, bool], None]]:
    """Inside, ``load(obj, state, attributes)`` calls ``obj.load_state_dict(state)`` after taking a snapshot of
    `obj` (its attributes, or its state_dict()); if anything inside raises, every object loaded so far is put
    back as it was, in reverse order, and the error propagates."""
    undo: list[Callable[[], None]] = []

    def load(obj: Any, state: Any, attributes: bool = False) -> None:
        undo.append(_attribute_snapshot(obj) if attributes else _state_snapshot(obj))
        obj.load_state_dict(state)  # a refusal half-way through is undone too

    try:
        yield load
    except BaseException:
        for step in reversed(undo):
            step()
        raise
