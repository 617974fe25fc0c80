"""Fused RMSNorms (`ndparallel.parallel.memory.rms_norm`): recognised in every family that has them, the model's
own output bitwise and its gradients to rounding, in fp32 and in bf16 as close to fp64 as the model's own norm; what
they keep for backward; norms computing anything else keep their own forward; and under the layouts, against the
single-process reference."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from ndparallel.parallel.memory.rms_norm import (CHUNK_BYTES, OWN_BACKWARD_BYTES, apply_fused_rms_norm, backward_bytes,
                                                 chunk_tokens, fused_rms_norm_status, rms_norm,
                                                 token_bytes)
from ndparallel.test_utils.memory import LiveBytes, kept_bytes, training_step_kept_bytes
from step_costs import StepCosts
from test_parity import reference, run_layout
from tiny_models import build_model

rms_norm_module = importlib.import_module("ndparallel.parallel.memory.rms_norm")  # the package's `rms_norm` is the function


def _run(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# llama: weight * normed.to(dtype); gemma3: (1 + weight) in fp32 before the cast; olmo2: q/k norms over all heads;
# gpt_oss: weight * normed in fp32, then the cast; deepseek_v3: latent-attention norms too
@pytest.mark.parametrize("name", ["llama", "gemma3", "olmo2", "gpt_oss", "deepseek_v3"])
def test_fused_norms_give_the_models_loss_bitwise_and_its_gradients_to_rounding(name):
    torch.manual_seed(0)
    model = build_model(name)
    own = copy.deepcopy(model)
    fused = apply_fused_rms_norm(model)
    norms = [m for m in own.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(fused) == len(norms) and fused_rms_norm_status(model) == f"on: {len(norms)} RMSNorms"
    ids = torch.randint(0, 96, (2, 16))
    loss, grads = _run(model, ids)
    loss_own, grads_own = _run(own, ids)
    assert torch.equal(loss, loss_own)
    assert max((a - b).abs().max().item() for a, b in zip(grads, grads_own)) <= 1e-6
    assert all(norm.calls >= 1 for norm in fused)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_in_bf16_the_gradients_are_as_close_to_fp64_as_the_models_own(name):
    """One norm of the model in bf16, fused and its own, against the same norm in fp64."""
    torch.manual_seed(0)
    norm = next(m for m in build_model(name).modules() if type(m).__name__.endswith("RMSNorm"))
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 64, norm.weight.shape[0]) * 3
    upstream = torch.randn_like(x)

    def grads(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        module = copy.deepcopy(module).to(dtype)
        inp = x.to(dtype).requires_grad_()
        out = module(inp)
        out.backward(upstream.to(dtype))
        return out.double(), inp.grad.double(), module.weight.grad.double()

    exact = grads(norm, torch.float64)
    own = grads(norm, torch.bfloat16)
    fused_norm = copy.deepcopy(norm)
    apply_fused_rms_norm(nn.Sequential(fused_norm))
    ours = grads(fused_norm, torch.bfloat16)
    assert torch.equal(ours[0], own[0])  # the output: bitwise
    for mine, theirs, truth in zip(ours[1:], own[1:], exact[1:]):
        error, error_own = (mine - truth).abs().max().item(), (theirs - truth).abs().max().item()
        assert error <= 1.25 * error_own, (error, error_own)


def one_norm(tokens: int, hidden: int) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """The tiny Llama's first RMSNorm in bf16 (hidden `hidden`), a fused copy of it, and an input of `tokens` tokens
    (tests/scripts/feature_bytes.py prints what they keep)."""
    torch.manual_seed(0)
    norm = next(m for m in build_model("llama", hidden_size=hidden).modules() if type(m).__name__.endswith("RMSNorm"))
    norm = norm.to(torch.bfloat16)
    fused = copy.deepcopy(norm)
    apply_fused_rms_norm(nn.Sequential(fused))
    return norm, fused, torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)


def test_what_a_fused_norm_keeps():
    """A bf16 norm of T tokens x h keeps its input (2 h bytes per token) and 1/rms (4 bytes per token); the model's own
    keeps an fp32 copy of the input (4 h), 1/rms and the bf16 normalised value (2 h, which the next projection keeps
    anyway). In a model: 4 h bytes per token less for each of its norms (2 per layer and the final one), and so much
    less held at the peak of forward + backward (ndparallel.test_utils.memory.LiveBytes; to the byte here since the fused backward
    computes in place, 12,416 B less before; the bound leaves 5% to the backward's own buffers)."""
    tokens, hidden = 256, 64
    norm, fused, x = one_norm(tokens, hidden)
    assert kept_bytes(lambda: fused(x), fused.parameters()) == tokens * (2 * hidden + 4)
    assert kept_bytes(lambda: norm(x), norm.parameters()) == tokens * (4 * hidden + 4 + 2 * hidden)

    model = build_model("llama", hidden_size=hidden).to(torch.bfloat16)
    own = copy.deepcopy(model)
    apply_fused_rms_norm(model)
    norms = 2 * model.config.num_hidden_layers + 1
    ids = torch.randint(0, 96, (1, tokens))
    saved, saved_own = training_step_kept_bytes(model, ids), training_step_kept_bytes(own, ids)
    assert saved_own - saved == norms * tokens * hidden * 4, (saved, saved_own)
    peaks = []
    for m in (model, own):
        m.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        peaks.append(live.peak)
    assert 0.95 * (saved_own - saved) <= peaks[1] - peaks[0] <= saved_own - saved, peaks


def _norm_backward(tokens: int, dtype: torch.dtype, form: str, hidden: int = 64, rows: int = 1):
    """A fused norm's gradients of `rows` x `tokens` random tokens, the bytes its backward held at the peak and the
    host syncs it made."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, tokens, hidden, generator=generator) * 3).to(dtype).requires_grad_()
    weight = torch.randn(hidden, generator=generator).to(dtype).requires_grad_()
    out = rms_norm(x, weight, 1e-6, 1.0 if form == "scaled_before_cast" else 0.0, form)
    grad = torch.randn(out.shape, generator=generator).to(dtype)
    with LiveBytes() as live, StepCosts() as costs:
        out.backward(grad)
    return x.grad, weight.grad, live.peak, costs.syncs


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["scaled_after_cast", "scaled_before_cast"])
def test_the_fused_backwards_working_set_is_what_it_allocates(dtype, form, chunked, monkeypatch):
    """`backward_bytes` (the planner's term for the fused norm's backward), against the bytes the backward holds at
    its peak (LiveBytes; the input gradient included), at two lengths: what grows with the tokens is exactly its
    growth, what does not (the weight's fp32 gradient, Gemma's fp32 scale) is under one token's worth. In one chunk
    (the default budget) and over chunks of at most 150 tokens (4 of 125 tokens at 500, 7 of 143 at 1000)."""
    hidden = 64
    if chunked:
        monkeypatch.setattr(rms_norm_module, "CHUNK_BYTES", 150 * token_bytes(hidden))
    peaks = [_norm_backward(tokens, dtype, form, hidden)[2] for tokens in (500, 1000)]
    element = torch.tensor([], dtype=dtype).element_size()
    predicted = [backward_bytes(tokens, hidden, element) for tokens in (500, 1000)]
    assert [chunk_tokens(tokens, hidden) for tokens in (500, 1000)] == ([125, 143] if chunked else [500, 1000])
    assert peaks[1] - peaks[0] == predicted[1] - predicted[0], (peaks, predicted)
    assert 0 <= peaks[0] - predicted[0] < token_bytes(hidden), (peaks, predicted)


def test_chunks_are_the_fewest_that_fit_the_budget():
    """Llama-3.1-8B's hidden size: 12 x 4,096 + 4 B a token, 2,730 tokens in 128 MiB; the 436,224 tokens of one rank at
    the 8-GPU planner's former longest sequence go in 160 chunks of 2,727."""
    per_token = token_bytes(4096)
    assert per_token == 49156 and CHUNK_BYTES // per_token == 2730
    assert chunk_tokens(2730, 4096) == 2730 and chunk_tokens(2731, 4096) == 1366
    assert chunk_tokens(436224, 4096) == 2727 and -(-436224 // 2727) == 160
    assert backward_bytes(436224, 4096, 2) == 436224 * 4096 * 2 + 2727 * per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["scaled_after_cast", "scaled_before_cast"])
def test_over_chunks_the_backward_holds_less_with_the_same_gradients_and_no_host_sync(dtype, form, monkeypatch):
    """4,096 tokens (two rows of 2,048) in chunks of at most 64 tokens' working set: the backward's peak is the input
    gradient and one chunk's working set, 4,096 x h c + 64 x (12 h + 4) against 4,096 x (12 h + 4) all at once
    (0.35x in fp32, 0.18x in bf16); the input gradient bitwise the one-chunk backward's, the weight's to fp32 rounding
    (summed over the chunks in fp32: the same sum in another order); no host sync."""
    hidden, tokens = 64, 2048
    whole = _norm_backward(tokens, dtype, form, hidden, rows=2)
    monkeypatch.setattr(rms_norm_module, "CHUNK_BYTES", 64 * token_bytes(hidden))
    chunks = _norm_backward(tokens, dtype, form, hidden, rows=2)
    assert whole[2] >= 2 * tokens * token_bytes(hidden)
    assert chunks[2] <= (0.20 if dtype == torch.bfloat16 else 0.36) * whole[2], (chunks[2], whole[2])
    assert torch.equal(chunks[0], whole[0])
    scale = whole[1].float().abs().max().item()  # a sum of 4,096 terms: to rounding of the largest, not each
    error = (chunks[1].float() - whole[1].float()).abs().max().item()
    assert error <= (1e-6 if dtype == torch.float32 else 2**-8) * scale, (error, scale)
    assert whole[3] == chunks[3] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_models_own_norms_backward_allocates_what_the_planner_counts(dtype):
    """`OWN_BACKWARD_BYTES` per element (the planner's term for a norm that is not fused), against the bytes the
    model's own norm's backward holds at its peak (Llama's, as `tiny_models` builds it), at two lengths."""
    hidden, peaks = 64, []
    norm = next(m for m in build_model("llama", hidden_size=hidden).modules() if type(m).__name__.endswith("RMSNorm"))
    norm = norm.to(dtype)
    for tokens in (500, 1000):
        x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
        out = norm(x)
        grad = torch.randn_like(out)
        norm.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            out.backward(grad)
        peaks.append(live.peak)
    assert peaks[1] - peaks[0] == 500 * hidden * OWN_BACKWARD_BYTES, peaks


class _DividingNorm(nn.Module):
    """An RMSNorm by name that divides by the root (other bits than multiplying by the reciprocal square root)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class BiasedRMSNorm(_DividingNorm):
    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.bias = nn.Parameter(torch.zeros(hidden))


def test_a_norm_that_computes_something_else_keeps_its_own_forward():
    DividingRMSNorm = type("DividingRMSNorm", (_DividingNorm,), {})
    model = nn.Sequential(DividingRMSNorm(8), BiasedRMSNorm(8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"has no RMSNorm whose forward ndparallel recognises \(their own forward "
                                         r"kept: 2 BiasedRMSNorm, DividingRMSNorm\)"):
        apply_fused_rms_norm(model)
    with pytest.raises(ValueError, match="no RMSNorm whose forward"):
        apply_fused_rms_norm(build_model("gpt2"))
    with pytest.raises(ValueError, match="form must be one of"):
        rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, form="other")


def _check(layout: str, world: int, flags: list[str]) -> None:
    results = run_layout("llama", world, flags, 1, "--fused-rms-norm")
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], reference("llama")["losses"]))
    assert diff <= 1e-5, f"{layout} with fused RMSNorms: losses differ by {diff:.2e}"
    assert all(r["fused_norm_calls"] > 0 for r in results)


LAYOUTS = {
    "cp2": (2, ["--cp-size", "2"]),
    "fsdp2_checkpointing": (2, ["--dp-shard-size", "2", "--activation-checkpointing"]),
    "tp2": (2, ["--tp-size", "2"]),
    "sp2": (2, ["--sp-size", "2"]),
    "pp2": (2, ["--pp-size", "2"]),
    "cp2_sp2": (4, ["--cp-size", "2", "--sp-size", "2"]),
}


@pytest.mark.parametrize("layout", ["cp2", "fsdp2_checkpointing"])
def test_fused_norms_under_layouts(layout):
    _check(layout, *LAYOUTS[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "sp2", "pp2", "cp2_sp2"])
def test_fused_norms_under_more_layouts(layout):
    _check(layout, *LAYOUTS[layout])


@pytest.mark.parametrize("layout", ["cp2", "fsdp2_checkpointing",
                                    *(pytest.param(name, marks=pytest.mark.slow)
                                      for name in ("tp2", "sp2", "pp2", "cp2_sp2"))])
def test_fused_norms_over_chunks_under_layouts(layout, monkeypatch):
    """The ranks are forked from this process, so each fused norm's backward there runs in chunks of at most 3 tokens
    (of the tiny Llama's hidden size 32; a rank's micro-batch holds more): the same losses, in every layout."""
    monkeypatch.setattr(rms_norm_module, "CHUNK_BYTES", 3 * token_bytes(build_model("llama").config.hidden_size))
    assert chunk_tokens(16, 32) == 3
    _check(layout, *LAYOUTS[layout])


def test_the_switch_reads_the_environment_and_refuses_what_is_not_a_bool():
    from ndparallel import MemoryKwargs

    assert MemoryKwargs().fused_rms_norm is False
    assert MemoryKwargs.from_env(None, {"NDPARALLEL_FUSED_RMS_NORM": "true"}).fused_rms_norm is True
    assert MemoryKwargs.from_env(MemoryKwargs(tiled_mlp=True), {"NDPARALLEL_FUSED_RMS_NORM": "1"}).tiled_mlp is True
    with pytest.raises(TypeError, match=r"MemoryKwargs.fused_rms_norm must be a bool"):
        MemoryKwargs(fused_rms_norm="sometimes")
