"""Context and Ulysses sequence parallelism written out by hand in plain PyTorch: the baseline that
`benchmarks/run.py` times ndparallel's CP and SP against. No ndparallel import.

What a user without the library would write for a Hugging Face Llama:

- the **layout**: each sequence of S tokens is cut into 2 x cp equal chunks and cp rank r keeps chunks r and
  2cp-1-r (causal attention then costs every rank the same); the sp ranks of a cp rank split its shard into sp
  contiguous pieces. `positions(...)` gives a rank's global token positions, used to slice input ids, shifted
  labels and position ids, and to build the attention mask;
- the **attention**, registered in transformers' `AttentionInterface` (and a mask function that returns no mask):
  Ulysses over sp (`all_to_all_single_autograd`: [B, H, L/sp, D] -> [B, H/sp, L, D] and back), then over cp an
  all-gather of K and V (`all_gather_single_autograd`, whose backward reduce-scatters their gradients) and one
  `scaled_dot_product_attention` of the local queries against every key with a causal mask built from global
  positions. Autograd keeps the gathered K/V for backward;
- the **loss**: each rank sums the cross-entropy of its tokens and divides by the tokens of the whole global step,
  times the size of the group FSDP averages gradients over, so the averaged gradient is that of the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "bench_plain_sequence_parallel"


def positions(seq_len: int, cp: int, cp_rank: int, sp: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """Global positions of the tokens a (cp rank, sp rank) holds, in local order."""
    if cp > 1:
        n = seq_len // (2 * cp)
        chunks = (cp_rank, 2 * cp - 1 - cp_rank)
        shard = torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])
    else:
        shard = torch.arange(seq_len)
    piece = shard.numel() // sp
    return shard[sp_rank * piece:(sp_rank + 1) * piece]


@dataclass
class SequenceGroups:
    """The process groups and this rank's place in them."""

    cp_group: object | None
    cp: int
    cp_rank: int
    sp_group: object | None
    sp: int
    seq_len: int


def _seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, H, L/sp, D] sequence pieces -> [B, H/sp, L, D]: every sp rank's piece, for this rank's H/sp heads."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    b, h, n, d = x.shape
    send = x.reshape(b, sp, h // sp, n, d).transpose(0, 1).contiguous()  # [sp, B, H/sp, n, D], one slab per rank
    got = all_to_all_single_autograd(send, None, None, group)  # slab j now holds rank j's piece of my heads
    return got.reshape(sp, b, h // sp, n, d).permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * n, d)


def _heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, H/sp, L, D] -> [B, H, L/sp, D]."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    b, hs, length, d = x.shape
    n = length // sp
    send = x.reshape(b, hs, sp, n, d).permute(2, 0, 1, 3, 4).contiguous()  # [sp, B, H/sp, n, D]
    got = all_to_all_single_autograd(send, None, None, group)  # slab j: my piece of rank j's heads
    return got.reshape(sp, b, hs, n, d).transpose(0, 1).reshape(b, sp * hs, n, d)


class _ContiguousGrad(torch.autograd.Function):
    """Identity; backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def make_attention(groups: SequenceGroups):
    """The attention function for transformers' `AttentionInterface` (its calling convention)."""
    try:
        from torch.distributed._functional_collectives import all_gather_single_autograd
    except ImportError:  # torch < 2.13: the same all-gather along dim 0 (its backward reduce-scatters), older name
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        def all_gather_single_autograd(t: torch.Tensor, dim: int, group) -> torch.Tensor:
            # torch 2.11's backward reduce-scatters the gradient as it comes, and refuses the permuted (non-contiguous)
            # one `gather_keys` hands it
            return _ContiguousGrad.apply(all_gather_tensor_autograd(t, dim, group))

    def gather_keys(t: torch.Tensor) -> torch.Tensor:  # [B, Hkv, n, D] -> [B, Hkv, cp * n, D], cp-rank order
        got = all_gather_single_autograd(t.permute(2, 0, 1, 3).contiguous(), 0, groups.cp_group)
        return got.permute(1, 2, 0, 3)

    # Queries: this cp rank's shard; keys after the all-gather: every cp rank's shard, in cp-rank order.
    q_pos = positions(groups.seq_len, groups.cp, groups.cp_rank)
    k_pos = torch.cat([positions(groups.seq_len, groups.cp, r) for r in range(groups.cp)])
    mask = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if groups.sp > 1:
            query, key, value = (_seq_to_heads(t, groups.sp_group, groups.sp) for t in (query, key, value))
        if groups.cp > 1:
            key, value = gather_keys(key), gather_keys(value)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.device), scale=scaling,
                                                 enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        if groups.sp > 1:
            out = _heads_to_seq(out, groups.sp_group, groups.sp)
        return out.transpose(1, 2).contiguous(), None

    return attention


def install(model, groups: SequenceGroups) -> None:
    """Switch a transformers model to the hand-written attention (no mask: the attention builds its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, make_attention(groups))
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
    model.set_attn_implementation(ATTN_NAME)
