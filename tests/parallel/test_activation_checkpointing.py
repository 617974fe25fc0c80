"""Activation checkpointing beyond every block: every k-th block, and selective (keep matmul outputs), composed with
every layout (FSDP2, TP, CP, SP) and exact against the single-process run."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from ndparallel import FullyShardedDataParallelPlugin
from ndparallel.configuration.plugins import ActivationCheckpointing, parse_activation_checkpointing
from test_parity import reference, run_layout


@pytest.mark.parametrize("given,expected", [
    (True, True), ("true", True), ("1", True), ("full", True), (1, True), ({"every": 1}, True),
    (False, False), ("0", False), ("false", False), (None, False),
    ("selective", ActivationCheckpointing(policy="selective")), (2, ActivationCheckpointing(every=2)),
    ("3", ActivationCheckpointing(every=3)),
    ({"every": 2, "policy": "selective"}, ActivationCheckpointing(every=2, policy="selective")),
])
def test_spellings(given, expected):
    assert parse_activation_checkpointing(given) == expected
    assert FullyShardedDataParallelPlugin(activation_checkpointing=given).activation_checkpointing == expected


@pytest.mark.parametrize("given,error,match", [
    (0, ValueError, r"every=0: an int >= 1"),
    ("sometimes", TypeError, r"must be a bool, 'full', 'selective', an int k"),
    ({"every": 2, "blocks": 1}, ValueError, r"unknown field\(s\) \['blocks'\]"),
    ({"policy": "lazy"}, ValueError, r"policy='lazy': one of \['full', 'selective'\]"),
])
def test_bad_spellings_are_refused(given, error, match):
    with pytest.raises(error, match=match):
        FullyShardedDataParallelPlugin(activation_checkpointing=given)


def _saved_bytes(spec) -> dict:
    """Which blocks are checkpointed, the bytes autograd keeps through one forward, and the matrix multiplies
    backward runs, for a 4-block model."""
    from torch.distributed._composable import checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.count += 1
            return func(*args, **(kwargs or {}))

    from ndparallel import Accelerator
    from tiny_models import build_model

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(activation_checkpointing=spec))
    torch.manual_seed(0)
    model = acc.prepare(build_model("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=256))
    checkpointed = [i for i, layer in enumerate(model.model.layers) if checkpoint.state(layer) is not None]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 96, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    with CountMatmuls() as backward_matmuls:
        loss.backward()
    acc.end_training()
    return {"checkpointed": checkpointed, "bytes": sum(kept.values()), "backward_matmuls": backward_matmuls.count}


@pytest.mark.slow
def test_which_blocks_and_how_much_is_kept():
    runs = {name: run_ranks(_saved_bytes, 1, spec)[0] for name, spec in [
        ("none", False), ("full", True), ("every2", 2), ("selective", "selective")]}
    assert runs["none"]["checkpointed"] == [] and runs["full"]["checkpointed"] == [0, 1, 2, 3]
    assert runs["every2"]["checkpointed"] == [0, 2] and runs["selective"]["checkpointed"] == [0, 1, 2, 3]
    b = {name: run["bytes"] for name, run in runs.items()}
    assert b["full"] < b["every2"] < b["none"], b  # half the blocks keep their activations
    # Selective keeps each block's matmul outputs (in the checkpoint's own storage, which autograd's hooks do not
    # see): backward re-runs none of the forward's matmuls. Full checkpointing re-runs 6 of each block's 7 (q, k, v,
    # o, gate, up; recomputation stops before down_proj, whose output backward does not need).
    mm = {name: run["backward_matmuls"] for name, run in runs.items()}
    assert mm["selective"] == mm["none"] and mm["full"] == mm["none"] + 4 * 6 and mm["every2"] == mm["none"] + 2 * 6, mm


LAYOUTS = {"fsdp2": (2, ["--dp-shard-size", "2"]), "tp2": (2, ["--tp-size", "2"]),
           "cp2_ring": (2, ["--cp-size", "2", "--cp-strategy", "ring"]), "sp2": (2, ["--sp-size", "2"])}


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["selective", "2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpointing_keeps_parity(layout, spec):
    world, flags = LAYOUTS[layout]
    results = run_layout("llama", world, flags, 1, "--activation-checkpointing", spec)
    ref = reference("llama")
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"]))
    assert diff <= 1e-5, f"{layout} with activation_checkpointing={spec}: losses differ by {diff:.2e}"
