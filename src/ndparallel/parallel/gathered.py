"""Parameters a forward left gathered: FSDP2's root unit keeps its parameters gathered from a forward to the backward
that follows; with no backward, something else must give them back (`release_gathered`). Imported by the prepared-model
interface and by the FSDP2 apply step; it imports nothing of the library."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # FSDP2's own unit states


def reshards_after_forward(requested: bool, shard_ranks: int, offloaded: bool) -> bool:
    """Whether FSDP2 units sharded over `shard_ranks` free their gathered parameters after forward, where the plugin
    asks for it (`requested`). A one-rank group (replication or tp only) frees nothing so -- its shard is the whole
    parameter, and keeping the gathered copy costs no memory -- unless `offloaded` (cpu_offload): then the shard lives
    in host memory, and resharding leaves only it there between a unit's forward and its backward, so the GPU holds
    the units it computes, not all of them. The rule of the FSDP2 apply step and of the planner."""
    return bool(requested) and (shard_ranks > 1 or offloaded)


_units: weakref.WeakKeyDictionary[nn.Module, list[FSDPModule]] = weakref.WeakKeyDictionary()


@torch.compiler.disable
def release_after_forward_without_gradients(module: nn.Module, args: object, output: object) -> None:
    """A forward hook on an FSDP2 root: a forward without gradients (an evaluation) has no backward to release what
    it gathered, so it releases it as it ends."""
    if not torch.is_grad_enabled():
        release_gathered(module)


def release_gathered(model: nn.Module) -> dict[int, torch.Tensor]:
    """Return to their shards the parameters of `model` that a forward left gathered with no backward after it.

    FSDP2 keeps the root unit's parameters (and those of units with ``reshard_after_forward=False``) gathered from
    a forward to the backward that follows. A forward that no backward follows -- an evaluation with gradients
    enabled, a loss never used -- leaves them gathered: ``model.parameters()`` are then not the sharded tensors the
    optimizer updates, the gathered bytes stay held, and an optimizer step would leave the gathered copy stale for
    the next forward. Idempotent and cheap when nothing is gathered (a few attribute reads per FSDP2 unit).

    Returns ``{id(gathered parameter): its sharded parameter}`` for what was released, so a caller holding the
    gathered tensors (a ``model.parameters()`` list taken before) can find the ones that hold the gradients.
    """
    units = _units.get(model)
    if units is None:  # the units of a prepared model do not change: found once
        units = _units[model] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    gathered = [unit for unit in units if _holds_gathered(unit)]
    if not gathered:
        return {}
    before = dict(model.named_parameters())
    for unit in gathered:
        unit.reshard()
    return {id(before[name]): param for name, param in model.named_parameters() if before.get(name) is not param}


def _holds_gathered(unit: FSDPModule) -> bool:
    """Whether the FSDP2 unit's parameters are (partly) gathered, and not by a forward or backward under way."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # newer torch; one group per unit (or none) before
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return any(not group.is_sharded and group._training_state == TrainingState.IDLE for group in groups)
