"""What autograd keeps for backward, counted on the CPU: the bytes of the distinct storages the saved tensors live in,
parameters aside."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def kept_bytes(run: Callable[[], object], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages `run()` saves for backward (each storage once), less those of `parameters`."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    return sum(n for ptr, n in kept.items() if ptr not in weights)


def training_step_kept_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """What a causal LM's forward and backward on `ids` (labels the same) keep, parameters aside."""
    return kept_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward(), model.parameters())
