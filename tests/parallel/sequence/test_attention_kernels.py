"""Which kernel runs an attention block, and how the CUDA kernels are called -- checked without a GPU.

The choice follows the rules SDPA applies to its own fused kernels (dtype, compute capability, head dim, GQA); the
table below is written from those rules, not from the code. The CUDA ops' calling conventions (argument order, the
log-sum-exp's shape and padding, GQA's head repetition and the summed K/V gradients) are checked on PyTorch's meta
device, whose kernels mirror the CUDA ones' output shapes. Their numerics run in the GPU tier (tests/gpu/test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from ndparallel.parallel.sequence import kernels

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
H100, A100, V100, T4 = (9, 0), (8, 0), (7, 0), (7, 5)


# On an H100 (torch 2.11) SDPA ran cuDNN's kernel for bf16 causal GQA attention with head dim 128 (docs/gpu.md).
@pytest.mark.parametrize("device,dtype,head_dim,capability,expected", [
    ("cuda", BF16, 128, H100, "cudnn"),
    ("cuda", FP16, 64, H100, "cudnn"),
    ("cuda", BF16, 128, A100, "flash"),      # cuDNN's kernel is used from sm90
    ("cuda", FP16, 64, A100, "flash"),
    ("cuda", BF16, 256, H100, "flash"),      # past cuDNN's largest head dim here
    ("cuda", BF16, 256, A100, "flash"),
    ("cuda", BF16, 512, H100, "efficient"),   # past flash's largest head dim
    ("cuda", BF16, 100, H100, "math"),        # not a multiple of 8: neither half-precision kernel takes it
    ("cuda", FP32, 128, H100, "efficient"),   # flash has no fp32
    ("cuda", FP32, 36, H100, "efficient"),    # fp32 needs a multiple of 4 only
    ("cuda", FP32, 30, H100, "math"),
    ("cuda", FP64, 128, H100, "math"),
    ("cuda", FP16, 128, V100, "efficient"),   # flash needs sm80
    ("cuda", BF16, 128, T4, "math"),          # no bf16 kernels before sm80
    ("cpu", BF16, 128, None, "cpu_flash"),
    ("cpu", FP64, 30, None, "cpu_flash"),
    ("mps", FP16, 128, None, "math"),
])
def test_backend_choice_follows_sdpa_rules(device, dtype, head_dim, capability, expected):
    assert kernels.choose_backend(device, dtype, head_dim, capability, forced="auto") == expected


def test_a_kernel_switched_off_for_sdpa_is_not_chosen():
    assert kernels.choose_backend("cuda", BF16, 128, H100, enabled=("flash", "efficient")) == "flash"
    assert kernels.choose_backend("cuda", BF16, 128, H100, enabled=("efficient",)) == "efficient"
    assert kernels.choose_backend("cuda", BF16, 128, H100, enabled=()) == "math"
    assert kernels._sdpa_enabled() == tuple(  # this machine's switches (a CPU build has no cuDNN)
        name for name, on in [("cudnn", torch.backends.cudnn.is_available()), ("flash", True), ("efficient", True)]
        if on)
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert "flash" not in kernels._sdpa_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_forced_backends_and_their_refusals():
    assert kernels.choose_backend("cuda", BF16, 128, H100, forced="efficient") == "efficient"
    assert kernels.choose_backend("cuda", BF16, 128, H100, forced="math") == "math"
    assert kernels.choose_backend("cpu", BF16, 128, forced="math") == "math"
    with pytest.raises(ValueError, match="flash attention needs fp16 or bf16 inputs"):
        kernels.choose_backend("cuda", FP32, 128, H100, forced="flash")
    with pytest.raises(ValueError, match="compute capability 8.0"):
        kernels.choose_backend("cuda", FP16, 128, V100, forced="flash")
    assert kernels.choose_backend("cuda", BF16, 128, A100, forced="flash") == "flash"
    with pytest.raises(ValueError, match="cuDNN attention is used on GPUs of compute capability 9.0"):
        kernels.choose_backend("cuda", BF16, 128, A100, forced="cudnn")
    with pytest.raises(ValueError, match="cuDNN attention needs a head dim .* at most 128, got 256"):
        kernels.choose_backend("cuda", BF16, 256, H100, forced="cudnn")
    with pytest.raises(ValueError, match="runs on CUDA only"):
        kernels.choose_backend("cpu", BF16, 128, forced="flash")
    with pytest.raises(ValueError, match="does not run on CUDA"):
        kernels.choose_backend("cuda", BF16, 128, H100, forced="cpu_flash")
    with pytest.raises(ValueError, match="unknown attention block backend 'triton'"):
        kernels.choose_backend("cuda", BF16, 128, H100, forced="triton")
    with pytest.raises(ValueError, match="compute capability"):
        kernels.choose_backend("cuda", BF16, 128, None, forced="auto")


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 8)])
@pytest.mark.parametrize("n,m,causal", [(100, 100, True), (100, 60, False)])
def test_cuda_kernel_calling_conventions_on_meta(backend, heads, kv_heads, n, m, causal):
    """Forward gives [B, H, n, D] and an fp32 log-sum-exp of exactly n rows (the efficient op pads its rows to 32:
    100 is not a multiple); backward accepts the merged fp32 lse and gives K/V gradients with K/V's own heads."""
    forward, backward = kernels._KERNELS[backend]
    q = torch.empty(2, heads, n, 64, device="meta", dtype=BF16)
    k, v = (torch.empty(2, kv_heads, m, 64, device="meta", dtype=BF16) for _ in range(2))
    out, lse = forward(q, k, v, 0.125, causal)
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (2, heads, n) and lse.dtype == FP32
    dq, dk, dv = backward(torch.empty_like(out), q, k, v, out, lse.float(), 0.125, causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_gqa_by_repeated_heads_gives_the_grouped_gradients():
    """The efficient kernel has no GQA: K/V heads are repeated for it and their gradients summed back. Checked with
    the math backend, which does GQA natively: repeat -> backward -> sum equals the grouped backward."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 6, 12, 8, generator=g, dtype=FP64) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=FP64) for _ in range(2))
    out, lse = kernels._math_forward(q, k, v, 0.3, True)
    grouped = kernels._math_backward(dout, q, k, v, out, lse, 0.3, True)
    kr, vr = kernels._repeat_kv(k, 6), kernels._repeat_kv(v, 6)
    out_r, lse_r = kernels._math_forward(q, kr, vr, 0.3, True)
    assert torch.allclose(out_r, out, atol=1e-12) and torch.allclose(lse_r, lse, atol=1e-12)
    dq, dk, dv = kernels._math_backward(dout, q, kr, vr, out, lse, 0.3, True)
    assert torch.allclose(dq, grouped[0], atol=1e-12)
    assert torch.allclose(kernels._sum_kv(dk, 2), grouped[1], atol=1e-12)
    assert torch.allclose(kernels._sum_kv(dv, 2), grouped[2], atol=1e-12)


def _one_rank_block_path() -> dict[str, float]:
    """Ring, all-gather and Ulysses-around-ring on a one-rank group (what the GPU tier and benchmarks/gpu.py run on
    one GPU) against full attention: two chunks, merged by log-sum-exp, in fp64."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ndparallel.parallel.sequence import SequenceChunking
    from ndparallel.parallel.sequence.allgather import allgather_attention
    from ndparallel.parallel.sequence.ring import ring_attention
    from ndparallel.parallel.sequence.ulysses import ulysses_attention

    dist.init_process_group("gloo")
    chunking, group, errors = SequenceChunking(16, 1, 0, load_balance=True), dist.group.WORLD, {}
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 4, 16, 8, generator=g, dtype=FP64) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=FP64) for _ in range(2))
    for causal in (True, False):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True).backward(dout)
        for name, cp in (("ring", ring_attention), ("allgather", allgather_attention), ("ulysses", None)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            if cp is None:
                out = ulysses_attention(*leaves, group, lambda a, b, c: ring_attention(a, b, c, chunking, group, causal,
                                                                                       8 ** -0.5))
            else:
                out = cp(*leaves, chunking, group, causal, 8 ** -0.5)
            out.backward(dout)
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            diffs = [out - expected] + [a.grad - b.grad for a, b in zip(leaves, ref)]
            errors[f"{name} causal={causal}"] = max(d.abs().max().item() for d in diffs)
    dist.destroy_process_group()
    return errors


def test_block_path_on_one_rank_matches_full_attention():
    from harness import run_ranks

    errors = run_ranks(_one_rank_block_path, 1)[0]
    assert len(errors) == 6 and max(errors.values()) < 1e-12, errors
