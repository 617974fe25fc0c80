"""Collectives for metrics and logging: gather along ``batch``, reduce over ``loss``, the exact logged loss, padding,
and Accelerate's trigger (`ndparallel.distributed.gather_reduce` does the work). Each runs inside
`ndparallel.distributed.failures.watched`: nothing extra while it works; when the backend fails (the process-group
timeout) a `CollectiveTimeoutError` says which rank was in which call and which ranks were elsewhere."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import failures
from ..distributed import gather_reduce as operations
from ..training.loss import GradientState
from ..distributed.mesh import ParallelMesh
from ..distributed.state import AcceleratorState


class CollectivesMixin:
    """Part of `ndparallel.Accelerator`: collectives over the ranks that hold distinct data."""

    mesh: ParallelMesh
    gradient_state: GradientState
    device: torch.device
    state: AcceleratorState

    def _watched(self, call: str, view: str | None = None) -> contextlib.AbstractContextManager:
        """`call` watched over the ranks of mesh view `view` (every process without one), with the run's timeout."""
        ranks = None if view is None else (lambda: self.mesh.ranks(view))
        return failures.watched(call, ranks, self.state.runtime.timeout)

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (or dicts/lists of them) along dim 0 over the ranks with distinct samples (``batch``:
        tensor-, context- and sequence-parallel peers hold the same samples and are not counted twice)."""
        with self._watched("gather", "batch"):
            return operations.gather(tensor, self.mesh, "batch")

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """`gather`; on the final batch of a data loader, when it is not a whole global batch, only its real samples:
        the first ``gradient_state.remainder`` rows (the samples repeated to even it out across ranks come after
        them), as Accelerate does -- so a per-batch value repeated to the batch size (the Hugging Face Trainer's
        losses) counts as many times as the batch has samples."""
        keep = self.gradient_state.remainder
        if use_gather_object or not isinstance(data, (torch.Tensor, dict, list, tuple)):
            with self._watched("gather_for_metrics", "batch"):
                parts = operations.gather_object(data, self.mesh, "batch")
            flat = [x for part in parts for x in (part if isinstance(part, list) else [part])]
            return flat[:keep] if keep else flat
        with self._watched("gather_for_metrics", "batch"):
            gathered = operations.gather(data, self.mesh, "batch")
        return operations.map_tensors(gathered, lambda t: t[:keep]) if keep else gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or average over the ranks whose values are distinct contributions (the ``loss`` view)."""
        with self._watched("reduce", "loss"):
            return operations.reduce(tensor, self.mesh, "loss", reduction, scale)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global loss of this optimizer step, for logging. Collective.

        Call it once per micro-step with that micro-step's `loss` (this rank's mean, as passed to `backward`). For a
        causal LM it returns the mean over every loss token of every rank of the ``loss`` view and of the micro-steps
        of the current accumulation window so far -- on the micro-step that ends the window (``sync_gradients``),
        exactly the loss a single process computes on the whole global batch of the step, whatever the -100 labels,
        context / sequence shards and accumulation steps. For other losses (or without labels) it is the mean of the
        ranks' and micro-steps' losses, Accelerate's meaning. A float64 scalar tensor, so that summing many ranks' fp32
        losses adds no rounding of its own. See `ndparallel.training.loss`.
        """
        logged = self.gradient_state.log_loss(loss)
        with self._watched("reduce_loss", "loss"):
            sums = operations.reduce(logged, self.mesh, "loss", "sum")
        return sums[0] / sums[1]

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad tensors along `dim` to the largest size any process has, so they can be gathered. Collective."""
        with self._watched("pad_across_processes"):
            return operations.pad_across_processes(tensor, dim, pad_index, pad_first)

    # ---- Accelerate's trigger: one process asks every process to act (e.g. stop early) -------------------------------
    def set_trigger(self) -> None:
        """Raise this process's flag; the next `check_trigger` on every process returns True."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called `set_trigger` since the last check (then cleared).
        Collective."""
        flag = torch.tensor([1.0 if getattr(self, "_trigger", False) else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with self._watched("check_trigger"):
                dist.all_reduce(flag)
        self._trigger = False
        return bool(flag.item() > 0)
