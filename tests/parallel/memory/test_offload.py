"""Activation offloading: the inputs of checkpointed blocks are routed through the offload path, and come back exact.

On CPU nothing moves physically (host memory is the memory), so these tests check what is routed -- each
checkpointed block's hidden-state input, once, and nothing during the recomputation -- that every routed tensor is
restored once, that the round trip through a copy (``copy=True``) gives the same gradients bit for bit, and that
training under FSDP2, CP, TP, SP and PP with offloading matches the single-process run (and that the round trip adds
no host sync). The memory it saves on a GPU is
measured by scripts/gpu_check.sh (benchmarks/long_context.py --gpu), not here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed._composable import checkpoint

from ndparallel import FullyShardedDataParallelPlugin
from ndparallel.parallel.memory.offload import ActivationOffload, offload_block_inputs
from ndparallel.configuration.plugins import ActivationCheckpointing
from test_parity import reference, run_layout
from tiny_models import build_model


def test_spellings():
    spec = FullyShardedDataParallelPlugin(activation_checkpointing={"every": 2, "offload": True}).activation_checkpointing
    assert spec == ActivationCheckpointing(every=2, offload=True)
    assert FullyShardedDataParallelPlugin(activation_checkpointing={"offload": "true"}).activation_checkpointing == \
        ActivationCheckpointing(offload=True)
    with pytest.raises(TypeError, match="activation_checkpointing offload must be a bool"):
        ActivationCheckpointing(offload="sometimes")


def _run(every: int, copy_: bool, layers: int = 4):
    torch.manual_seed(0)
    model = build_model("llama", num_hidden_layers=layers)
    own = copy.deepcopy(model)
    checkpointed = []
    for m in (model, own):
        for i, layer in enumerate(m.model.layers):
            if i % every == 0:
                checkpoint(layer)
                if m is model:
                    checkpointed.append(layer)
    offload = ActivationOffload(torch.device("cpu"), copy=copy_)
    offload_block_inputs(checkpointed, offload)
    ids = torch.randint(0, 96, (2, 16))
    grads = []
    for m in (model, own):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    return offload.stats, grads


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("copy_", [False, True], ids=["in_place", "copied"])
def test_checkpointed_inputs_are_routed_and_restored_exactly(every, copy_):
    stats, (grads, grads_own) = _run(every, copy_)
    blocks = 4 // every
    # Exactly each checkpointed block's hidden-state input (batch 2 x 16 tokens x hidden 32), once; the rotary tables
    # and masks travel as keyword arguments, which the checkpoint keeps as they are.
    assert stats.shapes == [(2, 16, 32)] * blocks and stats.tensors == blocks and stats.bytes == blocks * 2 * 16 * 32 * 4
    assert stats.restored == blocks  # unpacked once each, in backward; the recomputation packed nothing
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_own))  # bit for bit


def test_copies_through_the_host_pool_add_no_host_sync():
    """The round trip through the pool's blocks (``copy=True``: the CUDA path's packing, block bookkeeping and
    restoring, without streams) reads no tensor value on the host that the checkpointed step without it does not."""
    from step_costs import StepCosts

    def syncs(offloaded: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = build_model("llama", num_hidden_layers=2)
        for layer in model.model.layers:
            checkpoint(layer)
        offload = ActivationOffload(torch.device("cpu"), copy=True)
        if offloaded:
            offload_block_inputs(list(model.model.layers), offload)
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # the pool's first step allocates
        with StepCosts() as costs:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return costs.syncs, offload.stats.restored

    (plain, _), (offloaded, restored) = syncs(False), syncs(True)
    assert restored == 2 * 2 and offloaded == plain, (plain, offloaded)


def test_a_tensor_given_to_several_blocks_is_offloaded_once():
    offload = ActivationOffload(torch.device("cpu"), copy=True)
    x = torch.randn(4, 4, requires_grad=True)
    with offload.hooks():
        y = (x * x).sum() + (x * 2).pow(2).sum()  # x saved by the first product twice
    y.backward()
    assert offload.stats.tensors == 2 and offload.stats.restored == 3  # x once (saved twice), x * 2 once
    torch.testing.assert_close(x.grad, 2 * x.detach() + 8 * x.detach())


LAYOUTS = {
    "fsdp2": (2, ["--dp-shard-size", "2"]),
    "cp2": (2, ["--cp-size", "2"]),
    "tp2": (2, ["--tp-size", "2"]),
    "sp2": (2, ["--sp-size", "2"]),
    "pp2": (2, ["--pp-size", "2"]),
}


@pytest.mark.parametrize("layout", ["fsdp2"])
def test_offloading_trains_as_one_process(layout):
    _check(layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "tp2", "sp2", "pp2"])
def test_offloading_trains_as_one_process_under_more_layouts(layout):
    _check(layout)


def _check(layout: str) -> None:
    world, flags = LAYOUTS[layout]
    results = run_layout("llama", world, flags, 1, "--activation-checkpointing", "--offload-activations")
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], reference("llama")["losses"]))
    assert diff <= 1e-5, f"{layout} with offloaded activations: losses differ by {diff:.2e}"
    for result in results:
        stats = result["offloaded"]
        if layout == "pp2":  # one block per stage, 2 micro-batches a step; torch's schedules (2.12.1 on) run each stage
            # once more, with gradients, in their first step to learn the shapes sent: that call offloads too
            from ndparallel.parallel.pipeline.balancing import _SHAPE_CALL_WITH_GRAD

            assert stats is not None and stats.tensors == 2 * 6 + _SHAPE_CALL_WITH_GRAD, stats
            assert 2 * 6 <= stats.restored <= stats.tensors, stats
            continue
        assert stats is not None and stats.tensors == 2 * 6 and stats.restored == stats.tensors, stats  # 2 blocks
