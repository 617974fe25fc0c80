"""The experts module's call under expert parallelism: tokens to the ranks holding their experts, computed, and back.

The model's router has chosen, for each of this rank's T tokens, k experts and their weights. With E experts over the
P ranks of ``ep`` (rank p holds experts p*E/P .. (p+1)*E/P - 1), one call:

1. sorts the T*k (token, slot) pairs by expert -- hence by the rank holding it -- and counts them per expert;
2. exchanges the counts (all-to-all of P x E/P integers): each rank learns how many rows it receives from each rank
   for each of its experts. One device-to-host copy of the two tables gives every split size;
3. sends each pair's hidden state to its expert's rank (all-to-all, variable splits: every pair travels; nothing is
   dropped or padded, whatever the imbalance, a rank may receive nothing);
4. regroups what arrived (by source rank, then expert) by expert and runs the local experts over it, one grouped
   matmul per projection (`compute`);
5. sends the results back the way they came (all-to-all with the splits swapped) and restores the (token, slot) order;
6. weights each result by its routing weight and sums each token's k results -- the very operations transformers'
   experts end with, in the same order, so the output equals one process's up to the matmuls' own rounding.

Backward runs the same steps in reverse: each expert's weight gradient sums the contributions of every ep rank's
tokens (the all-to-all returns them; divided by ep, see `compute.run_local_experts`), the hidden states' gradients return to their own ranks, the routing weights'
gradients never leave the rank. Under activation checkpointing the call is recomputed in backward, collectives
included, in the same order on every rank. `torch.compile` does not trace into it (data-dependent sizes, collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .communication import all_to_all, exchange_counts
from .compute import run_local_experts


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place under expert parallelism: the ``ep`` group, and which experts it holds."""

    group: dist.ProcessGroup
    ranks: int  # ep_size
    rank: int  # this rank's place in ep: it holds experts rank * local .. (rank + 1) * local - 1
    experts: int  # all routed experts

    @property
    def local(self) -> int:
        return self.experts // self.ranks


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(len(permutation), device=permutation.device)
    return inverse


@torch.compiler.disable
def expert_parallel_forward(module: nn.Module, shard: ExpertShard, hidden_states: torch.Tensor,
                            top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts(hidden_states, top_k_index, top_k_weights)`` with the experts spread over ``ep`` (module docstring):
    (tokens, hidden), (tokens, k), (tokens, k) -> (tokens, hidden)."""
    tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # 1. pairs by expert, hence by destination rank
    # Pairs per expert, counted without reading the ids on the host (bincount would, to size its output).
    counts = experts.new_zeros(shard.experts).scatter_add_(0, experts, torch.ones_like(experts)).view(
        shard.ranks, shard.local)
    received = exchange_counts(counts, shard.group)  # 2. [q, j]: rows from rank q for local expert j
    sent_table, received_table = torch.stack([counts, received]).tolist()
    send, receive = [sum(row) for row in sent_table], [sum(row) for row in received_table]
    x = all_to_all(hidden_states[order // k], send, receive, shard.group)  # 3.
    # 4. What arrived is grouped by source rank, then by expert: a stable sort by expert keeps the sources in order.
    expert_of_row = torch.arange(shard.local, device=x.device).repeat(shard.ranks).repeat_interleave(
        received.reshape(-1).to(x.device), output_size=x.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    per_expert = [sum(column) for column in zip(*received_table)]
    y = run_local_experts(module, x[by_expert], per_expert, shard.ranks)
    y = all_to_all(y[_inverse(by_expert)], receive, send, shard.group)  # 5.
    y = y[_inverse(order)]  # (tokens * k, hidden), in (token, slot) order
    weighted = y * top_k_weights.reshape(-1, 1)  # 6.
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)
