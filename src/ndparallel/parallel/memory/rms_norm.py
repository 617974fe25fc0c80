"""Fused RMSNorm: the norm's forward as the model writes it, and a backward that needs only the input and 1/rms.

A Hugging Face RMSNorm (Llama's, Qwen's, Mistral's...) computes ``weight * (x.float() * rsqrt(mean(x.float()**2) +
eps)).to(x.dtype)``; autograd then keeps, per token, an fp32 copy of the input, the normalised fp32 value and its cast
-- ``h (4 + 4 + c)`` bytes for a ``c``-byte input, beside the input the block keeps anyway. Gemma's computes in fp32
and multiplies by ``1 + weight`` before the cast, keeping as much. With ``MemoryKwargs(fused_rms_norm=True)`` each
such norm runs `rms_norm` instead: the same operations forward (the output is bitwise the module's own), and a
backward written out, which keeps the input and one fp32 ``1/rms`` per token (``h c + 4`` bytes) and recomputes the
normalised value from them. The gradients are the module's own to rounding (fp32: 1e-6).

The backward runs over chunks of tokens (`chunk_tokens`): as few equal chunks as keep each one's working set -- the
recomputed normalised value, the fp32 gradient of it and their product, 12 h + 4 bytes a token (`token_bytes`) --
within `CHUNK_BYTES` (128 MiB, the chunked loss's budget), all tokens in one wherever they fit (up to 2,730 tokens of
hidden size 4,096). Each chunk's input gradient is written into its rows of one buffer in the input's dtype (bitwise
the unchunked values: every operation but the weight's sum is per token), and the weight's gradient is summed over
the chunks in fp32. So at a long sequence the backward holds the input gradient and one chunk's working set
(`backward_bytes`) instead of three fp32 tensors of the whole sequence. The chunks come from shapes: no value is read
on the host.

Which norms: every module whose class name ends in ``RMSNorm`` with a 1-d ``weight``, an epsilon (``variance_epsilon``
or ``eps``) and no other parameter, whose forward is found, on a probe, to be one of the two forms above: with random
weights (so that no form passes for another by its weights' values), in fp32 and in bf16, its output must equal the
form's bitwise. A norm that computes anything else (a LayerNorm, a norm with a bias, another order of operations)
keeps its own forward. At run time a norm whose input or weight is a DTensor (tensor parallelism's sequence-parallel
norms) runs its own forward too, as does one called with more than its input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..adapted import adapter_free
from .cross_entropy import even_chunk_rows

STATUS_ATTR = "_ndparallel_fused_rms_norm"
FORMS = ("scaled_after_cast", "scaled_before_cast")  # Llama's: weight * normed.to(dtype); Gemma's: fp32, then cast
EPSILON_NAMES = ("variance_epsilon", "eps")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,  # type: ignore[override]
                form: str) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        normed = x.float() * rstd
        if form == "scaled_before_cast":
            out = (normed * (offset + weight.float())).type_as(x)
        else:
            out = (weight + offset if offset else weight) * normed.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps, ctx.offset, ctx.form = eps, offset, form
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        hidden = x.shape[-1]
        tokens = x.numel() // hidden if hidden else 0
        if ctx.form == "scaled_before_cast":
            scale = ctx.offset + weight.float()
        else:
            scale = weight + ctx.offset if ctx.offset else weight
        grad_weight = torch.zeros(hidden, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        step = chunk_tokens(tokens, hidden)
        if step >= tokens:  # all at once: the input gradient is the chunk's own buffer
            grad_x = _backward_chunk(x, grad, rstd, scale, ctx.form, grad_weight).to(x.dtype)
        else:  # each chunk's input gradient written into its rows of one buffer (the same values: per-token math)
            grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            # views of the rows (a copy only of a tensor whose rows cannot be viewed so: not a model's hidden states)
            flat_x, flat_grad, flat_rstd = x.reshape(-1, hidden), grad.reshape(-1, hidden), rstd.reshape(-1, 1)
            out = grad_x.view(-1, hidden)
            for start in range(0, tokens, step):
                rows = slice(start, start + step)
                out[rows].copy_(_backward_chunk(flat_x[rows], flat_grad[rows], flat_rstd[rows], scale, ctx.form,
                                                grad_weight))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_x, grad_weight, None, None, None


def _backward_chunk(x: torch.Tensor, grad: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, form: str,
                    grad_weight: torch.Tensor | None) -> torch.Tensor:
    """The input gradient of some of the tokens (fp32), their share of the weight's gradient added to `grad_weight`
    (fp32). `scale`: ``offset + weight`` as the forward multiplies by it (in fp32 for Gemma's form)."""
    normed = x.float() * rstd
    rows = tuple(range(grad.dim() - 1))
    # The weight's share first, then what it needed goes: at most three fp32 tokens x h tensors alive at once
    if form == "scaled_before_cast":
        g = grad.float()
        if grad_weight is not None:
            grad_weight.add_((g * normed).sum(rows))
        grad_normed = g * scale
        del g
    else:
        if grad_weight is not None:
            grad_weight.add_((grad * normed.to(x.dtype)).sum(rows, dtype=torch.float32))
        grad_normed = (grad * scale).to(x.dtype).float()
    # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - normed * mean(g * normed)), written into the recomputed
    # `normed` (no longer needed) -- the same values bitwise
    dot = (grad_normed * normed).mean(-1, keepdim=True)
    return normed.mul_(dot).neg_().add_(grad_normed).mul_(rstd)


# The fused norm's backward runs over as few equal chunks of tokens as keep each chunk's working set (`token_bytes`)
# within CHUNK_BYTES -- the chunked loss's budget (`cross_entropy.CHUNK_BYTES`) -- and all at once wherever that fits.
CHUNK_BYTES = 128 * 2**20


def token_bytes(hidden: int) -> int:
    """Bytes per token a chunk of `_RMSNorm.backward` allocates at its peak, in either form and any dtype: three fp32
    tokens x `hidden` tensors (the recomputed normalised value, the fp32 gradient of it and their product; what a
    narrower dtype adds, the normalised value's cast or the incoming gradient's fp32 copy, is let go before the
    third) and the fp32 dot product of the row (4 B)."""
    return 3 * 4 * hidden + 4


def chunk_tokens(tokens: int, hidden: int, budget: int | None = None) -> int:
    """Tokens per chunk of the fused norm's backward: as few equal chunks as keep each one's `token_bytes` within
    `budget` (`CHUNK_BYTES` unless given) -- all `tokens` in one wherever they fit."""
    budget = CHUNK_BYTES if budget is None else budget
    return even_chunk_rows(tokens, budget // token_bytes(hidden))


def backward_bytes(tokens: int, hidden: int, element_size: int) -> int:
    """Bytes `_RMSNorm.backward` allocates at its peak for `tokens` tokens of `hidden` elements of `element_size` bytes
    (the weight's fp32 gradient aside, under one token's worth): in one chunk, `token_bytes` per token (the input
    gradient is then written into the first fp32 tensor); in more, the input gradient (``tokens x hidden`` in the
    input's dtype) and one chunk's `token_bytes`. The planner's term for the fused norm's backward
    (`ndparallel.planner.footprint`); `tests/parallel/memory/test_rms_norm.py` checks it against the bytes the
    backward holds at its peak (`ndparallel.test_utils.memory.LiveBytes`)."""
    step = chunk_tokens(tokens, hidden)
    if step >= tokens:
        return tokens * token_bytes(hidden)
    return tokens * hidden * element_size + step * token_bytes(hidden)


# Bytes per element the model's own RMSNorm's backward allocates at its peak (autograd's gradients of its fp32 ops),
# in fp32 and in bf16 alike: measured on transformers' LlamaRMSNorm (`tests/parallel/memory/test_rms_norm.py`
# checks it), counted by the planner for norms that are not fused.
OWN_BACKWARD_BYTES = 20


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             form: str = "scaled_after_cast") -> torch.Tensor:
    """RMSNorm of `x` over its last dimension by (`offset` +) `weight` in one of `FORMS`, keeping for backward only
    `x` and 1/rms per row (module docstring)."""
    if form not in FORMS:
        raise ValueError(f"rms_norm: form must be one of {FORMS}, got {form!r}")
    return _RMSNorm.apply(x, weight, eps, offset, form)


class FusedRMSNorm:
    """The forward of one norm that `apply_fused_rms_norm` fused (module docstring)."""

    def __init__(self, norm: nn.Module, eps: float, offset: float, form: str) -> None:
        self.norm, self.forward_own = norm, norm.forward
        self.eps, self.offset, self.form = eps, offset, form
        self.calls = 0  # forwards that ran fused (tests read it)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self.norm.weight
        if args or kwargs or not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or isinstance(weight, DTensor):
            return self.forward_own(x, *args, **kwargs)
        self.calls += 1
        return rms_norm(x, weight, self.eps, self.offset, self.form)


def _epsilon(norm: nn.Module) -> float | None:
    value = next((getattr(norm, name) for name in EPSILON_NAMES if hasattr(norm, name)), None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recognised_form(norm: nn.Module) -> tuple[float, float, str] | None:
    """(eps, offset, form) when `norm`'s forward is one of `FORMS` (offset 0 or 1) on the probe, else None."""
    weight = getattr(norm, "weight", None)
    eps = _epsilon(norm)
    if (eps is None or not isinstance(weight, nn.Parameter) or isinstance(weight, DTensor) or weight.dim() != 1
            or weight.is_meta or [name for name, _ in norm.named_parameters()] != ["weight"]):
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe_weight = torch.randn(weight.shape, generator=generator)
    probe_x = torch.randn((2, 3, weight.shape[0]), generator=generator) * 3
    candidates = [(offset, form) for form in FORMS for offset in (0.0, 1.0)]
    for dtype in (torch.float32, torch.bfloat16):
        w = probe_weight.to(device=weight.device, dtype=dtype)
        x = probe_x.to(device=weight.device, dtype=dtype)
        try:
            with torch.no_grad():
                own = torch.func.functional_call(norm, {"weight": w}, (x,))
        except Exception:  # noqa: BLE001 -- a forward that cannot run on the probe is not fused
            return None
        with torch.no_grad():
            same = [isinstance(own, torch.Tensor) and own.dtype == (out := rms_norm(x, w, eps, offset, form)).dtype
                    and torch.equal(own, out) for offset, form in candidates]
        candidates = [candidate for candidate, equal in zip(candidates, same) if equal]
        if not candidates:
            return None
    offset, form = candidates[0]
    return eps, offset, form


def apply_fused_rms_norm(model: nn.Module, inner: nn.Module | None = None) -> list[FusedRMSNorm]:
    """Fuse every RMSNorm of `model` whose forward is recognised (module docstring). Raises ValueError when none is.
    `inner`: `model` under its adapter wrapper, as `parallelize` peeled it (peeled here when not given)."""
    inner = adapter_free(model) if inner is None else inner
    fused: list[FusedRMSNorm] = []
    kept: list[str] = []
    for name, module in inner.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        existing = getattr(module, STATUS_ATTR, None)
        if isinstance(existing, FusedRMSNorm):
            fused.append(existing)
            continue
        found = recognised_form(module)
        if found is None:
            kept.append(type(module).__name__)
            continue
        wrapper = FusedRMSNorm(module, *found)
        module.forward = wrapper
        object.__setattr__(module, STATUS_ATTR, wrapper)
        fused.append(wrapper)
    own = f" (their own forward kept: {len(kept)} {', '.join(sorted(set(kept)))})" if kept else ""
    if not fused:
        raise ValueError(f"MemoryKwargs(fused_rms_norm=True): {type(inner).__name__} has no RMSNorm whose forward "
                         f"ndparallel recognises{own}; set fused_rms_norm=False")
    object.__setattr__(inner, STATUS_ATTR, f"on: {len(fused)} RMSNorms{own}")
    return fused


def fused_rms_norm_status(model: nn.Module) -> str:
    """"on: ..." with how many norms are fused, or "off"."""
    status = getattr(adapter_free(model), STATUS_ATTR, None)
    return status if isinstance(status, str) else "off"


def fused_rms_norms(model: nn.Module) -> list[FusedRMSNorm]:
    """The fused norms of a prepared model, in module order."""
    return [m.forward for m in model.modules() if isinstance(getattr(m, STATUS_ATTR, None), FusedRMSNorm)]
