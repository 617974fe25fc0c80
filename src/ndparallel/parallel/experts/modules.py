"""Which modules of a model are its routed experts and routers (from the family table), and the checks that refuse,
on every rank alike and before any collective, what expert parallelism cannot split."""

from __future__ import annotations

from torch import nn

from ...models.families import Experts, expert_count_fields, expert_counts, expert_types
from ..target import Target, under_layers

# Config fields through which the table's mixtures of experts give their number of routed experts.
EXPERT_COUNTS = expert_count_fields()
# What transformers' `use_experts_implementation` sets on a stacked experts module (`compute` reads them).
STACKED_ATTRIBUTES = ("has_gate", "has_bias", "is_transposed")


def family_experts(model: nn.Module, target: Target | None = None) -> tuple[str | None, Experts | None]:
    """The model type and the family table's `Experts` entry for it (None where it has none). `target`: `model` as
    `parallelize` resolved it (resolved here when not given)."""
    target = Target.of(model) if target is None else target
    return target.model_type, target.experts


def expert_count(model: nn.Module, experts: Experts, target: Target | None = None) -> int:
    target = Target.of(model) if target is None else target
    return int(getattr(target.config, experts.count))


def expert_modules(model: nn.Module, experts: Experts) -> list[tuple[str, nn.Module]]:
    return under_layers(model, experts.modules)


def _stacked(module: nn.Module, count: int) -> list[str]:
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == count]


def check_experts(model: nn.Module, ep: int, target: Target | None = None) -> None:
    """Raise where ``ep_size=ep`` cannot split `model`'s experts: a model without experts, a family the table does not
    know, experts ep does not divide, an experts module that is not transformers' stacked layout."""
    if ep == 1:
        return
    target = Target.of(model) if target is None else target
    name = type(target.inner).__name__
    model_type, experts = target.model_type, target.experts
    if experts is None:
        counts = expert_counts(target.config)
        if not any(counts.values()):
            raise ValueError(f"ep_size={ep}: {name} has no experts (no {'/'.join(EXPERT_COUNTS)} in its config): "
                             "expert parallelism splits the experts of a mixture-of-experts model; drop ep_size")
        known = sorted(expert_types())
        raise ValueError(f"ep_size={ep}: {name} (model_type {model_type!r}, {counts}) is a mixture of experts whose "
                         f"router and experts ndparallel's family table does not know (it knows {known}: "
                         "ndparallel.models.families.FAMILIES); train it without ep_size (FSDP2 shards its "
                         "experts), or add an Experts entry for its family")
    count = expert_count(model, experts, target)
    if count % ep:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(f"ep_size={ep} must divide the experts of {name}: {experts.count}={count} cannot be split "
                         f"over {ep} ranks; use an ep_size in {divisors} (that also divides dp_shard x cp x sp)")
    modules, routers = target.expert_modules, target.routers  # found as `parallelize` began (`Target.of`)
    if not modules or len(routers) != len(modules):
        raise ValueError(f"ep_size={ep}: {name} has {len(modules)} experts module(s) named layers.*.{experts.modules} "
                         f"and {len(routers)} router(s) named layers.*.{experts.router}, where the family table "
                         f"expects one of each per sparse layer of {model_type!r}")
    for where, module in modules:
        implemented = (all(hasattr(module, a) for a in STACKED_ATTRIBUTES)
                       and not getattr(module, "has_post_expert_norm", False))
        stacked = _stacked(module, count)
        others = [n for n, _ in module.named_parameters() if n not in stacked]
        if not implemented or not stacked or others:
            raise ValueError(
                f"ep_size={ep}: {where!r} ({type(module).__name__}) is not transformers' stacked experts layout "
                f"(one weight per projection with the {count} experts along dimension 0, and the attributes "
                f"{list(STACKED_ATTRIBUTES)}); parameters {others or 'none'} are not stacked per expert. Expert "
                "parallelism splits that layout only (transformers >= 5 builds it); per-expert modules (an "
                "nn.ModuleList of MLPs, remote code, adapters on the experts) are trained without ep_size")
