"""The training step of the `Accelerator`, top to bottom: the loss weighted and backward, accumulation windows and
gradient sync, context-parallel sharding of a batch, autocast, clipping.

The loss. `backward` scales this rank's mean loss by `GradientState.loss_factor` (`ndparallel.training.loss` says why:
the gradients then equal one process's over the global batch of the optimizer step, whatever the -100 labels over ranks
and micro-steps) -- unless a model already ran the step's backward inside its call (pipeline stages), which weighs its
loss itself by `_loss_weight_inside_the_model`, given to it at construction.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from ..training import clip
from ..distributed import failures
from .. import parallel
from ..configuration.parallelism import ParallelismConfig
from ..configuration.dtypes import compute_dtype
from ..training.loss import GradientState
from ..distributed.mesh import ParallelMesh
from ..training.optim import AcceleratedOptimizer
from ..parallel.sequence import SequenceSharding
from ..training.prepared import PreparedObjects
from ..distributed.runtime import heartbeat
from ..fault_tolerance import ReplicaGroups


class TrainingStepMixin:
    """Part of `ndparallel.Accelerator`: what a training loop calls between prepare and the optimizer step."""

    gradient_state: GradientState
    prepared: PreparedObjects
    mesh: ParallelMesh
    parallelism_config: ParallelismConfig
    sequence_sharding: SequenceSharding | None
    mixed_precision: str
    gradient_accumulation_steps: int
    scaler: torch.amp.GradScaler | None
    sync_gradients: bool
    _settings: Any
    _accumulating: int
    _warned_outside_accumulate: bool
    replica_groups: ReplicaGroups | None

    def _loss_weight_inside_the_model(self) -> float:
        """What a model that runs backward inside its own call (pipeline stages) weighs this rank's loss by: the
        factor `backward` would scale it by (`GradientState.loss_factor`). A loop that scales the loss it gets back
        before calling `backward` -- the Hugging Face Trainer does -- needs that scale here as well
        (`ndparallel.integrations.trainer`)."""
        return self.gradient_state.loss_factor()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with the loss weighted so gradients equal the single-process ones.

        `loss` must be this rank's mean loss over its own samples or tokens (what HF models return); see
        `ndparallel.training.loss` for the factor and why.
        """
        heartbeat("backward")  # progress that `ndparallel launch --stall-timeout` watches
        kwargs.pop("learning_rate", None)  # Accelerate's LOMO argument: no LOMO optimizers here
        # A model whose call ran this step's backward already (pipeline stages: ndparallel.parallel.pipeline) leaves
        # nothing to do; every model is asked (a list, not a generator), so every such flag is cleared.
        if any([parallel.interface(m).consume_backward() for m in self.prepared.models]):
            return
        if self.gradient_accumulation_steps > 1 and not self._accumulating and not self._warned_outside_accumulate:
            self._warned_outside_accumulate = True  # once: a loop that does this does it every micro-step
            warnings.warn(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, but backward() runs outside "
                "`with accelerator.accumulate(model):`, so gradients synchronise and optimizer.step() updates on every "
                "micro-batch (as in Accelerate); wrap each micro-step in accelerator.accumulate(model) to accumulate",
                stacklevel=2)
        loss = loss * _factor_like(loss, self.gradient_state.loss_factor())
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self.loss_parallel(), failures.explained("backward", self.state.runtime.timeout):
            loss.backward(**kwargs)
        if self.replica_groups is not None and self.sync_gradients:  # fault tolerance: over the replica groups too
            self.replica_groups.average_gradients(self.prepared.models, loss)

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """torch's `loss_parallel` context when ``TorchTensorParallelConfig(loss_parallel=True)`` and tp > 1 (else
        nothing): cross-entropy on logits split over the vocabulary. Prepared models enter it for their own
        forward and `backward` for the backward; wrap a loss you compute yourself from ``outputs.logits`` in it."""
        if self.mesh.size("tp") > 1 and self.parallelism_config.tp_handler.loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients synchronise (and the optimizer steps) only on the last of a window (on every
        micro-step with ``GradientAccumulationPlugin(sync_each_batch=True)``)."""
        sync = self.gradient_state.advance()
        self._accumulating += 1
        try:
            with contextlib.ExitStack() as stack:
                if not sync and not self._settings.sync_each_batch:
                    for model in models or self.prepared.models:
                        stack.enter_context(self.no_sync(model))
                yield
        finally:
            self._accumulating -= 1

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradient reduction of backward passes inside (gradients accumulate locally)."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Reduce gradients in the backward passes inside even on an accumulation micro-step."""
        if isinstance(model, DistributedDataParallel):
            before = (model.require_backward_grad_sync, model.require_forward_param_sync)
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            # A forward run under no_sync did not arm DDP's reducer for this backward: arm it now (every parameter
            # expected, as DDP does after a synchronising forward without find_unused_parameters).
            model.reducer.prepare_for_backward([])
            try:
                yield
            finally:
                model.require_backward_grad_sync, model.require_forward_param_sync = before
        elif isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(True)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(self.sync_gradients or self._settings.sync_each_batch)
        else:
            yield

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
        """Shard `buffers` in place along `buffer_seq_dims` over ``cp x sp`` for the block; a no-op without CP/SP.

        Inside, each buffer holds this rank's part of every sequence (load-balanced: chunks r and ``2*cp-1-r``
        of ``2*cp``; with sp > 1, a contiguous 1/sp of that; see `ndparallel.parallel.sequence.SequenceShards`) and the
        prepared model's attention spans the whole sequence. On exit, buffers not in `no_restore_buffers` get their
        full contents back. Pass ``shift_labels`` (labels shifted by one *before* sharding) rather than ``labels``,
        and ``position_ids``; run backward inside too. Nothing here communicates: bad input raises on every rank
        before any collective.
        """
        if buffers is not None and buffer_seq_dims is not None and len(buffers) != len(buffer_seq_dims):
            raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but {len(buffer_seq_dims)} "
                             "buffer_seq_dims")
        if self.sequence_sharding is None:
            yield
            return
        batch = self.gradient_state.batch
        with self.sequence_sharding.sharded(buffers, buffer_seq_dims, no_restore_buffers,
                                            expected_tokens=batch.local_tokens if batch is not None else None,
                                            shards=batch.sequence_shards if batch is not None else None):
            yield

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        """``torch.autocast`` in the mixed-precision dtype (nothing with mixed_precision="no"); an
        `AutocastKwargs` overrides the Accelerator's."""
        dtype = compute_dtype(self.mixed_precision)
        kwargs = {**self._settings.autocast_kwargs, **(autocast_handler.to_kwargs() if autocast_handler else {})}
        enabled = dtype is not None and kwargs.pop("enabled", True)
        with torch.autocast(self.device.type, dtype=dtype, enabled=enabled, **kwargs):
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        if self.scaler is None:
            return
        optimizers = [optimizer] if isinstance(optimizer, AcceleratedOptimizer) else (optimizer or
                                                                                      self.prepared.optimizers)
        for opt in optimizers:
            try:
                self.scaler.unscale_(opt.optimizer)
            except RuntimeError as exc:  # already unscaled since the last update(): nothing to do
                if "already been called" not in str(exc):
                    raise

    def _settled(self, parameters: Any) -> list[torch.Tensor]:
        """`parameters` as a list, with the models' parameters a forward left gathered (no backward after it) back on
        their shards, and any gathered tensor in `parameters` (a ``model.parameters()`` taken before) replaced by the
        sharded one, which holds the gradient (`PreparedModel.release_gathered`)."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        released = self.prepared.release_gathered()
        return [released.get(id(p), p) for p in parameters] if released else parameters

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the total gradient norm, computed correctly over sharded (DTensor) and plain gradients."""
        parameters = self._settled(parameters)
        self.unscale_gradients()
        # Pipeline stages hold different parameters: their parts of the norm add up over ``pp`` (a tied weight's
        # second copy, on the last stage, counted once).
        stages = self.mesh.group("pp") if self.mesh.size("pp") > 1 else None
        twice = {id(p) for m in self.prepared.models for p in parallel.interface(m).norm_duplicates()}
        with failures.explained("clip_grad_norm_", self.state.runtime.timeout):
            return clip.clip_grad_norm_(parameters, max_norm, norm_type, across=stages, counted_elsewhere=twice)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] (elementwise: exact on shards)."""
        parameters = self._settled(parameters)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)


def _factor_like(loss: torch.Tensor, factor: float | torch.Tensor) -> float | torch.Tensor:
    """The loss factor as `loss` can be multiplied by it: a float as it is; a 0-dim tensor (computed on the device,
    `ndparallel.training.loss.TokenTotal`) in the loss's dtype, and replicated over the loss's mesh when the loss is a
    DTensor (tensor parallelism's loss_parallel)."""
    if not isinstance(factor, torch.Tensor):
        return factor
    factor = factor.to(loss.device, loss.dtype)
    if isinstance(loss, DTensor):
        return DTensor.from_local(factor, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return factor
