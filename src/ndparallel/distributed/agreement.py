"""Ranks that must agree, and collectives that must not wait forever.

Every rank runs the same script, but not always with the same settings: an environment variable set on one node
only, a stale file, a different batch size computed from the host, a ``save_state`` under ``is_main_process``. Left
alone, such ranks hang in a collective, crash with a transport error ("Connection reset by peer"), or -- worst --
train silently apart. This module turns each into an error that names the cause, on every rank, in bounded time:

- `check_agreement(fingerprint, what)`: every rank contributes a small JSON-able fingerprint of what must agree; a
  64-bit digest of it rides on one `monitored_barrier` named `what` (no collective of the backend: the barrier
  alone costs about as much, see benchmarks/agreement.py); only when the digests differ are the fingerprints
  gathered (``all_gather_object``; long lists as a digest, and in full only when they differ), and every rank
  raises the same ValueError naming the fields, the ranks and their values. The Accelerator runs it at
  construction and at each ``prepare``, nothing per step.
- fingerprint helpers for what must agree: `accelerator_fingerprint` (parallelism config, plugin, mixed precision,
  accumulation, versions), `model_fingerprint` (parameter and buffer names, shapes, dtypes),
  `optimizer_fingerprint` (type, parameter groups and hyperparameters), `dataloader_fingerprint` (batch size,
  dataset kind and length -- not its class --, sampler kind), `prepare_fingerprint` (all of the objects given to one
  ``prepare``).
- `monitored_barrier(name, timeout, digest=None)`: a barrier through the default process group's store (so the
  same on gloo and NCCL) that, when ranks reach *different* named calls, fails at once, and when some rank does not
  arrive within `timeout`, fails on every rank that did -- saying which ranks arrived, which did not, and the last
  named call each rank was in, with the likely cause; it also tells every rank whether all gave the same `digest`.
  The library's collective entry points (``Accelerator(...)``, ``prepare``, ``save_state``, ``load_state``,
  ``wait_for_everyone``) enter through one.
- the per-step collectives, which cannot afford a barrier, are watched by `ndparallel.distributed.failures` instead:
nothing
  while they work, every rank's place when one fails.
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
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .._version import __version__
from .runtime import heartbeat, resolve_timeout, world_generation

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


def rank_list(ranks: Sequence[int]) -> str:
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


def check_agreement(fingerprint: dict[str, Any], what: str, group: dist.ProcessGroup | None = None,
                    timeout: datetime.timedelta | float | None = None) -> None:
    """Collective over every rank (or `group`): raise the same ValueError on every rank if the ranks' fingerprints
    differ, naming each differing field with the ranks and their values. Nothing happens in a world of one or
    before torch.distributed is initialised.

    `fingerprint` is a dict of JSON-able data (`jsonable` is applied); nested dicts are compared field by field
    (``parallelism.tp_size``). `what` names the call in the message. Over every rank (no `group`) the check rides
    on a `monitored_barrier` named `what` (with its `timeout`) that carries a 64-bit digest of each rank's
    fingerprint: when the ranks agree it costs that barrier and no collective of the backend. Over a `group`, one
    all-gather of the digests. Only when they differ are the fingerprints gathered, lists longer than 8 entries as a
    digest, and those lists in full only when their digests differ, to show the first differing entry.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    data = jsonable(fingerprint)
    digest = hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]  # 64 bits, as hex
    if group is None:
        if monitored_barrier(what, timeout, digest=digest):
            return
    else:
        heartbeat(f"check_agreement: {what}")
        size = dist.get_world_size(group)
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
            else torch.device("cpu")
        digests = torch.empty(size, dtype=torch.long, device=device)
        dist.all_gather_into_tensor(digests, torch.tensor([int.from_bytes(bytes.fromhex(digest), "little",
                                                                          signed=True)], device=device), group=group)
        if bool((digests == digests[0]).all()):
            return
    _disagreement(data, what, group)


def _disagreement(data: Any, what: str, group: dist.ProcessGroup | None) -> None:
    """Collective, on every rank once all know the fingerprints differ: gather them and raise the ValueError."""
    flat = _flatten(data, "", {})
    compact = {key: _compact(value) for key, value in flat.items()}
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
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
        lines.append(f"{key}: " + "; ".join(f"{rank_list(r)}: {v}" for v, r in by_value.items()))
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
    """Batch size, drop_last, the dataset's kind (map-style or iterable: they are dealt to ranks differently) and
    length (None when unknown), and the kinds of sampler. Not the dataset's class: the same rows may come as different
    classes on different ranks (tokenized on one, loaded from its cache on the others)."""
    from torch.utils.data import IterableDataset

    base = getattr(loader, "base_loader", loader)  # a PreparedDataLoader's
    try:
        length = len(base.dataset)
    except TypeError:
        length = None
    kind = "iterable" if isinstance(base.dataset, IterableDataset) else "map-style"
    return {"batch_size": base.batch_size, "drop_last": base.drop_last, "dataset": kind,
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
STATES = {"waiting": "waiting in", "passed": "last passed", "gave up": "gave up waiting in"}


class _Barriers:
    store: tuple[int, int] | None = None  # (world generation, id of the store) the sequence counts in
    seq: int = 0
    failed: ClassVar[set[int]] = set()  # barriers this rank did not pass (on rank 0: "abort" keys to drop)


def world_store() -> Any:
    return dist.distributed_c10d._get_default_store()


def barrier_places(store: Any, world: int) -> dict[int, list[Any]]:
    """Each rank's last monitored call: {rank: [seq, name, state, host, time]} (ranks that never made one: absent)."""
    out = {}
    for rank in range(world):
        key = f"{_PREFIX}at/{rank}"
        if store.check([key]):
            out[rank] = json.loads(store.get(key))
    return out


def post_failure(store: Any, rank: int, seq: int, call: str, started: float) -> None:
    """Say in the store that this rank's collective in per-step call `call` (its #`seq`, begun at `started`) failed
    (`ndparallel.distributed.failures`): the other ranks' reports read it (`failed_calls`)."""
    store.set(f"{_PREFIX}failed/{rank}", json.dumps([seq, call, socket.gethostname(), started, time.time()]))


def failed_calls(store: Any, ranks: Sequence[int]) -> dict[int, list[Any]]:
    """{rank: [seq, call, host, started, failed at]} of the `ranks` that posted a failed per-step collective."""
    keys = {r: f"{_PREFIX}failed/{r}" for r in ranks}
    return {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}


def where_ranks(timeout: datetime.timedelta | None = None) -> str:
    """Every rank's last monitored call, one line each, from the default store (waiting at most `timeout` for it)."""
    store, world = world_store(), dist.get_world_size()
    if timeout is not None:
        store.set_timeout(timeout)
    lines = []
    where = barrier_places(store, world)
    for rank in range(world):
        entry = where.get(rank)
        if entry is None:
            lines.append(f"rank {rank}: has made no monitored call yet")
        else:
            lines.append(f"rank {rank} ({entry[3]}): {STATES[entry[2]]} {entry[1]!r} (its call #{entry[0]}, "
                         f"{time.time() - entry[4]:.0f} s ago)")
    return "\n  ".join(lines)


def _report(store: Any, world: int, seq: int, name: str | None) -> str:
    """Where every rank is: its last monitored call and whether it waits there; with `name`, first which ranks are
    at call #`seq` named `name` and which are not."""
    lines, arrived, missing = [], [], []
    where, failed = barrier_places(store, world), failed_calls(store, range(world))
    for rank in range(world):
        entry = where.get(rank)
        at_this = entry is not None and entry[0] == seq
        (arrived if at_this and entry[1] == name else missing).append(rank)
        if rank in failed and not at_this:  # it was in a training step's collective, which failed meanwhile
            f_seq, f_call, f_host, f_started, f_at = failed[rank]
            lines.append(f"rank {rank} ({f_host}): in {f_call!r} (its step call #{f_seq}), whose collective failed "
                         f"after {f_at - f_started:.1f} s")
        elif entry is None:
            lines.append(f"rank {rank}: has made no monitored call yet")
        elif at_this and name is None:
            lines.append(f"rank {rank} ({entry[3]}): {entry[1]!r}")
        else:
            ago = "" if at_this else f", {time.time() - entry[4]:.0f} s ago"
            lines.append(f"rank {rank} ({entry[3]}): {STATES[entry[2]]} {entry[1]!r} (its call #{entry[0]}{ago})")
    head = f"{rank_list(arrived)} arrived; {rank_list(missing)} did not:\n  " if name is not None and arrived else ""
    return head + "\n  ".join(lines)


def grace_period(timeout: datetime.timedelta) -> float:
    """Seconds a rank whose collective failed waits for the others to say where they are: a tenth of the timeout,
    between 1 and 30 s (the others' timers started a little later, or they are in another collective)."""
    return min(max(timeout.total_seconds() / 10, 1.0), 30.0)


def _await_failures(store: Any, world: int, seq: int, name: str, timeout: datetime.timedelta) -> None:
    """A barrier that timed out: wait up to the grace period for the ranks that did not arrive to post where their
    own collective failed (a rank training on, whose next collective waits for this one, times out a moment after)."""
    deadline = time.monotonic() + grace_period(timeout)
    while time.monotonic() < deadline:
        where = barrier_places(store, world)
        missing = [r for r in range(world) if not (r in where and where[r][0] == seq and where[r][1] == name)]
        if len(failed_calls(store, missing)) == len(missing):
            return
        time.sleep(0.05)


def monitored_barrier(name: str, timeout: datetime.timedelta | float | None = None, digest: str | None = None) -> bool:
    """Collective over every rank: wait until every rank has called ``monitored_barrier`` with the same `name` as
    its same-numbered monitored call -- or raise `CollectiveTimeoutError`:

    - at once, on every rank that has arrived or arrives, when some rank's call of the same number has another
      name (ranks calling the library's collectives in different orders: a ``save_state`` or ``wait_for_everyone``
      under ``if accelerator.is_main_process:``);
    - after `timeout` (default: `ndparallel.distributed.runtime.resolve_timeout`, ``$NDPARALLEL_TIMEOUT`` or 10
    minutes), on
      every rank that arrived, when some rank has not: naming the ranks that arrived and those that did not, with
      the last monitored call each of those was in; a rank that arrives after that fails at once with the same
      message (it does not pass a barrier the others have given up on).

    Returns whether every rank gave the same `digest` (a string; `check_agreement` passes one of its fingerprint),
    the same answer on every rank: True when none was given. It goes through the default process group's store, not
    through a collective of the backend, so it works alike on gloo and NCCL and nothing can hang in it past
    `timeout`; a digest costs no request of its own (see `_barrier`). A no-op returning True in a world of one or
    before torch.distributed is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    timeout = resolve_timeout(timeout)
    heartbeat(name)
    store, rank, world = world_store(), dist.get_rank(), dist.get_world_size()
    # A new world starts the count again on every rank. The store's id alone cannot tell: a new world's store may
    # reuse the old one's memory on one rank and not on another (`runtime.world_generation`).
    key = (world_generation(), id(store))
    if _Barriers.store != key:
        _Barriers.store, _Barriers.seq, _Barriers.failed = key, 0, set()
    seq = _Barriers.seq
    _Barriers.seq += 1
    try:
        return _barrier(store, rank, world, seq, name, timeout, digest or "")
    except CollectiveTimeoutError:
        _Barriers.failed.add(seq)
        raise
    except Exception as exc:  # noqa: BLE001 - the store itself failed: its host (rank 0 or the launcher) is gone
        raise CollectiveTimeoutError(
            f"monitored_barrier({name!r}): lost the rendezvous store ({type(exc).__name__}: {exc}); the process "
            "hosting it (rank 0, or its `ndparallel launch`) probably died: see that rank's output") from None


def _barrier(store: Any, rank: int, world: int, seq: int, name: str, timeout: datetime.timedelta,
             digest: str) -> bool:
    """Barrier #`seq` in the store. Each rank: says where it is; claims the call's name and digest, or reads the
    first rank's; counts itself in -- by 1, or by 1 + (world + 1) when its digest differs from the first rank's, so
    that the count modulo world + 1 counts arrivals and the last rank learns from the quotient whether any digest
    differed; the last one posts "ok" or "differ" (or a rank that gave up posts "abort"); the others wait for that
    post and read it. When all goes well that is four requests a rank waits for (three for the last one; "where it
    is" is not waited for), and rank 0 then drops the keys of the barrier before."""
    key, host = f"{_PREFIX}{seq}", socket.gethostname()

    def mark(state: str) -> None:  # a store's set is not waited on
        store.set(f"{_PREFIX}at/{rank}", json.dumps([seq, name, state, host, time.time()]))

    def fail(message: str) -> CollectiveTimeoutError:
        mark("gave up")
        return CollectiveTimeoutError(message)

    def abort(message: str) -> str:
        """Post "abort" and `message` for every rank of this barrier, those waiting and those still to come, unless
        the last rank arrived just before; return what was decided first: "abort", "ok" or "differ"."""
        decided = store.compare_set(f"{key}/done", "", "abort").decode()
        if decided == "abort":  # the first to abort posts its message; readers' get waits for it
            store.compare_set(f"{key}/abort", "", message)
        return decided

    def posted() -> bytes:  # "done" exists: compare_set with an expected value it never has reads it in one request
        return store.compare_set(f"{key}/done", "\0", "\0")

    mark("waiting")
    first, first_digest = json.loads(store.compare_set(f"{key}/name", "", json.dumps([name, digest])))
    if first != name:
        message = (f"monitored_barrier: the ranks reached different collective calls as their call #{seq} "
                   f"({' / '.join(repr(n) for n in sorted({first, name}))}). A collective call made on some ranks "
                   "only -- e.g. save_state or wait_for_everyone under `if accelerator.is_main_process:` -- leaves "
                   "the others behind: call it on every rank.\n  " + _report(store, world, seq, None))
        abort(message)
        raise fail(message)
    stride = world + 1
    count = store.add(key, 1 if digest == first_digest else 1 + stride)
    if count % stride == world:  # the last to arrive opens the barrier, unless a rank gave up before
        done = store.compare_set(f"{key}/done", "", "ok" if count < stride else "differ")
    else:
        try:
            store.wait([f"{key}/done"], timeout)
        except Exception:  # noqa: BLE001 - the store's timeout (DistStoreError, or RuntimeError on older torch)
            _await_failures(store, world, seq, name, timeout)
            message = (f"monitored_barrier({name!r}): not every rank arrived within {timeout.total_seconds():g} s "
                       f"(NDPARALLEL_TIMEOUT / InitProcessGroupKwargs(timeout=...)); "
                       + _report(store, world, seq, name) + "\nA rank that did not arrive is still working "
                       "(raise the timeout), stuck, or skipped this call (a collective call under `if "
                       "accelerator.is_main_process:`, or an exception on that rank only: see its own output).")
            if abort(message) == "abort":  # a rank arriving later fails at once with this message
                raise fail(message) from None
        done = posted()
    if done == b"abort":
        raise fail(store.get(f"{key}/abort").decode())
    mark("passed")
    if rank == 0 and seq >= 1:  # every rank has arrived here, so has left barrier seq-1: drop its keys
        for suffix in ("", "/name", "/done") + (("/abort",) if seq - 1 in _Barriers.failed else ()):
            store.delete_key(f"{_PREFIX}{seq - 1}{suffix}")
        _Barriers.failed.discard(seq - 1)
    return done == b"ok"


__all__ = [
    "CollectiveTimeoutError",
    "where_ranks",
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

