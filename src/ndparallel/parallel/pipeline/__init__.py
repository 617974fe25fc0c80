"""Pipeline parallelism over the ``pp`` axis: the model split into stages, run by torch's schedules.

`plan_pipeline` decides the stages (`split`: by parameter count or the user's split) and checks everything a
pipeline needs before any collective; `cut_to_rank` drops what this rank's stages do not run, keeping names; after
every other parallelism has been applied to what is left, `apply_pipeline` builds one module per local stage
(`stages`), lets the caller wrap each (mixed precision, FSDP2 / DDP: every stage is its own root), and returns the
`PipelineModel` whose call runs the schedule (`runner`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ...distributed.mesh import ParallelMesh
from ..options import PrepareOptions
from ..target import target_of
from .balancing import balancing_term
from .runner import PipelineModel, check_schedule
from .split import StageLayers, StagePlan, cut_to_rank, plan_stages
from .stages import build_stage


def plan_pipeline(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> StagePlan | None:
    """The stage plan of `model` (None without pipeline stages); raises for what a pipeline cannot run."""
    pp = mesh.size("pp")
    if pp == 1:
        return None
    handler = options.pp_handler
    if options.tp_handler.loss_parallel:
        raise ValueError(f"pp_size={pp}: loss_parallel is not supported with pipeline stages (the last stage "
                         "computes the loss from whole logits); set TorchTensorParallelConfig(loss_parallel=False)")
    if options.mixed_precision == "fp16":
        raise ValueError(f"pp_size={pp}: fp16 mixed precision (a gradient scaler) is not supported with pipeline "
                         "stages, whose backward runs inside the schedule; use mixed_precision='bf16'")
    dynamo = options.dynamo_plugin
    if dynamo is not None and dynamo.backend not in (None, "no", "NO") and not dynamo.use_regional_compilation:
        raise ValueError(f"pp_size={pp}: whole-model compilation is not supported with pipeline stages; use "
                         "regional compilation (TorchDynamoPlugin(use_regional_compilation=True))")
    if handler.schedule in ("zero_bubble", "zbv"):
        # These split each backward into input and weight gradients. Measured here: with parameters sharded (FSDP2
        # over dp_shard x cp x sp > 1) the weight gradients miss FSDP2's reduce-scatter and training drifts
        # (1e-2 in 6 steps), and activation checkpointing fails inside torch's split backward.
        plugin = options.fsdp_plugin
        if mesh.size("fsdp") > 1:
            raise ValueError(f"pp_size={pp}: schedule {handler.schedule!r} computes weight gradients after FSDP2 "
                             f"has reduced them, with parameters sharded over dp_shard x cp x sp = "
                             f"{mesh.size('fsdp')}; use '1f1b' or 'interleaved_1f1b' (or replicate: dp_replicate)")
        if plugin is not None and plugin.activation_checkpointing:
            raise ValueError(f"pp_size={pp}: schedule {handler.schedule!r} splits backward in two, which "
                             "activation checkpointing does not support; use '1f1b' or 'interleaved_1f1b'")
    plan = plan_stages(model, pp, handler, target_of(model, options))
    check_schedule(handler, plan)
    return plan


def apply_pipeline(model: nn.Module, plan: StagePlan, mesh: ParallelMesh, options: PrepareOptions,
                   wrap: Callable[[nn.Module], nn.Module]) -> PipelineModel:
    """Build this rank's stage modules from `model` (already cut to them), ``wrap`` each, and return the model that
    runs the schedule."""
    pp_rank = mesh.rank("pp")
    target = target_of(model, options)
    stages = {s: wrap(build_stage(model, plan, s, target.inner)) for s in plan.stages_of(pp_rank)}
    # A mixture of experts' load-balancing term over every stage's layers and the global batch (`balancing`).
    balancing = balancing_term(target.inner, stages, mesh.group("pp"),
                               mesh.group("loss") if mesh.size("loss") > 1 else None, options.device, target)
    return PipelineModel(model, stages, plan, options.pp_handler, mesh.group("pp"), options.device,
                         tie_group=_ends_group(mesh) if plan.tied else None, loss_factor=options.loss_factor,
                         sync_gradients=options.sync_gradients, balancing=balancing, adapted=target.inner)


def _ends_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """Collective: for a tied embedding and LM head, the group of this rank's two copies -- the rank of the first
    stage and the rank of the last stage at the same place inside their stages (None on the ranks between). Every
    rank creates every pair, in the same order, as `new_group` requires."""
    grid = mesh.world.mesh  # pp outermost: grid[0] the first stage's ranks, grid[-1] the last's, in the same order
    mine = None
    for first, last in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist()):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


__all__ = ["PipelineModel", "StageLayers", "StagePlan", "apply_pipeline", "cut_to_rank", "plan_pipeline"]
