"""What the CP/SP block path holds at its peak, against SDPA on the same inputs (issue 38), counted on the CPU.

The bytes of tensors alive at the peak of one forward + backward (ndparallel.test_utils.memory.LiveBytes: every storage an op creates,
released when its last tensor dies; the inputs and the output's gradient exist before and are not counted): the
block path -- ring and all-gather attention on one rank with the load-balanced layout, i.e. the kernels
and merges one rank of a context-parallel group runs -- against ``F.scaled_dot_product_attention``, causal, GQA.
Before issue 38 the block path held 1.90x (ring) and 2.38x (all-gather) SDPA's bytes at every length here in bf16
(fp32 merges of the chunks' outputs, fp32 gradient accumulators for the whole sequence); now 0.95x; the target is
1.10x. Buffers a
kernel allocates inside itself are not seen (the same kernels on both sides; on a GPU, benchmarks/gpu.py measures the
allocator's peak).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndparallel.parallel.sequence import SequenceChunking, kernels
from ndparallel.parallel.sequence.allgather import allgather_attention
from ndparallel.parallel.sequence.ring import ring_attention
from ndparallel.test_utils.memory import LiveBytes

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
STRATEGIES = {"ring": ring_attention, "allgather": allgather_attention}


def _inputs(seq: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seq)
    q, dout = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)], dout


def _peak_and_grads(attend, leaves, dout) -> tuple[int, list[torch.Tensor]]:
    for t in leaves:
        t.grad = None
    with LiveBytes() as memory:
        out = attend(*leaves)
        out.backward(dout)
        del out
    return memory.peak, [t.grad for t in leaves]


def _block_path(strategy: str, seq: int):
    def attend(q, k, v):  # one rank: nothing to communicate, so no process group
        return STRATEGIES[strategy](q, k, v, SequenceChunking(seq, 1, 0, load_balance=True), None, True,
                                    HEAD_DIM ** -0.5)
    return attend


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HEAD_DIM ** -0.5, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_block_path_holds_at_most_1_10x_sdpas_bytes(strategy, dtype):
    for seq in (256, 1024, 4096):
        leaves, dout = _inputs(seq, dtype)
        block, block_grads = _peak_and_grads(_block_path(strategy, seq), leaves, dout)
        sdpa, sdpa_grads = _peak_and_grads(_sdpa, leaves, dout)
        assert block <= 1.10 * sdpa, f"{strategy} {dtype} at {seq}: {block / sdpa:.2f}x SDPA's bytes at the peak"
        # the same attention: the block path's gradients are SDPA's to the kernels' rounding
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        for a, b in zip(block_grads, sdpa_grads):
            assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (strategy, seq, (a - b).abs().max())


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_gradients_summed_in_bf16_equal_an_fp32_accumulators(strategy, monkeypatch):
    """On one rank no element gets more than two blocks' gradients, so their sum in the inputs' dtype (computed in
    fp32, rounded once) is bit for bit what the fp32 accumulators gave, rounded at the end."""
    seq = 512
    leaves, dout = _inputs(seq, torch.bfloat16)
    _, low = _peak_and_grads(_block_path(strategy, seq), leaves, dout)
    module = __import__(f"ndparallel.parallel.sequence.{strategy}", fromlist=["fused_gradients"])
    monkeypatch.setattr(module, "fused_gradients", lambda *args: False)  # the fp32 accumulators, as before
    _, fp32 = _peak_and_grads(_block_path(strategy, seq), leaves, dout)
    assert kernels.fused_gradients(leaves[0], leaves[2])
    for a, b in zip(low, fp32):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
