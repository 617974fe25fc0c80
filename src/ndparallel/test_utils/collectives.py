"""What a dispatched collective op says about itself: the size of its group (for counters of what a step sends)."""

from __future__ import annotations

import torch


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
