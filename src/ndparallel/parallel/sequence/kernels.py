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

Backends: on CPU, ATen's fused flash-attention kernel for CPU (the kernel `scaled_dot_product_attention` itself
picks there; it returns the log-sum-exp and has a backward that accepts the final O and lse); anywhere else, an exact
implementation from matmuls, tiled over query rows so that no more than `TILE_ELEMENTS` scores exist at a time,
with softmax statistics in fp32 (fp64 for fp64 inputs). Setting ``BACKEND = "math"`` forces the latter (tests do).
"""

from __future__ import annotations

import torch

BACKEND = "auto"  # "auto": fused where available, else math; "math": always the matmul implementation
TILE_ELEMENTS = 1 << 22  # scores per tile of the math backend (16 MiB in fp32)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Softmax statistics and accumulators: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _fused(q: torch.Tensor) -> bool:
    return (BACKEND == "auto" and q.device.type == "cpu"
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


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


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, first_row: int, n: int) -> torch.Tensor:
    """Scaled scores of rows ``first_row..`` of the folded queries against `k`, masked above the diagonal."""
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc_dtype(q)).mul_(scale)
    if causal:  # folded row r is query position r % n
        pos = torch.arange(first_row, first_row + q.shape[2], device=q.device) % n
        s.masked_fill_(torch.arange(k.shape[2], device=q.device) > pos.unsqueeze(-1), float("-inf"))
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    heads, n, acc = q.shape[1], q.shape[2], acc_dtype(q)
    qr = _rows(q, k.shape[1])
    out = torch.empty(*qr.shape[:3], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.empty(qr.shape[:3], dtype=acc, device=q.device)
    for r0, r1 in _tiles(qr, k.shape[2]):
        p = _scores(qr[:, :, r0:r1], k, scale, causal, r0, n)
        lse[:, :, r0:r1] = torch.logsumexp(p, dim=-1)
        p.sub_(lse[:, :, r0:r1].unsqueeze(-1)).exp_()
        out[:, :, r0:r1] = torch.matmul(p.to(v.dtype), v)
    return _heads(out, heads), _heads(lse, heads)


def _math_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    heads, kv_heads, n, acc = q.shape[1], k.shape[1], q.shape[2], acc_dtype(q)
    qr, dor = _rows(q, kv_heads), _rows(dout, kv_heads).to(acc)
    delta = (dor * _rows(out, kv_heads).to(acc)).sum(-1)
    lse = _rows(lse.unsqueeze(-1), kv_heads).squeeze(-1)
    kk, vv = k.to(acc), v.to(acc)
    dq = torch.empty(qr.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for r0, r1 in _tiles(qr, k.shape[2]):
        p = _scores(qr[:, :, r0:r1], k, scale, causal, r0, n).sub_(lse[:, :, r0:r1].unsqueeze(-1)).exp_()
        do = dor[:, :, r0:r1]
        dv += torch.matmul(p.transpose(-1, -2), do)
        ds = torch.matmul(do, vv.transpose(-1, -2)).sub_(delta[:, :, r0:r1].unsqueeze(-1)).mul_(p)
        dq[:, :, r0:r1] = torch.matmul(ds, kk).mul_(scale)
        dk += torch.matmul(ds.transpose(-1, -2), qr[:, :, r0:r1].to(acc)).mul_(scale)
    return _heads(dq, heads), dk, dv


# ---- the interface ----------------------------------------------------------------------------------------------
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b, lse_b) of queries [B, H, n, D] against keys/values [B, Hkv, m, D] (``causal`` needs m == n)."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    return _math_forward(q, k, v, scale, causal)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dQ, dK, dV), in the accumulator dtype, given the final output `out` and log-sum-exp `lse`."""
    if _fused(q):
        acc = acc_dtype(q)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(acc), 0.0, causal, scale=scale)
        return tuple(g.to(acc) for g in grads)  # type: ignore[return-value]
    return _math_backward(dout, q, k, v, out, lse, scale, causal)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine a running (output, lse) with one more key block's; both in the accumulator dtype."""
    acc = acc_dtype(block_out)
    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)  # finite: every block gives each query at least one key
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return out, new
