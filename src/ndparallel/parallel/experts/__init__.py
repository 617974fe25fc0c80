"""Expert parallelism (``ParallelismConfig(ep_size=...)``): the routed experts of a mixture-of-experts model split over
the ``ep`` ranks, tokens sent to their experts and back all-to-all. Exact and dropless: every token reaches its top-k
experts, whatever the routing imbalance, and the step equals one process's (docs/expert_parallel.md).

Where the ranks come from (`ndparallel.distributed.mesh`): ``ep`` is carved out of ``fsdp`` (dp_shard x cp x sp), ranks
that already hold different tokens, so it does not multiply the world size. Non-expert weights stay sharded by FSDP2
over all of ``fsdp``; each expert weight is a DTensor sharded along the experts over ``ep``, which FSDP2 shards further
over ``expert_shard`` (= fsdp / ep) and replicates over dp_replicate (`apply.shard_experts`). tp ranks hold the same
tokens and the experts whole (transformers' ``moe_tp_experts`` is ``unsplit``): each tp rank exchanges with its own ep
group.

- `modules`: which modules are the experts and routers (the family table, `ndparallel.models.families`), and
  the refusals;
- `apply`: the check and apply steps, and FSDP2 over the split experts;
- `dispatch`: the experts module's call -- route, exchange, compute, return, combine;
- `communication`: the all-to-alls over ``ep``;
- `compute`: the local experts, one grouped matmul per projection.

The router's load-balancing loss is the global batch's under any layout (`ndparallel.parallel.moe`).
"""

from .apply import apply_expert_parallel, check_expert_parallel, expert_parallel_modules, shard_experts
from .dispatch import ExpertShard, expert_parallel_forward
from .modules import EXPERT_COUNTS, expert_modules, family_experts

__all__ = ["EXPERT_COUNTS", "ExpertShard", "apply_expert_parallel", "check_expert_parallel", "expert_modules",
           "expert_parallel_forward", "expert_parallel_modules", "family_experts", "shard_experts"]
