"""Ranks that must agree, and collectives that must not wait forever.

Every rank runs the same script, but not always with the same settings: an environment variable set on one node
only, a stale file, a different batch size computed from the host, a ``save_state`` under ``is_main_process``. Left
alone, such ranks hang in a collective, crash with a transport error ("Connection reset by peer"), or -- worst --
train silently apart. This module turns each into an error that names the cause, on every rank, in bounded time:

- `check_agreement(fingerprint, what)`: every rank contributes a small JSON-able fingerprint of what must agree,
  compared with one small collective (a 64-bit digest per rank); only when they differ are the fingerprints
  gathered (``all_gather_object``; long lists as a digest, and in full only when they differ), and every rank
  raises the same ValueError naming the fields, the ranks and their values.
- fingerprint helpers for what must agree: `accelerator_fingerprint` (parallelism config, plugin, mixed precision,
  accumulation, versions), `model_fingerprint` (parameter and buffer names, shapes, dtypes),
  `optimizer_fingerprint` (type, parameter groups and hyperparameters), `dataloader_fingerprint` (batch size,
  dataset length, sampler kind), `prepare_fingerprint` (all of the objects given to one ``prepare``).
- `monitored_barrier(name, timeout)`: a barrier through the default process group's store (so the same on gloo and
  NCCL) that, when ranks reach *different* named calls, fails at once, and when some rank does not arrive within
  `timeout`, fails on every rank that did -- saying which ranks arrived, which did not, and the last named call each
  rank was in, with the likely cause.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import math
import platform
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._version import __version__
from .runtime import heartbeat, resolve_timeout

_DIGEST_OVER = 8  # lists longer than this are gathered as a digest (and in full only when they differ)
_MISSING = "<not set on this rank>"


class CollectiveTimeoutError(TimeoutError):
    """A rank did not reach a collective call within the timeout, or ranks reached different collective calls."""


# ---- turning settings into comparable data ---------------------------------------------------------------------------
def jsonable(value: Any) -> Any:
    """`value` as plain JSON data that means the same on every rank: no memory addresses, NaN as a string,
    dataclasses as dicts of their fields, dtypes and enums by name, functions by qualified name, other objects by
    type name."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return jsonable(value.item())
        return {"tensor": list(value.shape), "dtype": str(value.dtype)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Dotted paths to leaves; dicts and lists of dicts are opened, other lists are leaves."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}.{i}", out)
    else:
        out[prefix] = value
    return out


def _compact(value: Any) -> Any:
    if isinstance(value, list) and len(value) > _DIGEST_OVER:
        text = json.dumps(value, sort_keys=True)
        return {"entries": len(value), "sha1": hashlib.sha1(text.encode()).hexdigest()[:16]}
    return value


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    parts, start = [], None
    ranks = sorted(ranks)
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _show(value: Any, limit: int = 160) -> str:
    text = json.dumps(value) if value is not _MISSING else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_difference(lists: dict[int, Any]) -> str:
    """Where long lists (one per rank) first differ from the lowest rank's."""
    ranks = sorted(lists)
    base = lists[ranks[0]]
    notes = []
    for r in ranks[1:]:
        other = lists[r]
        if other == base:
            continue
        if not isinstance(base, list) or not isinstance(other, list):
            notes.append(f"rank {ranks[0]}: {_show(base)} vs rank {r}: {_show(other)}")
            continue
        i = next((i for i, (a, b) in enumerate(zip(base, other)) if a != b), min(len(base), len(other)))
        a = _show(base[i]) if i < len(base) else "(no entry)"
        b = _show(other[i]) if i < len(other) else "(no entry)"
        notes.append(f"{len(base)} vs {len(other)} entries, first difference at entry {i}: rank {ranks[0]} {a} vs "
                     f"rank {r} {b}")
        if len(notes) == 3:
            break
    return "; ".join(notes)


def check_agreement(fingerprint: dict[str, Any], what: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group` (default: every rank): raise the same ValueError on every rank if the ranks'
    fingerprints differ, naming each differing field with the ranks and their values. Nothing happens in a world
    of one or before torch.distributed is initialised.

    `fingerprint` is a dict of JSON-able data (`jsonable` is applied); nested dicts are compared field by field
    (``parallelism.tp_size``). When the ranks agree this costs one all-gather of one int64 per rank. Otherwise the
    fingerprints are gathered, lists longer than 8 entries as a digest, and those lists in full only when their
    digests differ, to show the first differing entry. `what` names the call in the message.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    heartbeat(f"check_agreement: {what}")
    flat = _flatten(jsonable(fingerprint), "", {})
    compact = {key: _compact(value) for key, value in flat.items()}
    size = dist.get_world_size(group)
    # One small collective when the ranks agree (the usual case): a 64-bit digest of each rank's fingerprint.
    digest = hashlib.sha1(json.dumps(compact, sort_keys=True).encode()).digest()[:8]
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")
    digests = torch.empty(size, dtype=torch.long, device=device)
    dist.all_gather_into_tensor(digests, torch.tensor([int.from_bytes(digest, "little", signed=True)],
                                                      dtype=torch.long, device=device), group=group)
    if bool((digests == digests[0]).all()):
        return
    gathered: list[Any] = [None] * size  # they differ: every rank knows, and gathers the fingerprints to say how
    dist.all_gather_object(gathered, compact, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    keys = sorted(set().union(*gathered), key=lambda k: (list(flat).index(k) if k in flat else len(flat), k))
    differing = [k for k in keys if len({json.dumps(g.get(k, _MISSING), sort_keys=True) for g in gathered}) > 1]
    digested = [k for k in differing if any(isinstance(g.get(k), dict) and "sha1" in g[k] for g in gathered)]
    full: list[Any] = [None] * size
    if digested:  # every rank knows the same list: the second gather happens on every rank, or on none
        dist.all_gather_object(full, {k: flat.get(k, _MISSING) for k in digested}, group=group)
    lines = []
    for key in differing[:8]:
        if key in digested:
            lines.append(f"{key}: {_first_difference({ranks[i]: full[i][key] for i in range(size)})}")
            continue
        by_value: dict[str, list[int]] = {}
        for i, g in enumerate(gathered):
            by_value.setdefault(_show(g.get(key, _MISSING)), []).append(ranks[i])
        lines.append(f"{key}: " + "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items()))
    more = f"\n  ... and {len(differing) - 8} more" if len(differing) > 8 else ""
    raise ValueError(
        f"{what}: the ranks disagree on {len(differing)} setting(s) that must be the same on every rank:\n  "
        + "\n  ".join(lines) + more + "\nEvery rank must run the same script with the same settings, model and data "
        "loader: look for a value computed from the host or rank, an environment variable (NDPARALLEL_*) set on some "
        "nodes only, or a stale file on one node.")


# ---- what must agree -------------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    return {"ndparallel": __version__, "torch": torch.__version__, "python": platform.python_version_tuple()[0]
            + "." + platform.python_version_tuple()[1]}


def accelerator_fingerprint(parallelism_config: Any, fsdp_plugin: Any = None, mixed_precision: str = "no",
                            gradient_accumulation_steps: int = 1, **settings: Any) -> dict[str, Any]:
    """What every rank's Accelerator must share: the parallelism config (as given, before it is resolved -- so a
    size that resolves on some ranks only is reported here, not as a hang), the FSDP plugin, mixed precision,
    accumulation steps, any further `settings` (device type, ...), and the ndparallel / torch / Python versions."""
    config = parallelism_config.to_dict() if hasattr(parallelism_config, "to_dict") else parallelism_config
    return {"parallelism": config, "fsdp_plugin": fsdp_plugin, "mixed_precision": mixed_precision,
            "gradient_accumulation_steps": gradient_accumulation_steps, **settings, "versions": versions()}


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """Class, and name / global shape / dtype of every parameter and buffer (the device is left out: a model on
    the meta device on some ranks is fine)."""
    return {"class": type(model).__name__,
            "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
            "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]}


def optimizer_fingerprint(optimizer: Any) -> dict[str, Any]:
    """Type, and for each parameter group its number of parameters, their elements, and its hyperparameters."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's
    groups = [{"parameters": len(g["params"]), "elements": sum(p.numel() for p in g["params"]),
               **{k: v for k, v in g.items() if k != "params"}} for g in optimizer.param_groups]
    return {"class": type(optimizer).__name__, "param_groups": groups}


def dataloader_fingerprint(loader: Any) -> dict[str, Any]:
    """Batch size, drop_last, dataset type and length (None when unknown) and the kinds of sampler."""
    base = getattr(loader, "base_loader", loader)  # a PreparedDataLoader's
    try:
        length = len(base.dataset)
    except TypeError:
        length = None
    return {"batch_size": base.batch_size, "drop_last": base.drop_last, "dataset": type(base.dataset).__name__,
            "dataset_length": length, "sampler": type(base.sampler).__name__ if base.sampler is not None else None,
            "batch_sampler": type(base.batch_sampler).__name__ if base.batch_sampler is not None else None}


def prepare_fingerprint(objects: Sequence[Any]) -> dict[str, Any]:
    """The fingerprint of every object given to one ``prepare``, keyed ``"argument <position> (<kind>)"``."""
    from torch.utils.data import DataLoader

    out: dict[str, Any] = {}
    for i, obj in enumerate(objects):
        if isinstance(obj, torch.nn.Module):
            out[f"argument {i} (model)"] = model_fingerprint(obj)
        elif isinstance(getattr(obj, "optimizer", obj), torch.optim.Optimizer) and hasattr(obj, "param_groups"):
            out[f"argument {i} (optimizer)"] = optimizer_fingerprint(obj)
        elif isinstance(getattr(obj, "base_loader", obj), DataLoader):
            out[f"argument {i} (data loader)"] = dataloader_fingerprint(obj)
        else:
            out[f"argument {i} ({type(obj).__name__})"] = {"class": type(getattr(obj, "scheduler", obj)).__name__}
    return out


# ---- a barrier that says who is missing ------------------------------------------------------------------------------
_PREFIX = "ndparallel/monitored_barrier/"


class _Barriers:
    store_id: int | None = None
    seq: int = 0


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _where(store: Any, world: int) -> dict[int, list[Any]]:
    """Each rank's last monitored call: {rank: [seq, name, state, host, time]} (ranks that never made one: absent)."""
    out = {}
    for rank in range(world):
        key = f"{_PREFIX}at/{rank}"
        if store.check([key]):
            out[rank] = json.loads(store.get(key))
    return out


def _report(store: Any, world: int, seq: int, name: str | None) -> str:
    """Where every rank is: its last monitored call and whether it waits there; with `name`, first which ranks are
    at call #`seq` named `name` and which are not."""
    lines, arrived, missing = [], [], []
    where = _where(store, world)
    states = {"waiting": "waiting in", "passed": "last passed", "gave up": "gave up waiting in"}
    for rank in range(world):
        entry = where.get(rank)
        at_this = entry is not None and entry[0] == seq
        (arrived if at_this and entry[1] == name else missing).append(rank)
        if entry is None:
            lines.append(f"rank {rank}: has made no monitored call yet")
        elif at_this and name is None:
            lines.append(f"rank {rank} ({entry[3]}): {entry[1]!r}")
        else:
            ago = "" if at_this else f", {time.time() - entry[4]:.0f} s ago"
            lines.append(f"rank {rank} ({entry[3]}): {states[entry[2]]} {entry[1]!r} (its call #{entry[0]}{ago})")
    head = f"{_ranks(arrived)} arrived; {_ranks(missing)} did not:\n  " if name is not None and arrived else ""
    return head + "\n  ".join(lines)


def monitored_barrier(name: str, timeout: datetime.timedelta | float | None = None) -> None:
    """Collective over every rank: wait until every rank has called ``monitored_barrier`` with the same `name` as
    its same-numbered monitored call -- or raise `CollectiveTimeoutError`:

    - at once, on every rank that has arrived or arrives, when some rank's call of the same number has another
      name (ranks calling the library's collectives in different orders: a ``save_state`` or ``wait_for_everyone``
      under ``if accelerator.is_main_process:``);
    - after `timeout` (default: `ndparallel.runtime.resolve_timeout`, ``$NDPARALLEL_TIMEOUT`` or 10 minutes), on
      every rank that arrived, when some rank has not: naming the ranks that arrived and those that did not, with
      the last monitored call each of those was in; a rank that arrives after that fails at once with the same
      message (it does not pass a barrier the others have given up on).

    It goes through the default process group's store (a few small requests per rank), not through a collective
    of the backend, so it works alike on gloo and NCCL and nothing can hang in it past `timeout`. A no-op in a world
    of one or before torch.distributed is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    timeout = resolve_timeout(timeout)
    heartbeat(name)
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    if _Barriers.store_id != id(store):
        _Barriers.store_id, _Barriers.seq = id(store), 0
    seq = _Barriers.seq
    _Barriers.seq += 1
    key, host = f"{_PREFIX}{seq}", socket.gethostname()

    def mark(state: str) -> None:
        store.set(f"{_PREFIX}at/{rank}", json.dumps([seq, name, state, host, time.time()]))

    def fail(message: str) -> CollectiveTimeoutError:
        mark("gave up")
        return CollectiveTimeoutError(message)

    def abort(message: str) -> str:
        """Post `message` for every rank of this barrier, those waiting and those still to come; return what was
        decided first: "abort", or "ok" when the last rank arrived just before."""
        store.set(f"{key}/abort", message)
        return store.compare_set(f"{key}/done", "", "abort").decode()

    try:
        mark("waiting")
        if rank == 0 and seq >= 2:  # every rank has left barrier seq-2 (they all reached seq-1): drop its keys
            for suffix in ("", "/name", "/done", "/abort"):
                store.delete_key(f"{_PREFIX}{seq - 2}{suffix}")
        first = store.compare_set(f"{key}/name", "", name).decode()
        if first != name:
            message = (f"monitored_barrier: the ranks reached different collective calls as their call #{seq} "
                       f"({' / '.join(repr(n) for n in sorted({first, name}))}). A collective call made on some ranks "
                       "only -- e.g. save_state or wait_for_everyone under `if accelerator.is_main_process:` -- leaves "
                       "the others behind: call it on every rank.\n  " + _report(store, world, seq, None))
            abort(message)
            raise fail(message)
        if store.add(key, 1) == world:  # the last to arrive opens the barrier, unless a rank gave up before
            store.compare_set(f"{key}/done", "", "ok")
        try:
            store.wait([f"{key}/done"], timeout)
        except Exception:  # noqa: BLE001 - the store's timeout (DistStoreError, or RuntimeError on older torch)
            message = (f"monitored_barrier({name!r}): not every rank arrived within {timeout.total_seconds():g} s "
                       f"(NDPARALLEL_TIMEOUT / InitProcessGroupKwargs(timeout=...)); "
                       + _report(store, world, seq, name) + "\nA rank that did not arrive is still working "
                       "(raise the timeout), stuck, or skipped this call (a collective call under `if "
                       "accelerator.is_main_process:`, or an exception on that rank only: see its own output).")
            if abort(message) != "ok":  # a rank arriving later fails at once with this message
                raise fail(message) from None
        if store.get(f"{key}/done") == b"abort":
            raise fail(store.get(f"{key}/abort").decode())
        mark("passed")
    except CollectiveTimeoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store itself failed: its host (rank 0 or the launcher) is gone
        raise CollectiveTimeoutError(
            f"monitored_barrier({name!r}): lost the rendezvous store ({type(exc).__name__}: {exc}); the process "
            "hosting it (rank 0, or its `ndparallel launch`) probably died: see that rank's output") from None


__all__ = [
    "CollectiveTimeoutError",
    "accelerator_fingerprint",
    "check_agreement",
    "dataloader_fingerprint",
    "jsonable",
    "model_fingerprint",
    "monitored_barrier",
    "optimizer_fingerprint",
    "prepare_fingerprint",
    "versions",
]

