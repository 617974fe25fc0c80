"""Mixture-of-experts models when the tokens of a step are spread over ranks: the load-balancing loss of the global
batch.

Hugging Face MoE causal LMs (Qwen3-MoE, Mixtral, ...) add ``router_aux_loss_coef * load_balancing_loss_func(
router_logits, ...)`` to their loss when ``config.output_router_logits`` is on. That auxiliary loss multiplies two
averages over the tokens (the share of tokens each expert receives, and its mean router probability), so the mean
of the ranks' auxiliary losses over their own tokens is not the auxiliary loss of the whole batch. While training,
the prepared model therefore recomputes it -- with the model's own function -- from the router logits of every rank
of the ``loss`` view (batch x cp x sp) and puts that into the loss in place of the rank's own:

    loss_r  <-  loss_r + coef * (G - aux_r),        G = load_balancing_loss_func(router logits of all ranks)

The logits are all-gathered with a backward that sums every rank's gradient for this rank's rows. `backward` weights
rank r's loss by f_r = n_r * W / N (`ndparallel.training.loss`), and the data-parallel wrapper averages over the W
ranks; so the parameters get coef * (sum_r f_r / W) * dG. Without gradient accumulation the f_r add up to W: that is
coef * dG, the gradient of the single-process loss, and `reduce_loss` logs the single-process value. With accumulation,
each micro-step's G covers the tokens of that micro-step on every rank and weighs like its loss (N_micro / N), as in one
process accumulating the same micro-batches. Evaluation (``model.eval()`` or ``torch.no_grad()``) keeps each rank's own
auxiliary loss, so a forward on one rank alone cannot hang on the all-gather.

Expert layouts: without expert parallelism FSDP2 shards the experts' stacked weights along the expert dimension over
``fsdp`` (each rank stores num_experts / fsdp of them and all-gathers them for compute, as every FSDP parameter);
under tensor parallelism the experts stay whole on every tp rank (`tensor.styles.ALIASES`: transformers'
``moe_tp_experts``) while attention and dense layers are split. With ``ep_size`` the experts are placed on the ranks
of ``ep`` and tokens travel to them all-to-all (`ndparallel.parallel.experts`); the router runs on every rank's own
tokens, so this loss is computed the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.mesh import ParallelMesh
from ..models.families import ROUTER_LOSS
from .options import PrepareOptions


def load_balancing_function(model: nn.Module) -> Callable[..., Any] | None:
    """The model's own ``load_balancing_loss_func`` (from its modeling module) when it is an MoE causal LM that adds
    one to its loss, else None."""
    if not ROUTER_LOSS.declared(getattr(model, "config", None)):
        return None
    if not all(hasattr(model, attribute) for attribute in ROUTER_LOSS.attributes()):
        return None
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def apply_global_load_balancing(model: nn.Module, mesh: ParallelMesh, options: PrepareOptions) -> nn.Module:
    """Make an MoE causal LM's load-balancing loss that of the tokens of every rank of ``loss`` (see the module
    docstring); nothing for other models or when one rank holds all the tokens."""
    function = load_balancing_function(model)
    if function is not None and mesh.size("loss") > 1:
        model.register_forward_hook(_GlobalLoadBalancing(function, mesh.group("loss")), with_kwargs=True)
    return model


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward sums the gathered gradient over the group and keeps this rank's
    rows (every rank's loss depends on every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def gather_token_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`x`'s rows from every rank of `group`, concatenated in rank order (`_GatherRows`: differentiable); every rank
    must hold as many rows of the same shape, which is checked (a clear error on every rank, not a hang)."""
    sizes = [torch.zeros(x.dim(), dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor(x.shape, dtype=torch.long), group=group)
    if any(s.tolist() != list(x.shape) for s in sizes):
        raise ValueError("the load-balancing loss of a mixture-of-experts model needs the same number of tokens "
                         f"on every rank of a step; router logits have shapes {[s.tolist() for s in sizes]}: "
                         "give every rank batches of one shape (the prepared data loader does)")
    return _GatherRows.apply(x, group)


class _GlobalLoadBalancing:
    """Forward hook: the global load-balancing loss in place of this rank's (see the module docstring)."""

    def __init__(self, function: Callable[..., Any], group) -> None:
        self.function, self.group = function, group

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not (model.training and torch.is_grad_enabled()) or not isinstance(output, dict):
            return output
        aux, logits = output.get("aux_loss"), output.get("router_logits")
        if aux is None or not isinstance(logits, (tuple, list)) or not logits:
            return output
        layers = len(logits)
        rows = torch.stack([layer.reshape(-1, layer.shape[-1]) for layer in logits], dim=1)  # (tokens, layers, E)
        gathered = gather_token_rows(rows, self.group)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            mask = gather_token_rows(mask, self.group)
        elif mask is not None:
            mask = None  # 4-D masks are not token masks; HF's function reads 2-D padding masks only
        experts, top_k, coefficient = ROUTER_LOSS.arguments(model)
        total = self.function(tuple(gathered[:, i] for i in range(layers)), experts, top_k, mask)
        if output.get("loss") is not None:
            output["loss"] = output["loss"] + coefficient * (total - aux)
        output["aux_loss"] = total
        return output
