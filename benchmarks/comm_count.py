"""Counting what a training step sends, and what it keeps in memory, on one rank.

`CollectiveCounter` is a `TorchDispatchMode`: every collective reaches the dispatcher as an op, whether FSDP2 calls
``torch.distributed`` (``c10d.*`` ops: ``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``...) or a
DTensor redistributes (``_c10d_functional.*`` ops); functional ops run the c10d op inside the mode's own call, so
nothing is counted twice. Per op it adds the bytes this rank *sends* under a bandwidth-optimal (ring) algorithm
on a group of n ranks:

    all-gather      (n - 1) * input bytes          reduce-scatter  (n - 1) * output bytes
    all-reduce      2 * (n - 1) / n * bytes        all-to-all      (n - 1) / n * input bytes
    broadcast       bytes (an upper bound; the root sends it once in a tree)

The same formulas give the analytic minimum in docs/benchmarks.md, so the comparison is of tensors, not of
algorithms: excess means bigger tensors (padding) or extra collectives.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.test_utils.collectives import group_size

KINDS = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "broadcast_": "broadcast",
    "broadcast": "broadcast",
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
    return _nbytes(args[0])


def _caller(skip: tuple[str, ...] = ("/torch/", "/contextlib.py", "comm_count.py")) -> str:
    """``file:line`` of the innermost frame outside torch (and this module): who asked for it."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in skip):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


class CollectiveCounter(TorchDispatchMode):
    """Inside ``with CollectiveCounter() as c:``, ``c.bytes[kind]`` / ``c.calls[kind]`` add up every collective;
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


# ---- memory ------------------------------------------------------------------------------------------------
def local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the scalar step counters
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(state)}


class SavedActivations:
    """Bytes autograd saves for backward during a forward (distinct storages), as ``saved_tensors_hooks`` see
    them: activations, plus any weight tensors a layer saves (FSDP2's unsharded parameters are freed after
    forward all the same)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        # Not the chunked loss's gradients, computed in its forward (the head's gradient, not an activation).
        if not isinstance(t, torch.nn.Parameter) and not getattr(t, "_ndparallel_loss_gradient", False):
            try:
                s = local.untyped_storage()
                self.storages[s.data_ptr()] = s.nbytes()
            except RuntimeError:  # a tensor without a plain storage (a wrapper subclass): its own bytes
                self.storages[id(local)] = local.numel() * local.element_size()
        return t

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
