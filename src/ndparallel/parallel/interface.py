"""The one interface of what `prepare` returns for a model, for the Accelerator and checkpoints.

They never ask what kind of model they hold; they ask `interface(model)`:

- `state_module`: the module whose state dict a checkpoint holds, under the model's own parameter names;
- `unwrapped`: the model under its own names, without a wrapper that renames (DDP's ``module.``);
- `holds_every_parameter`: whether every parameter of the model has its place on this rank (whole, or a shard of it);
  False when other ranks own some parameters outright (pipeline stages) -- then tables of tensors and full state
  dicts are gathered from those ranks (`gather_parts`), and parameters this rank does not own are dropped;
- `tied_copy_names`: names of this rank's second copies of a tied weight, and the weight's first name;
- `norm_duplicates`: parameters whose gradient another rank counts in the gradient norm already;
- `consume_backward`: whether the model's last call already ran this step's backward (then `Accelerator.backward`
  has nothing left to do);
- `release_gathered`: return to their shards the parameters a forward left gathered with no backward after it (an
  evaluation, a loss never used), before anything reads or updates the parameters (`data_parallel.release_gathered`).

A model that runs backward itself gets what it needs at construction, from `PrepareOptions`: the factor the loss of
this rank is weighted by (``loss_factor``, `ndparallel.training.loss`) and whether the micro-step ends the optimizer
step (``sync_gradients``). Nothing is set on it afterwards.

`WholeModel` is the default, for any model whose every rank holds all of it (plain, DDP, FSDP2, TP, CP/SP: torch's
state-dict functions see through these). A wrapper that splits the model across ranks -- `PipelineModel` does --
subclasses `PreparedModel` and answers for itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .gathered import release_gathered


class PreparedModel:
    """What the Accelerator and checkpoints ask of a prepared model (see the module docstring). The defaults are those
    of a model whose every rank holds all of it."""

    holds_every_parameter: bool = True

    def state_module(self) -> nn.Module:
        raise NotImplementedError

    def unwrapped(self) -> nn.Module:
        raise NotImplementedError

    def tied_copy_names(self) -> dict[str, str]:
        return {}

    def norm_duplicates(self) -> list[nn.Parameter]:
        return []

    def consume_backward(self) -> bool:
        return False

    def release_gathered(self) -> dict[int, torch.Tensor]:
        """Parameters left gathered by a forward without backward go back to their shards; returns ``{id(gathered
        parameter): sharded parameter}`` of those released. Not collective."""
        return release_gathered(self.state_module())

    def gather_parts(self, state: dict[str, Any]) -> dict[str, Any]:
        """Collective where other ranks own parts of the model: every part's `state` (full tensors) on rank 0, an
        empty dict elsewhere. A whole model has no other parts: its `state` is all of it."""
        return state


class WholeModel(PreparedModel):
    """The default interface: `model` is whole on every rank (plain, or wrapped by DDP / FSDP2 / TP / CP / SP)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_module(self) -> nn.Module:
        return self.model  # torch's state-dict functions see through DDP and FSDP2

    def unwrapped(self) -> nn.Module:
        """Without DDP's wrapper (FSDP2 and activation checkpointing change no parameter names)."""
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model


def interface(model: nn.Module) -> PreparedModel:
    """The interface of a model `prepare` returned: the model itself where it implements one, else `WholeModel`."""
    return model if isinstance(model, PreparedModel) else WholeModel(model)


def state_module(model: nn.Module) -> nn.Module:
    """The module whose state dict a checkpoint holds, under the model's own names (`PreparedModel.state_module`)."""
    return interface(model).state_module()


def unwrap(model: nn.Module) -> nn.Module:
    """The model under its own parameter names (`PreparedModel.unwrapped`)."""
    return interface(model).unwrapped()
