"""The chunked (fused) linear cross-entropy: exact against the model's own loss, on every family and layout.

Tier 1 (one process): the loss and every gradient of a model with the chunked loss against a deep copy of the same
model running transformers' own ``ForCausalLMLoss`` on the full logits -- fp32: within 1e-6 -- for ``labels``,
``shift_labels``, ``num_items_in_batch``, uneven ``-100`` labels and several chunk sizes; Gemma's soft-capping and
Cohere's / Granite's scales read from their source; what turns it off; that no tensor of ``tokens x vocabulary``
elements is ever built. Tier 2: layouts against the single-process reference (tests/reference.py, the model's own
loss), with the status and call count of the chunked loss checked on every rank.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel import MemoryKwargs
from ndparallel.parallel.memory import chunked_loss_status
from ndparallel.parallel.memory.cross_entropy import CHUNK_BYTES, chunk_rows, linear_cross_entropy
from ndparallel.parallel.memory.head_source import Ineligible, head_transforms
from ndparallel.parallel.memory.loss_head import chunked_loss_of, install
from test_parity import max_param_diff, reference, run_layout
from tiny_models import build_model


def _batch(seq: int = 16, rows: int = 2, vocab: int = 96) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven loss tokens over the rows
    labels[1, -3:] = -100
    return {"input_ids": ids, "labels": labels}


def _both(name: str, chunk: int | None = 5, **overrides):
    torch.manual_seed(0)
    model = build_model(name, **overrides)
    own = copy.deepcopy(model)
    assert install(model, MemoryKwargs(loss_chunk_size=chunk)) is not None, chunked_loss_status(model)
    return model, own


def _compare(model, own, **kwargs) -> tuple[float, float, float]:
    """(|loss difference|, largest gradient difference, largest gradient) of one training forward and backward."""
    model.train(), own.train()
    model.zero_grad(), own.zero_grad()
    out = model(**kwargs)
    out.loss.backward()
    expected = own(**kwargs)
    expected.loss.backward()
    assert out.logits is None and expected.logits is not None
    grads = [(a.grad, b.grad) for a, b in zip(model.parameters(), own.parameters()) if b.grad is not None]
    diff = max((a - b).abs().max().item() for a, b in grads)
    return abs(out.loss.item() - expected.loss.item()), diff, max(b.abs().max().item() for _, b in grads)


FAMILIES = ["llama", "qwen2", "llama_tied", "gemma3", "gpt2", "phi3", "qwen3_moe"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("inputs", ["labels", "shift_labels", "num_items_in_batch"])
def test_loss_and_gradients_equal_the_models_own(name, inputs):
    model, own = _both(name)
    batch = _batch()
    if inputs == "shift_labels":  # what CP/SP pass: already shifted (the model then ignores labels' shift)
        batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    if inputs == "num_items_in_batch":  # what the Trainer passes: sum over this count (here more than the batch's)
        batch["num_items_in_batch"] = torch.tensor(40)
    loss_diff, grad_diff, scale = _compare(model, own, **batch)
    assert loss_diff <= 1e-6 * max(1.0, abs(model(**batch).loss.item())), loss_diff
    assert grad_diff <= 1e-6 * max(1.0, scale), f"{name} {inputs}: gradients differ by {grad_diff:.2e}"
    assert chunked_loss_of(model).calls == 2


@pytest.mark.parametrize("chunk", [1, 3, 1000, None])
def test_any_chunk_size_gives_the_same_loss(chunk):
    model, own = _both("llama", chunk=chunk)
    loss_diff, grad_diff, _ = _compare(model, own, **_batch())
    assert loss_diff <= 1e-6 and grad_diff <= 1e-6


def test_soft_capping_and_scales_are_read_from_the_source():
    gemma = build_model("gemma3")
    assert [(t.op, t.value) for t in head_transforms(gemma, "lm_head")] == [
        ("div", gemma.config.final_logit_softcapping), ("tanh", None), ("mul", gemma.config.final_logit_softcapping)]
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=96)
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(**tiny, logit_scale=0.25))
    assert [(t.op, t.value) for t in head_transforms(cohere, "lm_head")] == [("mul", 0.25)]
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**tiny, logits_scaling=4.0))
    assert [(t.op, t.value) for t in head_transforms(granite, "lm_head")] == [("div", 4.0)]
    for model in (cohere, granite):  # and the chunked loss with the scale is exact
        own = copy.deepcopy(model)
        install(model, MemoryKwargs(loss_chunk_size=7))
        loss_diff, grad_diff, scale = _compare(model, own, **_batch())
        assert loss_diff <= 1e-6 and grad_diff <= 1e-6 * max(1.0, scale)


class _UsesLogits(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits - logits.mean(-1, keepdim=True)
        loss = self.loss_function(logits, labels, self.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_what_turns_it_off_and_why():
    config = build_model("llama").config
    assert "changed or read before the loss by: logits = logits - logits.mean" in chunked_loss_status(
        _installed(_UsesLogits(config), MemoryKwargs()))
    assert chunked_loss_status(_installed(build_model("llama", float64=True), MemoryKwargs())) == (
        "off: LlamaForCausalLM's loss_function is 'float64_causal_lm_loss', not transformers' ForCausalLMLoss")
    assert chunked_loss_status(_installed(build_model("llama"), MemoryKwargs(chunked_loss=False))) == \
        "off: MemoryKwargs(chunked_loss=False)"
    assert chunked_loss_status(_installed(build_model("plain"), MemoryKwargs())).startswith(
        "off: PlainTransformer is not a transformers causal LM")
    with pytest.raises(ValueError, match=r"chunked_loss=True\): LlamaForCausalLM's loss_function is 'float64"):
        install(build_model("llama", float64=True), MemoryKwargs(chunked_loss=True))
    with pytest.raises(Ineligible, match="changed or read before the loss"):
        head_transforms(_UsesLogits(config), "lm_head")


def test_a_lora_adapter_on_the_head_turns_it_off():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert chunked_loss_status(_installed(model, MemoryKwargs())) == \
        "off: LlamaForCausalLM's LM head carries a PEFT adapter"
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    own = copy.deepcopy(model)
    install(model, MemoryKwargs(loss_chunk_size=4))
    loss_diff, grad_diff, scale = _compare(model, own, **_batch())  # only the adapters train
    assert loss_diff <= 1e-6 and grad_diff <= 1e-6 * max(1.0, scale)


def _installed(model, settings):
    install(model, settings)
    return model


def test_evaluation_and_calls_without_labels_keep_their_logits():
    model, own = _both("llama")
    batch = _batch()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, own(**batch).logits)
    model.eval()
    assert model(**batch).logits is not None
    model.train()
    assert torch.equal(model(input_ids=batch["input_ids"]).logits, own(input_ids=batch["input_ids"]).logits)
    assert chunked_loss_of(model).calls == 0


def test_bf16_autocast_follows_the_models_own_loss():
    model, own = _both("llama", chunk=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_diff, grad_diff, scale = _compare(model, own, **_batch())
    assert loss_diff <= 2e-2 and grad_diff <= 2e-2 * max(1.0, scale)  # bf16 rounding, not another computation


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operation outputs."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_by_vocabulary_is_built():
    """The structural claim: a chunk's logits are the largest tensor the loss builds (here 8 of 512 tokens)."""
    hidden = torch.randn(512, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (512,))
    with _LargestTensor() as chunked:
        linear_cross_entropy(hidden, weight, None, labels, chunk=8).backward()
    with _LargestTensor() as whole:
        F.cross_entropy(F.linear(hidden, weight).float(), labels).backward()
    assert whole.largest == 512 * 1000 and chunked.largest == 16 * 1000, (chunked.largest, whole.largest)
    # By default as few chunks as the memory needs: one while all the fp32 logits fit in CHUNK_BYTES, else the
    # fewest equal chunks that each fit (one fewer would not).
    assert chunk_rows(100, 10) == 100 and chunk_rows(1024, 32000) == 1024  # 4 KiB, 125 MiB: one chunk
    for tokens, vocab in ((4096, 32000), (32768, 128256), (10**6, 256000)):
        rows = chunk_rows(tokens, vocab)
        chunks = math.ceil(tokens / rows)
        assert chunks > 1 and rows * vocab * 4 <= CHUNK_BYTES < math.ceil(tokens / (chunks - 1)) * vocab * 4
    assert chunk_rows(4096, 32000) == 1024 and chunk_rows(32768, 128256) == 261  # 4 and 126 chunks


# ---- layouts (forked gloo ranks), against the single-process reference -------------------------------------------
LAYOUTS = {
    "1rank": (1, []),
    "ddp2": (2, ["--dp-replicate-size", "2", "--no-fsdp-plugin"]),
    "fsdp2": (2, ["--dp-shard-size", "2"]),
    "tp2": (2, ["--tp-size", "2"]),
    "tp2_sequence_parallel": (2, ["--tp-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--cp-size", "2"]),
    "sp2": (2, ["--sp-size", "2"]),
    "pp2": (2, ["--pp-size", "2", "--pp-microbatches", "2"]),
    "fsdp2_tp2": (4, ["--dp-shard-size", "2", "--tp-size", "2"]),
}


def _check_layout(model: str, layout: str, *extra: str) -> None:
    world, flags = LAYOUTS[layout]
    results = run_layout(model, world, flags, 1, "--loss-chunk-size", "5", *extra)
    ref = reference(model)
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"]))
    assert diff <= 1e-5, f"{model} {layout}: losses differ from the model's own loss by {diff:.2e}"
    ran = [r for r in results if r["chunked_calls"]]
    assert ran and all(r["chunked_loss"].startswith("on") for r in ran), [r["chunked_loss"] for r in results]


@pytest.mark.parametrize("layout", ["1rank", "ddp2", "tp2", "cp2"])
def test_layouts_match_the_single_process_loss(layout):
    _check_layout("llama", layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2_sequence_parallel", "sp2", "pp2", "fsdp2_tp2"])
def test_more_layouts_match_the_single_process_loss(layout):
    _check_layout("llama", layout)


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [("llama_tied", "tp2"), ("gemma3", "tp2"), ("gemma3", "pp2"),
                                          ("llama_tied", "pp2"), ("qwen3_moe", "sp2")])
def test_tied_soft_capped_and_moe_models_under_layouts(model, layout):
    _check_layout(model, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout,accum", [("fsdp2", 2), ("cp2", 1), ("tp2", 2)])
def test_uneven_labels_and_accumulation_give_single_process_parameters(layout, accum):
    """-100 labels spread unevenly over ranks, shards and micro-steps: ndparallel's token weighting on top of the
    chunked loss still gives the single-process gradient (SGD parameters within 1e-6)."""
    from reference import reference_run

    world, flags = LAYOUTS[layout]
    ref = reference_run("llama", global_batch=8, uneven_labels=True, optimizer="sgd", lr=0.5)
    results = run_layout("llama", world, flags, accum, "--uneven-labels", "--optimizer", "sgd", "--lr", "0.5",
                         "--return-params", "--loss-chunk-size", "3")
    assert results[0]["chunked_calls"] > 0
    diff = max_param_diff(results[0]["params"], ref["params"])
    assert diff <= 1e-6, f"{layout} accumulation {accum}: parameters differ by {diff:.2e}"
