"""Counting what a training step sends, on one rank: `CollectiveCounter` (collectives and host syncs) and
`StoreCounter` (c10d store operations); `group_size` reads a dispatched collective's group.

`CollectiveCounter` is a `TorchDispatchMode`: every collective reaches the dispatcher as an op, whether FSDP2 calls
``torch.distributed`` (``c10d.*`` ops: ``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``...) or a
DTensor redistributes (``_c10d_functional.*`` ops); functional ops run the c10d op inside the mode's own call, so
nothing is counted twice. Per op it adds the bytes this rank *sends* under a bandwidth-optimal (ring) algorithm
on a group of n ranks:

    all-gather      (n - 1) * input bytes          reduce-scatter  (n - 1) * output bytes
    all-reduce      2 * (n - 1) / n * bytes        all-to-all      (n - 1) / n * input bytes
    broadcast       bytes (an upper bound; the root sends it once in a tree)
    send_recv       the bytes sent; a receive adds none (its sender counts them)

Point to point (``dist.send``/``isend``, `P2POp` lists given to ``batch_isend_irecv``: ring context parallelism,
pipeline stages) reaches the dispatcher as one ``c10d.send`` op per tensor sent and one ``c10d.recv_`` per tensor
received (measured under gloo, which does not coalesce; torch's ``ProcessGroup::send`` dispatches the same op for every
backend, and NCCL's coalescing batches such ops into one launch). Kind ``send_recv`` counts the sends alone, one call
per tensor sent (a message): K and V passed in one ``batch_isend_irecv`` are two calls. ``recv_`` and
``recv_any_source_`` are not counted, so that a pair of ranks exchanging blocks counts each byte once, on the rank that
sends it, as the collectives above do.

The same formulas give the analytic minimum in docs/benchmarks.md, so the comparison is of tensors, not of
algorithms: excess means bigger tensors (padding) or extra collectives.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def group_size(args: tuple, kwargs: dict) -> int:
    """The number of ranks in the group of a collective op dispatched with `args` and `kwargs` (a c10d op carries its
    process group as a script object, a functional one its group's name)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    values = list(args) + list(kwargs.values())
    for a in values:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):  # a ReduceOp
                continue
    names = [a for a in values if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product")]
    return _resolve_process_group(names[-1]).size()


KINDS = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "broadcast_": "broadcast",
    "broadcast": "broadcast", "send": "send_recv",
}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def sent_bytes(kind: str, op: str, args: tuple, kwargs: dict, n: int) -> int:
    """Bytes this rank sends for one collective (the formulas of the module docstring)."""
    if kind == "all_gather":
        source = args[1] if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_") else args[0]
        return (n - 1) * _nbytes(source)
    if kind == "reduce_scatter":
        if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            return (n - 1) * _nbytes(args[0])
        return (n - 1) * _nbytes(args[0]) // n  # functional: the input; the output is 1/n of it
    if kind == "all_reduce":
        return 2 * (n - 1) * _nbytes(args[0]) // n
    if kind == "all_to_all":
        return (n - 1) * _nbytes(args[1] if op == "alltoall_base_" else args[0]) // n
    return _nbytes(args[0])  # broadcast: the tensors; send_recv: the tensors sent


def _caller(skip: tuple[str, ...] = ("/torch/", "/contextlib.py", "ndparallel/test_utils/collectives.py")) -> str:
    """``file:line`` of the innermost frame outside torch (and this module): who asked for it."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in skip):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class CollectiveCounter(TorchDispatchMode):
    """Inside ``with CollectiveCounter() as c:``, ``c.bytes[kind]`` / ``c.calls[kind]`` add up every collective
    (and every point-to-point send, kind ``send_recv``);
    ``c.by_group["all_reduce/4"]`` counts them by kind and group size. Host syncs -- ``item()``, ``int()``,
    ``float()``, ``bool()`` of a tensor all reach the dispatcher as ``aten._local_scalar_dense`` -- are counted in
    ``c.syncs`` and, by the innermost caller outside torch, in ``c.sync_sites``."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_group: dict[str, int] = defaultdict(int)
        self.syncs = 0
        self.sync_sites: dict[str, int] = defaultdict(int)
        self.sites = sites  # also record who made each collective and sync (slower: a stack walk each)
        self.collective_sites: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # An op on a tensor subclass (a DTensor) goes to the subclass first, with this mode still active, so the
        # collectives it issues to redistribute (a norm's partial sums) reach this mode as ops on plain tensors.
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        ns = func.namespace
        op = func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional") and op in KINDS:
            kind = KINDS[op]
            n = group_size(args, kwargs)
            self.bytes[kind] += sent_bytes(kind, op, args, kwargs, n)
            self.calls[kind] += 1
            self.by_group[f"{kind}/{n}"] += 1
            if self.sites:
                self.collective_sites[f"{kind}/{n} {_caller()}"] += 1
        elif ns == "aten" and op == "_local_scalar_dense":
            self.syncs += 1
            if self.sites:
                self.sync_sites[_caller()] += 1
        return func(*args, **kwargs)


STORE_METHODS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys", "multi_get",
                 "multi_set", "append", "queue_push", "queue_pop", "set_timeout")


class StoreCounter:
    """Inside ``with StoreCounter() as s:``, ``s.calls["get"]`` counts the c10d store operations made from Python
    (every Store subclass: TCPStore, PrefixStore, FileStore...), and ``s.sites`` who made them."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.sites: dict[str, int] = defaultdict(int)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> StoreCounter:
        import torch.distributed as dist

        for name in STORE_METHODS:
            original = getattr(dist.Store, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(store, *args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                self.sites[f"{_name} {_caller()}"] += 1
                return _original(store, *args, **kwargs)

            setattr(dist.Store, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist.Store, name, original)
        self._saved.clear()
