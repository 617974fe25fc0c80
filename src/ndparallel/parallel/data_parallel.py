"""Data parallelism in its three forms, always the outermost wrapper (applied last).

- FSDP2 (`fully_shard`) over the ``fsdp`` view (dp_shard x cp x sp) when that view has more than one rank or
  an FSDP plugin was given; HSDP (replicate over ``dp_replicate``, shard over ``fsdp``) when dp_replicate > 1
  too.
- DDP over the ``loss`` view when nothing is sharded but several ranks see different data. With tensor
  parallelism, torch's `DistributedDataParallel` does not take DTensor parameters, so replication is done by
  FSDP2 over a shard group of one rank (HSDP with dp_shard = 1): gradients are all-reduced over dp_replicate as
  DDP would, and the parameters stay DTensors for the optimizer, clipping and checkpoints. Pipeline stages
  replicate the same way: DDP's reducer cannot follow a schedule's many backward passes per step.
- Experts split by expert parallelism (``ep_size``): FSDP2 over the ranks that hold the same experts
  (`experts.shard_experts`), inside the blocks' FSDP2 over ``fsdp``.
- Nothing on a world of one rank, also with an FSDP plugin unless it asks for what FSDP2 does there too (CPU
  offload, its own mixed-precision policy, meta-device loading): one rank has nothing to shard or reduce, and
  FSDP2's per-block hooks and copies cost 11% of a 1.1B model's step on an H100 (docs/gpu.md). The plugin's
  activation checkpointing and the mixed precision (autocast) still apply, as without FSDP.

Either way gradients end up *averaged* over the ``loss`` view; `ndparallel.training.loss` relies on that.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from ..configuration.parallelism import ParallelismConfig
from ..distributed.mesh import ParallelMesh
from ..configuration.plugins import FullyShardedDataParallelPlugin, derived_policy
from .blocks import modules_to_wrap
from .experts import shard_experts
from .gathered import release_after_forward_without_gradients, reshards_after_forward
from .options import PrepareOptions
from .target import target_of


def uses_fsdp(config: ParallelismConfig, plugin: FullyShardedDataParallelPlugin | None) -> bool:
    """Whether FSDP2 wraps the model under the resolved `config`: parameters are sharded (fsdp > 1), a plugin asks
    for it (and there is more than one rank, or it asks for what FSDP2 does on one), or DDP meets TP or pipeline
    stages (above)."""
    fsdp = config.layout().fsdp
    replicated = config.dp_replicate_size * fsdp > 1
    if plugin is not None and config.total_size == 1:
        return bool(plugin.offloads_to_cpu or plugin.mixed_precision_policy is not None
                    or plugin.cpu_ram_efficient_loading)
    return plugin is not None or fsdp > 1 or (replicated and (config.tp_size > 1 or config.pp_size > 1))


def _ignored_params(model: nn.Module, ignored) -> set[nn.Parameter]:
    if ignored is None:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name) or pattern.search(name)]
        if not modules:
            raise ValueError(f"ignored_modules regex {ignored!r} matches no module name of {type(model).__name__}")
    else:
        modules = list(ignored)
        owned = set(map(id, model.modules()))
        stray = [type(m).__name__ for m in modules if id(m) not in owned]
        if stray:
            raise ValueError(f"ignored_modules: {stray} are not submodules of the model being prepared")
    return {p for m in modules for p in m.parameters()}


def mixed_precision_policy(plugin: FullyShardedDataParallelPlugin | None,
                           dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """The plugin's policy when it has one (given, or set by the Accelerator: `set_mixed_precision`); else compute in
    `dtype`, reduce gradients in fp32 (`plugins.derived_policy`)."""
    if plugin is not None and plugin.mixed_precision_policy is not None:
        return plugin.mixed_precision_policy
    return derived_policy(dtype) or MixedPrecisionPolicy()


@torch.no_grad()
def broadcast_module_states(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank of `group` (default: the world) hold its first rank's parameters and buffers (as DDP does
    when it is built). Under pipeline stages the group is the stage's ranks, which hold the same part of the model.

    FSDP2 shards whatever each rank holds, so ranks that were initialised differently would otherwise train
    replicas (HSDP) or shards that never agreed.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_meta:  # nothing to send: the weights arrive later (a checkpoint load)
            continue
        dist.broadcast(tensor.data, group_src=0, group=group)


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Shard each transformer block, then the root, over ``fsdp`` (HSDP when dp_replicate > 1)."""
    plugin = options.fsdp_plugin or FullyShardedDataParallelPlugin()
    dp_mesh = mesh.data_parallel()
    # Pinned host memory needs CUDA: a CPU-only run offloads unpinned.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=plugin.cpu_offload.pin_memory and options.device.type == "cuda")
        if plugin.offloads_to_cpu else OffloadPolicy()
    )
    reshard = reshards_after_forward(plugin.reshard_after_forward, mesh.size("fsdp"), plugin.offloads_to_cpu)
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mixed_precision_policy(plugin, options.dtype),
        offload_policy=offload,
        ignored_params=_ignored_params(model, plugin.ignored_modules) or None,
    )
    if any(p.requires_grad for p in kwargs["ignored_params"] or ()) and dp_mesh.size() > 1:
        warnings.warn(
            "ignored_modules hold trainable parameters: FSDP2 neither shards them nor reduces their gradients, so "
            "each rank updates its own copy; freeze them (requires_grad_(False)) unless that is what you want",
            stacklevel=3,
        )
    blocks = list(target_of(model, options).block_types)
    policy = "no_wrap" if plugin.auto_wrap_policy is None else plugin.auto_wrap_policy  # None: set_auto_wrap_policy's
    if policy == "transformer_based_wrap" and not blocks:
        warnings.warn(
            f"{type(model).__name__} names no transformer block classes (no _no_split_modules and no "
            "transformer_cls_names_to_wrap): FSDP2 shards the root module only",
            stacklevel=3,
        )
    # Experts split by expert parallelism: over the ranks that hold the same experts, before the blocks around them.
    shard_experts(model, mesh, fully_shard, **{**kwargs, "ignored_params": None, "reshard_after_forward": reshard})
    for module in modules_to_wrap(model, policy, blocks, plugin.min_num_params):
        # The chunked loss's head (`memory.loss_head`) computes after its own forward: it stays in the root unit.
        if not getattr(module, "_ndparallel_keep_in_root", False):
            fully_shard(module, reshard_after_forward=reshard, **kwargs)
    # The root keeps its parameters gathered from forward to backward, which starts with them (the LM head): torch's
    # own choice for the root (None), as in hand-written FSDP2 and torchtitan. Resharding it would free them only
    # until backward begins, for one more all-gather per micro-step (issue 33).
    fully_shard(model, reshard_after_forward=None if reshard else False, **kwargs)
    # ...but a forward without gradients (evaluation) has no backward to end it: it releases them at once.
    model.register_forward_hook(release_after_forward_without_gradients)
    model._ignored_params = set(kwargs["ignored_params"] or ())  # Accelerate's attribute: what FSDP2 left alone
    return model


def apply_ddp(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    device = options.device
    return DistributedDataParallel(
        model,
        process_group=mesh.group("loss"),
        device_ids=[device.index] if device.type == "cuda" else None,
        **options.ddp_kwargs,  # DistributedDataParallelKwargs
    )


def apply_data_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """FSDP2 / HSDP, DDP, or nothing (see the module docstring): the outermost wrapper, applied last."""
    if options.fsdp:
        return apply_fsdp(model, mesh, options)
    # The plugin's ignored modules must fit `model` also where no FSDP2 wrap reads them (DDP, one process), so a script
    # fails the same way on 1 process as on 8 (its block classes were checked as `parallelize` began: `Target.of`).
    ignored = None if options.fsdp_plugin is None else _ignored_params(model, options.fsdp_plugin.ignored_modules)
    if mesh.size("loss") > 1:
        return apply_ddp(model, mesh, options)
    if ignored is not None:  # one process: no FSDP2 wrap, so nothing is sharded; the plugin's ignored_modules name
        model._ignored_params = ignored  # these, as `apply_fsdp` records them (Accelerate wraps even one process)
    return model

