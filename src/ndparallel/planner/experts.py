"""Expert parallelism's figures for a mixture-of-experts model: what each rank holds of the experts and what the
all-to-alls carry per optimizer step (`ndparallel.parallel.experts`), predicted from a ``config.json``.

- **expert states per rank**: each stacked expert weight (experts, ...) is split along the experts over ep, then
  FSDP2 shards its local experts over expert_shard = dp_shard x cp x sp / ep (dim 0 padded to a multiple, as for any
  FSDP2 parameter): E / ep experts, then / expert_shard. Parameters and gradients in fp32, AdamW's two fp32 moments.
  Without ep (FSDP2 alone), the experts are sharded like every other weight over the whole fsdp view.
- **gathered experts**: FSDP2 all-gathers a layer's experts for compute: E / ep of them under ep (over expert_shard),
  all E without it (over fsdp) -- the difference that makes large MoE models fit.
- **all-to-all payload**: every (token, expert) pair travels to its expert's rank and its result back: per sparse
  layer and forward, T x k x H x c bytes each way (T tokens on the rank per micro-step, k experts per token, H the
  hidden size, c the activation's bytes), whatever the routing; backward sends the same back; activation
  checkpointing runs the forward, with its all-to-alls, once more. The token counts go ahead of each forward
  (E x 8 bytes). How much of the payload leaves the rank depends on the routing: (ep - 1) / ep of it when uniform.

``ndparallel plan`` puts these figures into its model of the whole step (`moe`: the rest of the layers, the
activations, FSDP2's units, FLOPs) and ranks every ep that splits the experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..models.families import USUAL_EXPERTS, Experts, expert_entries, experts_of
from .recipe import FP32, OPTIMIZER_STATES, shard_numel

COUNT_BYTES = 8  # the routing counts travel as int64


@dataclass(frozen=True)
class ExpertSpec:
    """The routed experts of a mixture-of-experts config."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int  # of one expert
    sparse_layers: int  # decoder layers with routed experts
    gated: bool = True  # gate_up_proj (2 x intermediate) and down_proj; else up_proj and down_proj
    bias: bool = False  # per-expert biases (gpt-oss)

    def stacked(self) -> list[tuple[str, tuple[int, ...]]]:
        """One sparse layer's stacked expert weights, as transformers stores them (experts along dimension 0)."""
        e, h, i = self.experts, self.hidden, self.intermediate
        up = 2 * i if self.gated else i
        out = [("gate_up_proj" if self.gated else "up_proj", (e, up, h)), ("down_proj", (e, h, i))]
        if self.bias:
            out += [("gate_up_proj_bias" if self.gated else "up_proj_bias", (e, up)), ("down_proj_bias", (e, h))]
        return out

    def num_parameters(self) -> int:
        return self.sparse_layers * sum(math.prod(shape) for _, shape in self.stacked())


def _first(data: dict[str, Any], names: list[str | None], accept: Callable[[Any], bool]) -> Any:
    """The value of the first field of `names` (None: the family has none) that `data` sets to a value `accept`s."""
    return next((data[name] for name in dict.fromkeys(names) if name and accept(data.get(name))), None)


def _sparse_layers(data: dict[str, Any], layers: int, entries: list[Experts]) -> int:
    first = _first(data, [e.first_dense for e in entries], lambda v: isinstance(v, int))
    if first is not None:  # DeepSeek-V3, GLM-4.5: the first k layers are dense
        return layers - first
    dense = set(_first(data, [e.dense_listed for e in entries], bool) or [])  # Qwen2/3-MoE: dense layers listed,
    step = _first(data, [e.sparse_step for e in entries], bool) or 1  # and every k-th sparse
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def expert_spec(data: dict[str, Any], source: str = "config") -> ExpertSpec | None:
    """The routed experts of a Hugging Face config dict; None for a dense model. Read with every field the family
    table names (`ndparallel.models.families.expert_entries`); the biases are its model type's."""
    entries = expert_entries()
    counted = [(e, data[e.count]) for e in entries if isinstance(data.get(e.count), int) and data[e.count] > 1]
    if not counted:
        return None
    entry, experts = counted[0]
    missing = [f for f in (entry.top_k, "hidden_size", "num_hidden_layers") if not data.get(f)]
    intermediate = data.get(entry.width) or data.get("intermediate_size")
    if missing or not intermediate:
        raise ValueError(f"{source}: a mixture of experts without {', '.join(missing) or entry.width}")
    return ExpertSpec(experts=experts, top_k=data[entry.top_k], hidden=data["hidden_size"],
                      intermediate=intermediate, sparse_layers=_sparse_layers(data, data["num_hidden_layers"], entries),
                      gated=True, bias=(experts_of(data.get("model_type")) or USUAL_EXPERTS).bias)


@dataclass(frozen=True)
class ExpertFigures:
    """Per rank (module docstring): elements and bytes of the experts it holds, and all-to-all bytes per step."""

    ep: int
    expert_shard: int
    elements: int  # expert parameters this rank holds (after ep and FSDP2, padding included)
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    gathered_bytes: int  # one sparse layer's experts as FSDP2 all-gathers them for compute (compute dtype)
    payload_bytes: int  # all-to-all payload per optimizer step, both directions, forward and backward (and rerun)
    count_bytes: int  # the routing counts' all-to-alls per optimizer step
    leaves_rank_uniform: float  # the payload's share that leaves the rank under uniform routing

    def lines(self) -> list[str]:
        return [f"expert parallelism: ep={self.ep}, experts sharded over expert_shard={self.expert_shard}",
                f"  expert parameters per rank: {self.elements:,} ({self.params_bytes / 2**20:.2f} MiB fp32), "
                f"gradients {self.grads_bytes / 2**20:.2f} MiB, optimizer {self.optimizer_bytes / 2**20:.2f} MiB",
                f"  one layer's experts gathered for compute: {self.gathered_bytes / 2**20:.2f} MiB"
                + (" (whole on the rank already: expert_shard=1 gathers nothing)" if self.expert_shard == 1 else ""),
                f"  all-to-all per step: {self.payload_bytes / 2**20:.2f} MiB of tokens (both directions, forward "
                f"and backward; {self.leaves_rank_uniform:.0%} leaves the rank under uniform routing) + "
                f"{self.count_bytes} B of routing counts"]


def expert_figures(spec: ExpertSpec, fsdp: int, ep: int, tokens: int, accumulation: int = 1, compute_bytes: int = 2,
                   checkpointing: bool = False, optimizer: str = "adamw") -> ExpertFigures:
    """The figures of module docstring for one rank: `fsdp` = dp_shard x cp x sp, `tokens` on the rank per
    micro-step (its samples' share of the sequence under cp x sp)."""
    if fsdp % ep or spec.experts % ep:
        raise ValueError(f"ep={ep} must divide dp_shard x cp x sp = {fsdp} and the {spec.experts} experts")
    shard = fsdp // ep
    local = [(spec.experts // ep, *shape[1:]) for _, shape in spec.stacked()]
    elements = spec.sparse_layers * sum(shard_numel(shape, shard) for shape in local)
    gathered = sum(math.prod(shape) for shape in local) * compute_bytes
    forwards = 2 if checkpointing else 1
    per_pass = 2 * tokens * spec.top_k * spec.hidden * compute_bytes if ep > 1 else 0  # both directions
    payload = accumulation * spec.sparse_layers * (forwards + 1) * per_pass
    counts = accumulation * spec.sparse_layers * forwards * spec.experts * COUNT_BYTES if ep > 1 else 0
    return ExpertFigures(ep=ep, expert_shard=shard, elements=elements, params_bytes=elements * FP32,
                         grads_bytes=elements * FP32, optimizer_bytes=elements * FP32 * OPTIMIZER_STATES[optimizer],
                         gathered_bytes=gathered, payload_bytes=payload, count_bytes=counts,
                         leaves_rank_uniform=(ep - 1) / ep)
