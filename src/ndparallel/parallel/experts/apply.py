"""The check and apply steps of expert parallelism, and what FSDP2 needs to wrap the experts."""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from ...distributed.mesh import ParallelMesh
from ..gathered import reshards_after_forward
from ..options import PrepareOptions
from ..target import target_of
from .dispatch import ExpertShard, expert_parallel_forward
from .modules import check_experts, expert_count, family_experts

SHARD_ATTRIBUTE = "_ndparallel_expert_shard"  # set on each experts module the apply step split (its ExpertShard)


def check_expert_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> None:
    """Raise, on every rank alike, where ``ep_size`` cannot split `model` (`modules.check_experts`)."""
    check_experts(model, mesh.size("ep"), target_of(model, options))


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Give each rank of ``ep`` its experts -- every stacked expert weight becomes a DTensor sharded along the experts
    over ``ep`` -- and make each experts module exchange tokens with the ranks holding the others
    (`dispatch.expert_parallel_forward`). A no-op when ``ep`` has one rank."""
    if mesh.size("ep") == 1:
        return model
    target = target_of(model, options)
    _, experts = family_experts(model, target)
    shard = ExpertShard(mesh.group("ep"), mesh.size("ep"), mesh.rank("ep"), expert_count(model, experts, target))
    mine = slice(shard.rank * shard.local, (shard.rank + 1) * shard.local)
    for module in target.experts_in(model):  # this pipeline stage's, under pipeline parallelism
        for name, param in list(module.named_parameters(recurse=False)):
            # Every rank holds the same full weights here (broadcast by `parallelize`); meta ones stay meta.
            part = param.detach()[mine].clone()
            sharded = DTensor.from_local(part, mesh["ep"], [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = functools.partial(expert_parallel_forward, module, shard)
        setattr(module, SHARD_ATTRIBUTE, shard)
    return model


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules `apply_expert_parallel` split, in module order (FSDP2 wraps each before its block)."""
    return [m for m in model.modules() if hasattr(m, SHARD_ATTRIBUTE)]


def shard_experts(model: nn.Module, mesh: ParallelMesh, fully_shard, /, **kwargs) -> None:
    """FSDP2 over each split experts module, on ``mesh.expert_data_parallel()`` (its ranks hold the same experts):
    gradients averaged over them (the ep ranks' sum arrives divided by ep, `compute.run_local_experts`), parameters
    sharded over ``expert_shard``. The experts' inputs arrive in the block's compute dtype already: FSDP2 leaves them
    (and the router's fp32 weights) as they are."""
    modules = expert_parallel_modules(model)
    policy: MixedPrecisionPolicy = kwargs.pop("mp_policy")
    kwargs.update(mesh=mesh.expert_data_parallel() if modules else None,
                  mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
    kwargs["reshard_after_forward"] = reshards_after_forward(
        kwargs.get("reshard_after_forward", True), mesh.size("expert_shard"),
        isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy))
    for module in modules:
        fully_shard(module, **kwargs)
