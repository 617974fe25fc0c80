"""Attention of one block of queries against one block of keys, with its log-sum-exp; the pieces that ring and
all-gather attention are built from.

Forward (`block_forward`) returns the block's output O_b and log-sum-exp lse_b (natural log of the row sums of
exp(scale * q.k)). Partial results over disjoint key blocks combine exactly (`merge`):

    lse = log(exp(lse_a) + exp(lse_b)),   O = exp(lse_a - lse) * O_a + exp(lse_b - lse) * O_b.

Backward (`block_backward`) takes the *final* output O and log-sum-exp of the whole row (flash attention's
decomposition): with D = rowsum(dO * O) and P = exp(scale * q.k - lse), the block's share of the gradients is
dV = P^T dO, dS = P * (dO V^T - D), dQ = scale * dS K, dK = scale * dS^T Q. Nothing of size queries x keys is
kept between forward and backward.

A block is either full (every query sees every key) or `causal`: a square block on the diagonal, where query i
sees keys 0..i. Grouped-query attention: key/value may have fewer heads; query head h uses key/value head
h // (heads / kv_heads), as Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa`` do.

Backends (`choose_backend`, the choice SDPA itself would make for the block):
- CPU: ATen's fused flash-attention kernel for CPU (what ``scaled_dot_product_attention`` runs there; it returns the
  log-sum-exp and its backward accepts the final O and lse).
- CUDA: ATen's cuDNN attention op and its backward for fp16/bf16 on sm90+ with head dims that are multiples of 8 up
  to 128 (GQA native; what SDPA itself runs there, measured about 1.8x faster than flash on an H100, docs/gpu.md);
  else ATen's flash-attention op and its backward for fp16/bf16 on sm80+ with head dims that are multiples of 8 up
  to 256 (GQA native); else the memory-efficient (cutlass) op and its backward for fp16/bf16/fp32 with aligned head
  dims (GQA by repeating K/V heads, their gradients summed back); else the math backend. A kernel switched off for
  SDPA (``torch.backends.cuda.enable_cudnn_sdp(False)`` and the like) is not chosen here either.
- Anything else (fp64 on CUDA, other devices, odd head dims): an exact implementation from matmuls, tiled over query
  rows so that no more than `TILE_ELEMENTS` scores exist at a time, with softmax statistics in fp32 (fp64 for fp64
  inputs).
Setting ``BACKEND`` to ``"math"`` forces the matmul implementation (tests do); ``"cudnn"``, ``"flash"`` or
``"efficient"`` force that CUDA kernel and raise where it does not apply.
"""

from __future__ import annotations

from typing import Any

import torch

BACKEND = "auto"  # "auto": as `choose_backend`; "math", "cudnn", "flash", "efficient": that backend (see the docstring)
TILE_ELEMENTS = 1 << 22  # scores per tile of the math backend (16 MiB in fp32)
BACKENDS = ("cpu_flash", "cudnn", "flash", "efficient", "math")
_LSE_ALIGN = 32  # the memory-efficient CUDA kernel pads its log-sum-exp rows to a multiple of this


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


# ---- which kernel runs a block ---------------------------------------------------------------------------------------
def _half_precision_kernel(name: str, min_capability: tuple[int, int], max_head_dim: int, needs: str):
    """The rule of a fused kernel for fp16/bf16 only: why it cannot (or is not used to) run the inputs, or None."""

    def reason(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{name} needs fp16 or bf16 inputs, got {dtype}"
        if capability < min_capability:
            major, minor = min_capability
            return f"{name} {needs} compute capability {major}.{minor} or newer, got {capability}"
        if head_dim % 8 or head_dim > max_head_dim:
            return f"{name} needs a head dim that is a multiple of 8 and at most {max_head_dim}, got {head_dim}"
        return None

    return reason


# cuDNN's kernel runs on older GPUs too; SDPA (and so this module) uses it from sm90, where it is the fastest.
_cudnn_reason = _half_precision_kernel("cuDNN attention", (9, 0), 128, "is used on GPUs of")
_flash_reason = _half_precision_kernel("flash attention", (8, 0), 256, "needs a GPU of")


def _efficient_reason(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> str | None:
    """Why CUDA's memory-efficient attention op cannot run these inputs, or None if it can."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"memory-efficient attention needs fp16, bf16 or fp32 inputs, got {dtype}"
    if capability < ((8, 0) if dtype == torch.bfloat16 else (5, 0)):
        return f"memory-efficient attention in {dtype} is not built for compute capability {capability}"
    align = 4 if dtype == torch.float32 else 8
    if head_dim % align:
        return f"memory-efficient attention in {dtype} needs a head dim that is a multiple of {align}, got {head_dim}"
    return None


_CUDA_REASONS = {"cudnn": _cudnn_reason, "flash": _flash_reason, "efficient": _efficient_reason}  # in SDPA's order


def choose_backend(device_type: str, dtype: torch.dtype, head_dim: int,
                   capability: tuple[int, int] | None = None, forced: str | None = None,
                   enabled: tuple[str, ...] = ("cudnn", "flash", "efficient")) -> str:
    """The kernel for blocks of these inputs: one of `BACKENDS` (see the module docstring).

    `capability`: the CUDA device's compute capability (needed for ``device_type="cuda"``). `enabled`: the CUDA
    kernels that may be chosen (`_backend` passes those SDPA has switched on). `forced` (default: the module's
    ``BACKEND``) picks one; a forced CUDA kernel that cannot run the inputs raises ValueError saying why.
    """
    forced = BACKEND if forced is None else forced
    if forced not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention block backend {forced!r}: use one of {['auto', *BACKENDS]}")
    if forced == "math":
        return "math"
    if device_type == "cpu":
        if forced not in ("auto", "cpu_flash"):
            raise ValueError(f"the {forced!r} attention kernel runs on CUDA only, not on {device_type}")
        fused = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
        return "cpu_flash" if fused else "math"
    if device_type != "cuda":
        if forced != "auto":
            raise ValueError(f"the {forced!r} attention kernel does not run on {device_type}")
        return "math"
    if capability is None:
        raise ValueError("choose_backend needs the CUDA device's compute capability")
    if forced != "auto":
        reason = _CUDA_REASONS.get(forced)
        why = reason(dtype, head_dim, capability) if reason else "it does not run on CUDA"
        if why:
            raise ValueError(f"cannot use the {forced!r} attention kernel: {why}")
        return forced
    for name, reason in _CUDA_REASONS.items():
        if name in enabled and reason(dtype, head_dim, capability) is None:
            return name
    return "math"


def _sdpa_enabled() -> tuple[str, ...]:
    """The CUDA kernels SDPA may use in this process (its ``torch.backends.cuda`` switches; cuDNN also needs cuDNN)."""
    cuda = torch.backends.cuda
    switches = {"cudnn": cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available(),
                "flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled()}
    return tuple(name for name, on in switches.items() if on)


def _backend(q: torch.Tensor) -> str:
    if q.device.type != "cuda":
        return choose_backend(q.device.type, q.dtype, q.shape[-1])
    return choose_backend("cuda", q.dtype, q.shape[-1], torch.cuda.get_device_capability(q.device),
                          enabled=_sdpa_enabled())


# ---- math backend: queries of a K/V head folded into rows, tiled ----------------------------------------------------
def _rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, n, D] -> [B, Hkv, (H/Hkv)*n, D]: the query heads that share a K/V head become rows of one matmul."""
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * n, d)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `_rows`: [B, Hkv, g*n, ...] -> [B, H, n, ...]."""
    b, kv_heads, rows = x.shape[:3]
    return x.reshape(b, heads, rows * kv_heads // heads, *x.shape[3:])


def _tiles(q_rows: torch.Tensor, keys: int) -> list[tuple[int, int]]:
    rows, per_row = q_rows.shape[2], q_rows.shape[0] * q_rows.shape[1] * keys
    step = max(1, TILE_ELEMENTS // max(1, per_row))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, first_row: int, n: int,
            mask: Any) -> torch.Tensor:
    """Scaled scores of rows ``first_row..`` of the folded queries against `k`, masked above the diagonal (causal)
    and where `mask` (a `masking.BlockMask`: its ``rows(query offsets)`` is True where visible) says."""
    acc = acc_dtype(q)  # half-precision scores would round the logits (1e-2 relative in bf16): fp32 operands
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)
    pos = torch.arange(first_row, first_row + q.shape[2], device=q.device) % n  # folded row r is query r % n
    if causal:
        s.masked_fill_(torch.arange(k.shape[2], device=q.device) > pos.unsqueeze(-1), float("-inf"))
    if mask is not None:
        s.masked_fill_(~mask.rows(pos), float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with the -inf of rows that see no key replaced by 0, so exp(s - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: Any = None):
    heads, n, acc = q.shape[1], q.shape[2], acc_dtype(q)
    qr, kk = _rows(q, k.shape[1]), k.to(acc)
    out = torch.empty(*qr.shape[:3], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.empty(qr.shape[:3], dtype=acc, device=q.device)
    for r0, r1 in _tiles(qr, k.shape[2]):
        p = _scores(qr[:, :, r0:r1], kk, scale, causal, r0, n, mask)
        lse[:, :, r0:r1] = torch.logsumexp(p, dim=-1)
        p.sub_(_finite(lse[:, :, r0:r1]).unsqueeze(-1)).exp_()
        out[:, :, r0:r1] = torch.matmul(p.to(v.dtype), v)
    return _heads(out, heads), _heads(lse, heads)


def _math_backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: Any = None):
    heads, kv_heads, n, acc = q.shape[1], k.shape[1], q.shape[2], acc_dtype(q)
    qr, dor = _rows(q, kv_heads), _rows(dout, kv_heads).to(acc)
    delta = (dor * _rows(out, kv_heads).to(acc)).sum(-1)
    lse = _finite(_rows(lse.unsqueeze(-1), kv_heads).squeeze(-1))
    kk, vv = k.to(acc), v.to(acc)
    dq = torch.empty(qr.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for r0, r1 in _tiles(qr, k.shape[2]):
        p = _scores(qr[:, :, r0:r1], kk, scale, causal, r0, n, mask).sub_(lse[:, :, r0:r1].unsqueeze(-1)).exp_()
        do = dor[:, :, r0:r1]
        dv += torch.matmul(p.transpose(-1, -2), do)
        ds = torch.matmul(do, vv.transpose(-1, -2)).sub_(delta[:, :, r0:r1].unsqueeze(-1)).mul_(p)
        dq[:, :, r0:r1] = torch.matmul(ds, kk).mul_(scale)
        dk += torch.matmul(ds.transpose(-1, -2), qr[:, :, r0:r1].to(acc)).mul_(scale)
    return _heads(dq, heads), dk, dv


# ---- CUDA kernels: ATen's ops on [B, H, n, D] ---------------------------------------------------------------------
def _flash_forward(q, k, v, scale: float, causal: bool):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    # No dropout: the random-state arguments are placeholders the kernel does not read.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
        causal, seed, offset, scale=scale)


def _cudnn_forward(q, k, v, scale: float, causal: bool):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale)
    return out, lse.squeeze(-1)  # its log-sum-exp is [B, H, n, 1]


def _cudnn_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    # Its backward reads O and dO in the layout its forward wrote O (contiguous [B, H, n, D]); no dropout: the
    # random-state arguments are placeholders; no cumulative lengths: the dense (not nested) kernel.
    placeholder = torch.zeros(1, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.unsqueeze(-1).contiguous(), placeholder, placeholder, None, None, None, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, m, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, m, d).sum(2)


def _bnhd(x: torch.Tensor) -> torch.Tensor:
    """`x` ([B, H, n, D]) with its memory laid out as [B, n, H, D] (no copy if it already is)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_forward(q, k, v, scale: float, causal: bool):
    heads = q.shape[1]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, True, 0.0, causal, scale=scale)
    return out, lse[:, :, :q.shape[2]]  # its rows are padded to a multiple of _LSE_ALIGN


def _efficient_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    heads, kv_heads, n = q.shape[1], k.shape[1], q.shape[2]
    padded = torch.nn.functional.pad(lse.contiguous(), (0, -n % _LSE_ALIGN))  # the layout its forward returned
    placeholder = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: no random state is read
    # Its backward reads O (and dO) as [B, n, H, D] rows, the layout its forward wrote: a [B, H, n, D]-contiguous O
    # gave dQ 129% off on an H100 (docs/gpu.md).
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _bnhd(dout), q, _repeat_kv(k, heads), _repeat_kv(v, heads), None, _bnhd(out), padded,
        placeholder, placeholder, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


def _cpu_forward(q, k, v, scale: float, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


_KERNELS = {"cpu_flash": (_cpu_forward, _cpu_backward), "cudnn": (_cudnn_forward, _cudnn_backward),
            "flash": (_flash_forward, _flash_backward),
            "efficient": (_efficient_forward, _efficient_backward), "math": (_math_forward, _math_backward)}


# ---- the interface ----------------------------------------------------------------------------------------------
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b, lse_b) of queries [B, H, n, D] against keys/values [B, Hkv, m, D] (``causal`` needs m == n).

    `mask` (a `masking.BlockMask`: which keys each query sees in padded and packed batches) sends the block to the
    math kernel; a query that sees no key gets output 0 and log-sum-exp -inf. So do values of another head size than
    the queries' (DeepSeek's multi-head latent attention), which the fused kernels do not take."""
    if mask is not None or v.shape[-1] != q.shape[-1]:
        return _math_forward(q, k, v, scale, causal, mask)
    return _KERNELS[_backend(q)][0](q, k, v, scale, causal)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool,
                   mask: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dQ, dK, dV) given the final output `out` and log-sum-exp `lse`: in the accumulator dtype (math
    kernel) or the inputs' (fused kernels); callers add them into accumulator-dtype buffers."""
    backend, acc = ("math" if mask is not None or v.shape[-1] != q.shape[-1] else _backend(q)), acc_dtype(q)
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, scale, causal, mask)
    # The fused kernels take gradients and outputs in the inputs' dtype, the log-sum-exp in fp32.
    return _KERNELS[backend][1](dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(acc), scale, causal)


def fused_gradients(q: torch.Tensor, v: torch.Tensor, doc: Any = None) -> bool:
    """Whether `block_backward` returns every block's gradients in the inputs' dtype -- a fused kernel, each block's
    sums rounded once -- for queries like `q`, values like `v` and the document mask `doc`: no mask to apply, values
    of the queries' head size, a fused kernel for the device. (The math kernel's gradients come in fp32.)"""
    return (doc is None or doc.trivial) and v.shape[-1] == q.shape[-1] and _backend(q) != "math"


class Accumulated:
    """A chunk's running (output, lse) over the key blocks merged so far (`accumulate`).

    The first block covering the whole chunk is kept as its kernel returned it (nothing copied); a second merges into
    an fp32 copy of it (the accumulator dtype), in place, as do later ones. Pieces covering some rows and queries
    (padded and packed rows) merge into buffers of its own. Never into a kernel's output, which selective activation
    checkpointing may have kept for recomputation (`owned`: the buffers are this state's)."""

    __slots__ = ("out", "lse", "owned")

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, owned: bool) -> None:
        self.out, self.lse, self.owned = out, lse, owned


def accumulate(state: Accumulated | None, rows: slice, queries: slice, block_out: torch.Tensor,
               block_lse: torch.Tensor, shape: tuple[int, ...]) -> Accumulated:
    """Merge a block covering `rows` x `queries` of a chunk whose output has `shape` ([B, H, n, D])."""
    acc = acc_dtype(block_out)
    if rows == slice(None) and queries == slice(0, shape[2]):
        if state is None:
            return Accumulated(block_out, block_lse.to(acc), owned=False)
        out = state.out if state.owned else state.out.to(acc, copy=True)
        return Accumulated(out, merge_into(out, state.lse, block_out, block_lse), owned=True)
    if state is None:  # queries no block reached yet: output 0, lse -inf (merge's identity)
        state = Accumulated(block_out.new_zeros(shape, dtype=acc),
                            block_out.new_full(shape[:3], float("-inf"), dtype=acc), owned=True)
    elif not state.owned:
        state = Accumulated(state.out.to(acc, copy=True), state.lse.clone(), owned=True)
    region_out, region_lse = merge(state.out[rows, :, queries], state.lse[rows, :, queries], block_out, block_lse)
    state.out[rows, :, queries], state.lse[rows, :, queries] = region_out, region_lse
    return state


def finish(state: Accumulated | None, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """The chunk's (output, lse); output 0 and lse -inf where no block was merged (queries that see no key)."""
    if state is None:
        acc = acc_dtype(like)
        return like.new_zeros(shape, dtype=acc), like.new_full(shape[:3], float("-inf"), dtype=acc)
    return state.out, state.lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> torch.Tensor:
    """Merge one more key block into a running (output, lse): `out` (accumulator dtype) rescaled and added to in
    place, no temporary of its size; returns the new lse."""
    new = torch.logaddexp(lse, block_lse.to(lse.dtype))  # -inf only for a query that has seen no key yet (padding)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.addcmul_(block_out, torch.exp(block_lse.to(lse.dtype) - safe).unsqueeze(-1))
    return new


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine a running (output, lse) with one more key block's, out of place; both in the accumulator dtype."""
    acc = acc_dtype(block_out)
    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)  # -inf only for a query that has seen no key yet (padding)
    safe = _finite(new)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new
