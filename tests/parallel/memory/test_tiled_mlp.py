"""Tiled MLPs: each decoder MLP over tiles of the sequence, exact against the untiled model, with and without
activation checkpointing, and under TP (with and without Megatron-style SP), CP, SP and FSDP2 against the
single-process reference; what they keep for backward and the largest tensor they build."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.parallel.activation_checkpointing import _selective_contexts
from ndparallel.parallel.memory.tiled_mlp import apply_tiled_mlp, tiled_mlp_status, tiled_mlps
from ndparallel.test_utils.memory import training_step_kept_bytes
from test_parity import reference, run_layout
from tiny_models import build_model


def _grads(model, ids) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt2", "gemma3"])
@pytest.mark.parametrize("checkpointing", [None, "full", "selective"])
def test_tiled_equals_untiled(name, checkpointing):
    torch.manual_seed(0)
    model = build_model(name)
    own = copy.deepcopy(model)
    apply_tiled_mlp(model, 5)  # 16 tokens: tiles of 5, 5, 5, 1 (tensor_split: 4, 4, 4, 4)
    if checkpointing:
        for m in (model, own):
            for layer in m.model.layers if hasattr(m, "model") else m.transformer.h:
                checkpoint(layer, context_fn=_selective_contexts if checkpointing == "selective" else None)
    ids = torch.randint(0, 96, (2, 16))
    loss, grads = _grads(model, ids)
    loss_own, grads_own = _grads(own, ids)
    assert abs(loss - loss_own) <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(grads, grads_own)) <= 1e-6
    assert all(t.calls == (2 if checkpointing else 1) for t in tiled_mlps(model)), \
        [t.calls for t in tiled_mlps(model)]  # under checkpointing the block's recomputation runs them again


class _LargestMlpTensor(TorchDispatchMode):
    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Tensors along the intermediate size (256), but for down_proj's weight and its gradient (hidden 32 x 256).
        if isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == 256 and tuple(out.shape) != (32, 256):
            self.largest = max(self.largest, out.numel())
        return out


def test_what_a_tiled_mlp_keeps_and_builds():
    """Without checkpointing each MLP keeps only its input for backward (gate, up, their activation and product
    are rebuilt per tile), and no tensor of the whole sequence x intermediate size is ever built."""
    torch.manual_seed(0)
    model = build_model("llama", hidden_size=32, intermediate_size=256)
    own = copy.deepcopy(model)
    apply_tiled_mlp(model, 16)
    ids = torch.randint(0, 96, (1, 128))
    saved, saved_own = training_step_kept_bytes(model, ids), training_step_kept_bytes(own, ids)
    per_layer_mlp = 4 * 128 * 256 * 4  # gate, up, act, product in fp32
    assert saved_own - saved >= 2 * per_layer_mlp * 0.95, (saved, saved_own)  # 2 layers
    with _LargestMlpTensor() as tiled:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with _LargestMlpTensor() as untiled:
        own(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert untiled.largest == 128 * 256 and tiled.largest == 16 * 256, (tiled.largest, untiled.largest)


def test_moe_and_dropout_mlps_stay_untiled():
    model = build_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"no decoder MLP to tile .*untiled: 2 with mixture-of-experts"):
        apply_tiled_mlp(model, 4)
    gpt2 = build_model("gpt2", resid_pdrop=0.1)
    with pytest.raises(ValueError, match=r"untiled: 2 with dropout"):
        apply_tiled_mlp(gpt2, 4)
    llama = build_model("llama")
    apply_tiled_mlp(llama, None)
    assert tiled_mlp_status(llama) == "on: 2 MLPs in tiles of 1024 tokens"


LAYOUTS = {
    "tp2": (2, ["--tp-size", "2"]),
    "tp2_sequence_parallel": (2, ["--tp-size", "2", "--sequence-parallel"]),
    "cp2": (2, ["--cp-size", "2"]),
    "sp2": (2, ["--sp-size", "2"]),
    "fsdp2_checkpointing": (2, ["--dp-shard-size", "2", "--activation-checkpointing"]),
}


def _check(layout: str) -> None:
    world, flags = LAYOUTS[layout]
    results = run_layout("llama", world, flags, 1, "--tiled-mlp", "--mlp-tile-size", "3")
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], reference("llama")["losses"]))
    assert diff <= 1e-5, f"{layout} with tiled MLPs: losses differ by {diff:.2e}"
    assert all(r["tiled_calls"] > 0 for r in results)


@pytest.mark.parametrize("layout", ["tp2_sequence_parallel", "cp2"])
def test_tiled_mlps_under_layouts(layout):
    _check(layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "sp2", "fsdp2_checkpointing"])
def test_tiled_mlps_under_more_layouts(layout):
    _check(layout)
