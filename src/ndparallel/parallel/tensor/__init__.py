"""Tensor parallelism over the ``tp`` view: `plans` (where a plan comes from, resolving it, the check and apply
steps), `styles` (each style name as a torch ``ParallelStyle``), `presharded` (models transformers already split,
gathered back). The per-family plans and fused layers are data in `ndparallel.models.families`."""

from .plans import (
    ALIASES,
    BUILTIN_PLANS,
    STYLES,
    apply_tensor_parallel,
    check_plan,
    check_tensor_parallel,
    choose_plan,
    hf_plan,
    plan_styles,
    resolve_plan,
    resolve_tensor_parallel,
    tensor_parallel_styles,
    tie_styles,
    with_sequence_parallel,
)
from .presharded import gather_presharded

__all__ = ["ALIASES", "BUILTIN_PLANS", "STYLES", "apply_tensor_parallel", "check_plan", "check_tensor_parallel",
           "choose_plan", "gather_presharded", "hf_plan", "plan_styles", "resolve_plan", "resolve_tensor_parallel",
           "tensor_parallel_styles", "tie_styles", "with_sequence_parallel"]
