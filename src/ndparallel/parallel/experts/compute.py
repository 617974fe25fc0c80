"""This rank's experts on the tokens they received: one grouped matmul per projection over all local experts.

Rows arrive grouped by expert (``counts[i]`` rows for local expert i). Each projection is one ``torch._grouped_mm``
(``torch.nn.functional.grouped_mm`` where torch has it) where its kernel takes the operands: on CUDA in bf16 (compute
capability 8.0 or more), on CPU when every stride is a multiple of 16 bytes; elsewhere a loop over the local experts
(one matmul each, never a loop over tokens). An expert that received no rows still takes part (an empty matmul), so
every local expert's weights get a gradient -- zero -- and FSDP2's reduce-scatter sees the same tensors on every rank.

The experts module is transformers' stacked layout (`ndparallel.models.families.Experts`), described by the
attributes transformers' ``use_experts_implementation`` gives it: ``has_gate`` (a ``gate_up_proj`` whose output
``_apply_gate`` turns into the activation, else ``up_proj`` and ``act_fn``), ``has_bias`` (``*_bias`` per expert),
``is_transposed`` (weights stored (experts, in, out) rather than (experts, out, in)). The model's own ``_apply_gate``
runs (gpt-oss's clamped SwiGLU on interleaved gate/up columns included).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local(param: torch.Tensor | None, gradient_scale: float) -> torch.Tensor | None:
    """This rank's experts of a parameter (the local part of its DTensor over ``ep``), whose gradient is multiplied
    by `gradient_scale` on its way back (see `run_local_experts`)."""
    if param is None:
        return None
    return _ScaleGradient.apply(param.to_local() if isinstance(param, DTensor) else param, gradient_scale)


def _grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes ``x`` (rows, in) against ``w`` (experts, in, out) here."""
    if _grouped_mm() is None or x.shape[0] == 0 or x.dtype != w.dtype:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and _aligned(x) and _aligned(w)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], bias: torch.Tensor | None = None,
                   transposed: bool = False) -> torch.Tensor:
    """Rows of `x` grouped by expert (``counts``) through their expert's weight: (experts, out, in), or (experts, in,
    out) when `transposed`, and bias (experts, out)."""
    w = weight if transposed else weight.transpose(-2, -1)  # (experts, in, out)
    x = x.to(w.dtype)  # as transformers' experts: rows in the weights' dtype (autocast does not reach grouped_mm)
    if grouped_mm_fits(x, w):
        offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
        out = _grouped_mm()(x, w, offs=offsets)
    else:
        out = torch.cat([part @ w[i] for i, part in enumerate(x.split(counts))])
    if bias is not None:
        out = out + bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0,
                                           output_size=out.shape[0])
    return out


def run_local_experts(module: nn.Module, x: torch.Tensor, counts: list[int], ep: int) -> torch.Tensor:
    """The experts of `module` held by this rank on rows `x` grouped by expert (``counts``): (rows, hidden).

    The weights' gradients are divided by `ep`. A rank's experts see the rows of every rank of its ep group, so their
    gradient is the sum of those ep ranks' contributions, where every other parameter's gradient holds one rank's;
    FSDP2 then averages each over the ranks that hold the same parameter (all ``loss`` ranks; for experts, the
    ``loss`` ranks / ep that hold the same experts). Divided by ep, the experts' gradient is the same average over
    all ``loss`` ranks as every other parameter's, which `ndparallel.training.loss` makes the single-process
    gradient."""
    def weight(name: str) -> torch.Tensor | None:
        return local(getattr(module, name), 1.0 / ep)

    up = "gate_up_proj" if module.has_gate else "up_proj"
    bias = (lambda name: weight(f"{name}_bias")) if module.has_bias else (lambda name: None)
    h = grouped_linear(x, weight(up), counts, bias(up), module.is_transposed)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    return grouped_linear(h, weight("down_proj"), counts, bias("down_proj"), module.is_transposed)
