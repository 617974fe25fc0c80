"""The GPU tier: attention block kernels, CP/SP attention, the chunked attention block and a bf16 training run on one
CUDA GPU.

    python -m pytest -m gpu tests/gpu/test_gpu.py        # or: bash scripts/gpu_check.sh (tests, then benchmarks)

Skipped without CUDA; CI never runs it. References are computed in fp64 on the same GPU from fresh random inputs.
Errors are relative to the reference's largest magnitude: bf16 at most 1e-2, fp16 3e-3, fp32 1e-3 (the fp32 kernels
may accumulate in TF32-like precision inside their tiles).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.parallel.sequence import SequenceChunking, kernels
from ndparallel.parallel.sequence.allgather import allgather_attention
from ndparallel.parallel.sequence.ring import ring_attention
from ndparallel.parallel.sequence.ulysses import ulysses_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")]

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-3}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def reference(q, k, v, dout, scale: float, causal: bool):
    """fp64 attention (GQA by repeated heads) with its log-sum-exp and the q/k/v gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.fixture
def backend():
    saved = kernels.BACKEND
    yield lambda name: setattr(kernels, "BACKEND", name)
    kernels.BACKEND = saved


CASES = list(itertools.product(["cudnn", "flash", "efficient", "math"], [torch.bfloat16, torch.float16, torch.float32],
                               [True, False], [(8, 2), (8, 8)], [64, 128]))


@pytest.mark.parametrize("name,dtype,causal,heads,head_dim", CASES,
                         ids=[f"{b}-{str(d)[6:]}-{'causal' if c else 'full'}-gqa{h[0]}/{h[1]}-d{hd}"
                              for b, d, c, h, hd in CASES])
def test_block_kernel_matches_fp64(backend, name, dtype, causal, heads, head_dim):
    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability(device)
    try:
        kernels.choose_backend("cuda", dtype, head_dim, capability, forced=name)
    except ValueError as exc:
        pytest.skip(str(exc))
    backend(name)
    g = torch.Generator(device).manual_seed(head_dim + heads[1])
    n, m = 384, 384 if causal else 640  # full blocks may be rectangular (the keys before a chunk)
    q = torch.randn(2, heads[0], n, head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(2, heads[1], m, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, heads[0], n, head_dim, device=device, generator=g).to(dtype)
    scale = head_dim ** -0.5
    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, scale, causal)
    out, lse = kernels.block_forward(q, k, v, scale, causal)
    grads = kernels.block_backward(dout, q, k, v, out, lse.float(), scale, causal)
    tol = TOLERANCE[dtype]
    errors = {"out": relative_error(out, ref_out), "lse": (lse.double() - ref_lse).abs().max().item() / 10}
    errors.update({f"d{x}": relative_error(gr, ref) for x, gr, ref in zip("qkv", grads, ref_grads)})
    assert all(e <= tol for e in errors.values()), errors


@pytest.fixture
def one_rank_group():
    """A one-rank NCCL group: the CP/SP functions run their whole code path, the collectives move nothing."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses+ring"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cp_sp_attention_on_one_gpu_matches_fp64(one_rank_group, strategy, causal):
    """The load-balanced layout on one rank has two chunks: a causal block per chunk and one full block between
    them, merged by log-sum-exp -- the code every rank of a larger cp runs -- against attention on the whole
    sequence."""
    device, dtype, seq = torch.device("cuda"), torch.bfloat16, 2048
    g = torch.Generator(device).manual_seed(1)
    q, dout = (torch.randn(1, 8, seq, 128, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 2, seq, 128, device=device, generator=g).to(dtype) for _ in range(2))
    scale = 128 ** -0.5
    chunking = SequenceChunking(seq, 1, 0, load_balance=True)
    cp = {"ring": ring_attention, "allgather": allgather_attention}[strategy.split("+")[-1]]

    def attend(qq, kk, vv):
        return cp(qq, kk, vv, chunking, one_rank_group, causal, scale)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*leaves, one_rank_group, attend) if strategy.startswith("ulysses") else attend(*leaves)
    out.backward(dout)
    ref_out, _, *ref_grads = reference(q, k, v, dout, scale, causal)
    errors = {"out": relative_error(out, ref_out)}
    errors.update({f"d{x}": relative_error(t.grad, ref) for x, t, ref in zip("qkv", leaves, ref_grads)})
    assert all(e <= TOLERANCE[dtype] for e in errors.values()), errors
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    assert relative_error(sdpa, ref_out) <= TOLERANCE[dtype]  # the reference agrees with SDPA's own kernel


def test_packed_and_padded_rows_on_one_gpu_match_fp64():
    """Packed documents of uneven lengths and padded rows: the blocks are cut into pieces of any length (fully
    visible, exactly causal, or skipped), each run by the chosen CUDA kernel -- against dense masked attention in
    fp64. Padded queries give exactly 0 and no NaN."""
    from ndparallel.parallel.sequence import SequenceShards, sequence_parallel_attention
    from ndparallel.parallel.sequence.masking import DocumentMask, document_ids

    device, dtype, seq = torch.device("cuda"), torch.bfloat16, 1024
    rows = [[300, 45, 517, 162], [211, 813], [1024]]  # row 1: 211 tokens of left padding
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    mask = torch.ones(len(rows), seq, dtype=torch.long)
    mask[1, :211] = 0
    doc = document_ids(positions, mask, (len(rows), seq)).to(device)
    g = torch.Generator(device).manual_seed(5)
    q, dout = (torch.randn(len(rows), 8, seq, 128, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(len(rows), 2, seq, 128, device=device, generator=g).to(dtype) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sequence_parallel_attention(*leaves, SequenceShards.of(seq), is_causal=True, doc=DocumentMask(doc, None))
    out.backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(4, 1) for t in ref[1:])
    s = ref[0] @ kk.transpose(-1, -2) * 128 ** -0.5
    i, j = torch.arange(seq, device=device).unsqueeze(-1), torch.arange(seq, device=device)
    visible = (j <= i) & (doc.unsqueeze(-1) == doc.unsqueeze(1)) & (doc.unsqueeze(1) >= 0)
    ref_out = torch.softmax(s.masked_fill(~visible.unsqueeze(1), float("-inf")), -1).nan_to_num(0.0) @ vv
    ref_out.backward(dout.double())
    errors = {"out": relative_error(out, ref_out.detach())}
    errors.update({f"d{x}": relative_error(t.grad, r.grad) for x, t, r in zip("qkv", leaves, ref)})
    assert all(e <= TOLERANCE[dtype] for e in errors.values()), errors
    padded = (doc < 0).unsqueeze(1).unsqueeze(-1)
    assert out.masked_select(padded).abs().sum() == 0 and leaves[0].grad.masked_select(padded).abs().sum() == 0
    assert not any(bool(t.isnan().any()) for t in (out, *[t.grad for t in leaves]))


def test_bf16_training_run_matches_plain_pytorch(tmp_path):
    """The README's example on one GPU in bf16 (fp32 master weights, autocast) against the same model, data and
    optimizer in plain PyTorch: the losses agree within bf16 tolerance."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import nd_parallel

    argv = ["--steps", "8", "--seq-len", "256", "--hidden-size", "256", "--layers", "4", "--heads", "8",
            "--kv-heads", "2", "--mixed-precision", "bf16", "--log-every", "4", "--lr", "1e-3"]
    summary = nd_parallel.main(argv)
    losses = summary["losses"]
    plain = plain_pytorch_losses(nd_parallel, nd_parallel.parse_args(argv), torch.device("cuda"))
    assert len(losses) == len(plain) == 8
    gaps = [abs(a - b) / b for a, b in zip(losses, plain)]
    assert max(gaps) <= 2e-2, list(zip(losses, plain))
    assert losses[-1] < losses[0]


def test_fp8_training_run_follows_bf16():
    """The README's example on one GPU with torchao float8 layers (real float8 matmuls) against the same run in bf16:
    the loss curves stay within 2e-2 (the CPU tier's band, tests/parallel/test_fp8.py)."""
    pytest.importorskip("torchao.float8", reason="mixed_precision='fp8' needs torchao")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import nd_parallel

    argv = ["--steps", "20", "--seq-len", "256", "--hidden-size", "256", "--layers", "4", "--heads", "8",
            "--kv-heads", "2", "--log-every", "10", "--lr", "1e-3"]
    bf16 = nd_parallel.main([*argv, "--mixed-precision", "bf16"])["losses"]
    fp8 = nd_parallel.main([*argv, "--mixed-precision", "fp8"])["losses"]
    gaps = [abs(a - b) for a, b in zip(fp8, bf16)]
    assert len(gaps) == 20 and max(gaps) <= 2e-2, list(zip(fp8, bf16))
    assert fp8[-1] < fp8[0]


def plain_pytorch_losses(example, args, device: torch.device) -> list[float]:
    """The example's training loop without the library: same seed, model, data order, optimizer and schedule."""
    from torch.utils.data import DataLoader

    torch.manual_seed(args.seed)
    model = example.build_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else max(
        0.1, 1.0 - 0.9 * (s - warmup) / max(1, args.steps - warmup)))
    dataset = example.build_dataset(args.seq_len)
    sampler = torch.utils.data.RandomSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    def batches():  # the prepared loader's documented order: pass e shuffled by a generator seeded (seed + e)
        for epoch in itertools.count():
            sampler.generator = torch.Generator().manual_seed(args.seed + epoch)
            yield from loader

    losses = []
    for batch in itertools.islice(batches(), args.steps):
        batch = {k: t.to(device) for k, t in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    return losses


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_rms_norm_on_the_gpu_in_bf16(family):
    """`MemoryKwargs(fused_rms_norm=True)`'s norm on CUDA in bf16: the module's own output bitwise, its input and weight
    gradients as close to fp64 as the module's own (CUDA kernels round otherwise than the CPU's), and only the input
    and 1/rms kept for backward."""
    import copy

    from torch import nn

    from ndparallel.parallel.memory.rms_norm import apply_fused_rms_norm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from ndparallel.test_utils.memory import kept_bytes
    from tiny_models import build_model

    torch.manual_seed(0)
    own = next(m for m in build_model(family, hidden_size=256).modules()
               if type(m).__name__.endswith("RMSNorm") and m.weight.shape == (256,))  # a layer norm, not q/k's
    with torch.no_grad():
        own.weight.normal_()
    fused = copy.deepcopy(own)
    apply_fused_rms_norm(nn.Sequential(fused))
    x = torch.randn(2, 1024, 256, device="cuda") * 3
    upstream = torch.randn_like(x)

    def run(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        module = copy.deepcopy(module).to("cuda", dtype)
        inp = x.to(dtype).requires_grad_()
        out = module(inp)
        out.backward(upstream.to(dtype))
        return out.double(), inp.grad.double(), module.weight.grad.double()

    exact, theirs, ours = run(own, torch.float64), run(own, torch.bfloat16), run(fused, torch.bfloat16)
    assert torch.equal(ours[0], theirs[0])
    for mine, other, truth in zip(ours[1:], theirs[1:], exact[1:]):
        assert (mine - truth).abs().max() <= 1.25 * (other - truth).abs().max()
    inp = x.to(torch.bfloat16).requires_grad_()
    norms = [copy.deepcopy(m).to("cuda", torch.bfloat16) for m in (own, fused)]
    kept = [kept_bytes(lambda m=m: m(inp), m.parameters()) for m in norms]
    assert kept[1] == 2 * 1024 * (256 * 2 + 4) < kept[0], kept  # the input and 1/rms per token, and less than its own


@pytest.mark.parametrize("form", ["scaled_after_cast", "scaled_before_cast"])
def test_fused_rms_norm_backward_over_chunks_on_the_gpu(form, monkeypatch):
    """The fused norm's backward on CUDA in bf16 over chunks of at most 64 tokens' working set against all 4,096 tokens
    at once: the caching allocator's peak above the step's start drops to the input gradient and one chunk's working
    set (0.18x by `rms_norm.backward_bytes`; 0.3x allowed for the allocator's 512-B blocks and kernel workspaces), and
    the gradients are the one-chunk ones to rounding (the input's bitwise on the CPU; a CUDA row reduction may split
    otherwise for fewer rows). Not yet run: no GPU was lent to the session that wrote it."""
    import importlib

    module = importlib.import_module("ndparallel.parallel.memory.rms_norm")
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 2048, 256, device="cuda", generator=generator) * 3).to(torch.bfloat16)
    weight = torch.randn(256, device="cuda", generator=generator).to(torch.bfloat16)
    upstream = torch.randn(x.shape, device="cuda", generator=generator).to(torch.bfloat16)

    def backward() -> tuple[torch.Tensor, torch.Tensor, int]:
        inp, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = module.rms_norm(inp, w, 1e-6, 1.0 if form == "scaled_before_cast" else 0.0, form)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out.backward(upstream)
        torch.cuda.synchronize()
        return inp.grad, w.grad, torch.cuda.max_memory_allocated() - start

    whole = backward()
    monkeypatch.setattr(module, "CHUNK_BYTES", 64 * module.token_bytes(256))
    chunks = backward()
    assert chunks[2] <= 0.3 * whole[2], (chunks[2], whole[2])
    for mine, theirs in zip(chunks[:2], whole[:2]):
        scale = theirs.float().abs().max().item()
        assert (mine.float() - theirs.float()).abs().max().item() <= 2**-8 * scale


def chunked_block_against_fp64(device: torch.device, seq: int = 2048, chunks: int = 4) -> dict[str, float]:
    """A Llama attention block (hidden 1,024, 8 / 2 heads of 128) through `block.ChunkedBlock` over `chunks` head
    chunks on one rank (no all-to-all: the chunks' attention is SDPA on their heads), in bf16, against the module's
    own forward and backward in fp64: the output's and every gradient's error relative to the reference's largest
    element, and the module's own bf16 errors beside them."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama
    from ndparallel.parallel.sequence import block

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                         intermediate_size=2048, num_hidden_layers=1, vocab_size=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    module = modeling_llama.LlamaAttention(config, layer_idx=0).to(device)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    g = torch.Generator(device).manual_seed(2)
    x, dout = (torch.randn(1, seq, 1024, device=device, generator=g) for _ in range(2))
    cos, sin = rotary(x, torch.arange(seq, device=device).unsqueeze(0))

    def run(dtype: torch.dtype, chunked: bool) -> list[torch.Tensor]:
        m = module.to(dtype)
        m.zero_grad(set_to_none=True)
        leaf = x.to(dtype).requires_grad_()
        pair = (cos.to(dtype), sin.to(dtype))
        if chunked:
            attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.scaling,
                                                                    enable_gqa=True)
            spec = block._Spec(128, 8, 2, chunks, 1, None, modeling_llama.apply_rotary_pos_emb, attend, True,
                               m.scaling)
            p = [getattr(m, name) for name in block.PROJECTIONS]
            out = block.ChunkedBlock.apply(leaf, *pair, *(q.weight for q in p), *(q.bias for q in p), spec)
        else:
            out = m(hidden_states=leaf, position_embeddings=pair, attention_mask=None)[0]
        out.backward(dout.to(dtype))
        return [out.detach(), leaf.grad, *(getattr(m, name).weight.grad for name in block.PROJECTIONS)]

    exact = [t.double() for t in run(torch.float64, False)]
    names = ["out", "x", *block.PROJECTIONS]
    errors = {f"block {n}": relative_error(t, ref) for n, t, ref in zip(names, run(torch.bfloat16, True), exact)}
    errors.update({f"module {n}": relative_error(t, ref)
                   for n, t, ref in zip(names, run(torch.bfloat16, False), exact)})
    return errors


def test_chunked_attention_block_on_the_gpu_in_bf16():
    """The chunked block's CUDA path (SDPA's kernels per chunk, in-place bf16 accumulation of the hidden states'
    gradient) against fp64: within 2.5x the module's own bf16 error (as on the CPU, tests/parallel/sequence/
    test_chunked_block.py; measured on the CPU at 512 tokens: 4.3e-3 to 9.2e-3 of each reference's largest element,
    the module's own 4.3e-3 to 1.2e-2). Not run yet: no GPU was lent to the session that wrote it."""
    errors = chunked_block_against_fp64(torch.device("cuda"))
    for name in ("out", "x", "q_proj", "k_proj", "v_proj", "o_proj"):
        assert errors[f"block {name}"] <= 2.5 * errors[f"module {name}"] + 1e-3, errors
