"""The load-balancing loss of a mixture of experts under pipeline stages, exactly as one process computes it.

One process adds ``coef * G`` to its loss, ``G = load_balancing_loss_func(router logits of every layer, ...)``: the
product of two averages over every (layer, token) row of the batch -- the share of rows routed to each expert (a
count: no gradient) and each expert's mean router probability. Every stage needs the shares of *all* layers of the
*whole* batch before its first backward, which 1F1B-style schedules start after the first micro-batch. So a
training call runs the batch twice:

1. a forward-only pass of the schedule (no gradients; the RNG restored after it, so dropout draws alike) records
   every router's logits on every stage; they are all-gathered over the stages (``pp``) and over the ranks whose
   tokens make the global batch (``loss``: batch x cp x sp), and the model's own function computes G and its
   gradient with respect to every row (`BalancingTerm.prepare`);
2. the training schedule runs; each router's call adds to its logits' gradient this rank's rows of that gradient
   (an autograd function on the router's routing weights: identity forward, the extra gradient backward), scaled as
   `ndparallel.parallel.moe` scales the term: ``coef * sum_r f_r`` -- f_r the factor `backward` weighs rank r's mean
   loss by, whose sum over the ``loss`` ranks is their count W without accumulation; the data-parallel average
   divides by W, leaving ``coef * dG``, the gradient of one process's loss.

The loss the call returns is this rank's mean token loss plus ``coef * G``, as `moe` makes it. The extra forward
costs about a third of a step's compute. A router's calls are matched to micro-batches by their order (a stage runs
its micro-batches' forwards in order); the schedule's first call, which runs each stage once to learn the shapes it
sends, and the recomputation of activation checkpointing (inside backward) are not counted. Evaluation adds the
rank's own term over its tokens (all stages' layers), as `moe` keeps each rank's own there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from ...models.families import ROUTER_LOSS, USUAL_EXPERTS
from ..experts.modules import family_experts
from ..moe import gather_token_rows, load_balancing_function
from ..target import Target

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the router logits' dtype, by its index
# A new schedule's first call runs each stage once more to learn the shapes it sends. Stages with
# `_forward_metadata_inference` (torch 2.12.1, 2.13, 2.14.1) run that call with gradients when the schedule trains,
# so the training hook sees it and skips it; torch 2.11's (`_shape_inference`) run it under no_grad, where the hook
# adds nothing anyway.
_SHAPE_CALL_WITH_GRAD = hasattr(pipelining.PipelineStage, "_forward_metadata_inference")


def routers(model: nn.Module, stages: dict[int, nn.Module], target: Target | None = None) -> list[nn.Module]:
    """The router modules of this rank's stages, stage by stage, layer by layer (sparse layers only). `target`:
    `model` as `parallelize` resolved it (resolved here when not given)."""
    _, experts = family_experts(model, target)
    path = (experts or USUAL_EXPERTS).router
    found = []
    for index in sorted(stages):
        for layer in stages[index].model.layers.values():
            try:
                found.append(layer.get_submodule(path))
            except AttributeError:
                continue  # a dense layer (Qwen3-MoE's mlp_only_layers, DeepSeek-V3's first layers)
    return found


class _AddGradient(torch.autograd.Function):
    """Identity on the routing weights; backward adds `extra` to the router logits' gradient."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra = extra
        return scores.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.extra if ctx.needs_input_grad[1] else None, None


def _counted(logits: torch.Tensor) -> bool:
    """Whether a router call is one of a step's micro-batches (not a shape-learning call on meta tensors, nor the
    recomputation of activation checkpointing, which runs inside backward)."""
    return not logits.is_meta and torch._C._current_graph_task_id() == -1


class BalancingTerm:
    """The load-balancing term of one pipelined MoE causal LM (see the module docstring)."""

    def __init__(self, function: Callable[..., Any], model: nn.Module, routers: list[nn.Module],
                 pp_group: dist.ProcessGroup, loss_group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.function, self.routers, self.device = function, routers, device
        self.expert_count, self.top_k, self.coef = ROUTER_LOSS.arguments(model)
        self.pp_group, self.loss_group = pp_group, loss_group
        self._records: dict[int, list[torch.Tensor]] | None = None
        self._extra: dict[int, list[torch.Tensor]] = {}
        self._skip: dict[int, int] = {}
        for router in routers:
            router.register_forward_hook(self._hook)

    # ---- the router hook --------------------------------------------------------------------------------------
    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        logits = output[0]
        if not _counted(logits):
            return output
        key = id(module)
        if self._records is not None:
            self._records[key].append(logits.detach())
        elif key in self._extra and torch.is_grad_enabled():
            if self._skip[key]:
                self._skip[key] -= 1
                return output
            if not self._extra[key]:
                raise RuntimeError("pipeline stages: a router ran more micro-batches than the load-balancing term "
                                   "was prepared for")
            extra = self._extra[key].pop(0).to(logits.dtype)
            return (output[0], _AddGradient.apply(output[1], logits, extra), *output[2:])
        return output

    @contextmanager
    def recording(self) -> Iterator[dict[int, list[torch.Tensor]]]:
        """Record every router call's logits while the body runs (a forward-only schedule)."""
        self._records = {id(r): [] for r in self.routers}
        try:
            yield self._records
        finally:
            self._records = None

    @contextmanager
    def adding(self, fresh: bool) -> Iterator[None]:
        """Add the prepared gradients while the body runs the training schedule; `fresh`: the schedule's first call
        (each stage runs once more first, to learn its shapes)."""
        self._skip = {id(r): int(fresh and _SHAPE_CALL_WITH_GRAD) for r in self.routers}
        try:
            yield
        finally:
            left = [len(v) for v in self._extra.values() if v]
            self._extra = {}
            if left:
                raise RuntimeError(f"pipeline stages: {left} micro-batches' load-balancing gradients were not used")

    # ---- the term ---------------------------------------------------------------------------------------------
    def value(self, records: dict[int, list[torch.Tensor]], microbatches: int, mask: torch.Tensor | None,
              group: dist.ProcessGroup | None = None, factor: float | torch.Tensor | None = None) -> torch.Tensor:
        """G over this rank's tokens (gathered over `group`'s ranks too); with `factor` (this rank's loss factor),
        also prepares the gradient the training schedule adds to each router call."""
        per_layer = [torch.cat(records[id(r)][-microbatches:]) for r in self.routers]  # (tokens, E) each
        tokens = per_layer[0].shape[0] if per_layer else 0
        local = torch.stack(per_layer, dim=1) if per_layer else None
        rows, offset, count = self._all_layers(local, tokens)  # (tokens, layers of every stage, E)
        if mask is not None and (mask.dim() != 2 or mask.numel() != rows.shape[0]):
            mask = None  # not one entry per router row (context-parallel shards hold whole causal rows only)
        start = 0
        if group is not None and dist.get_world_size(group) > 1:
            start = dist.get_rank(group) * rows.shape[0]
            rows = gather_token_rows(rows, group)
            mask = gather_token_rows(mask, group) if mask is not None else None
        leaf = rows.detach().requires_grad_(factor is not None)
        with torch.enable_grad():
            total = self.function(tuple(leaf[:, i] for i in range(leaf.shape[1])), self.expert_count, self.top_k,
                                  mask)
        if factor is not None:
            # The factor may be a tensor on the device (`ndparallel.training.loss.TokenTotal`): summed there, never
            # read.
            factors = torch.as_tensor(factor).to(rows.device, torch.float64).reshape(1)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(factors, group=group)
            (grad,) = torch.autograd.grad(total, leaf)
            grad = grad[start:start + tokens, offset:offset + count] * (self.coef * factors).to(grad.dtype)
            self._extra = {id(r): list(grad[:, i].chunk(microbatches)) for i, r in enumerate(self.routers)}
        return total.detach()

    def _all_layers(self, local: torch.Tensor | None, tokens: int) -> tuple[torch.Tensor, int, int]:
        """This rank's (tokens, layers, E) rows with every other stage's layers: all of them, this rank's offset
        among them and its count (stages hold different numbers of sparse layers; a stage may hold none)."""
        count = 0 if local is None else local.shape[1]
        dtype = -1 if local is None else _DTYPES.index(local.dtype)
        counts = _all_gather_small(torch.tensor([count, tokens, dtype], dtype=torch.long), self.pp_group)
        tokens = max(int(c[1]) for c in counts)
        most = max(int(c[0]) for c in counts)
        dtype = _DTYPES[max(int(c[2]) for c in counts)]
        padded = torch.zeros(tokens, most, self.expert_count, device=self.device, dtype=dtype)
        if local is not None:
            padded[:, :count] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.pp_group)
        offset = sum(int(c[0]) for c in counts[:dist.get_rank(self.pp_group)])
        return torch.cat([p[:, :int(c[0])] for p, c in zip(parts, counts)], dim=1), offset, count


def _all_gather_small(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """A few integers from every rank of `group` (on the CPU: gloo takes them; NCCL ranks go through the device)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    parts = [torch.zeros_like(tensor, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.to(device), group=group)
    return [p.cpu() for p in parts]


def balancing_term(model: nn.Module, stages: dict[int, nn.Module], pp_group: dist.ProcessGroup,
                   loss_group: dist.ProcessGroup | None, device: torch.device,
                   target: Target | None = None) -> BalancingTerm | None:
    """The term for a model whose loss adds a load-balancing term (`moe.load_balancing_function` and
    ``output_router_logits`` on), else None."""
    function = load_balancing_function(model)
    if function is None or not ROUTER_LOSS.on(model.config):
        return None
    return BalancingTerm(function, model, routers(model, stages, target), pp_group, loss_group, device)
