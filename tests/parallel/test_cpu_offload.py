"""FSDP2's CPU offload on a one-rank shard group (one process, or tp / dp_replicate / cp / sp / pp only): the blocks
reshard after forward, so between a block's forward and its backward its parameters live only in host memory (the GPU
holds the unit it computes), and training stays the single-process run's. Without offload such a group keeps them gathered
(resharding would free nothing: the shard is the whole parameter). The GPU bytes it saves are the planner's
(tests/planner/test_planner_offload.py); here, on the CPU, the decision and each parameter's state are checked."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_parity import reference, run_layout
from tiny_models import build_model


def _states_after_forward(sizes: dict[str, int], offload: bool) -> dict:
    """Per FSDP2 block of the tiny Llama: its reshard-after-forward setting, and its parameters' states (sharded or
    unsharded) between forward and backward and after backward."""
    from torch.distributed.fsdp import FSDPModule

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**sizes), cpu=True,
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=offload))
    model = acc.prepare(build_model("llama"))
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
              if isinstance(m, FSDPModule) and m is not model]  # the root stays gathered into backward either way

    def states() -> set[str]:
        return {p.sharded_state.name for g in groups for p in g.fsdp_params}

    ids = torch.arange(32).remainder(96).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    between = states()
    loss.backward()
    return {"blocks": len(groups), "reshard": {g._reshard_after_forward for g in groups}, "between": between,
            "after": states(), "offloaded": {p.offload_to_cpu for g in groups for p in g.fsdp_params}}


@pytest.mark.parametrize("world,sizes", [(1, {}), (2, {"tp_size": 2})], ids=["one_process", "tp2"])
def test_a_one_rank_shard_group_reshards_after_forward_under_cpu_offload(world, sizes):
    for rank in run_ranks(_states_after_forward, world, sizes, True):
        assert rank["blocks"] == 2 and rank["offloaded"] == {True}
        assert rank["reshard"] == {True} and rank["between"] == {"SHARDED"} and rank["after"] == {"SHARDED"}, rank


def test_without_offload_a_one_rank_shard_group_keeps_its_parameters_gathered():
    for rank in run_ranks(_states_after_forward, 2, {"tp_size": 2}, False):
        assert rank["reshard"] == {False} and rank["between"] == {"UNSHARDED"}, rank


@pytest.mark.parametrize("extra", [[], ["--activation-checkpointing", "--offload-activations"]],
                         ids=["one_process", "one_process_checkpointed_offloaded"])
def test_cpu_offload_on_a_one_rank_shard_group_trains_as_one_process(extra):
    """Resharded between forward and backward, each block is gathered again from its host shard for backward (also
    for the recomputation of a checkpointed block, whose input activation offloading kept): the same values, so the
    losses are the single-process run's (within the 1-rank run's float rounding of the loss factor,
    tests/parallel/test_parity.py)."""
    _check(1, [], *extra)


@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [(2, ["--tp-size", "2"]),
                                         (2, ["--dp-replicate-size", "2", "--dp-shard-size", "1"]),
                                         (2, ["--cp-size", "2"]), (2, ["--sp-size", "2"]), (2, ["--pp-size", "2"])],
                         ids=["tp2", "hsdp_replicate2", "cp2", "sp2", "pp2"])
def test_cpu_offload_on_one_rank_shard_groups_of_more_layouts_trains_as_one_process(world, flags):
    _check(world, flags)


def _check(world: int, flags: list[str], *extra: str) -> None:
    results = run_layout("llama", world, flags, 1, "--cpu-offload", *extra)
    diff = max(abs(a - b) for a, b in zip(results[0]["losses"], reference("llama")["losses"]))
    assert len(results[0]["losses"]) == 6 and diff <= 1e-5, f"{flags}: losses differ by {diff:.2e}"



def _step_syncs(cpu_offload: bool, checkpointing: dict | bool) -> int:
    """Host syncs (tests/parallel/step_costs.py) of the second training step of the tiny Llama through `prepare` on
    one process: forward, backward and the optimizer's step (the first step made the optimizer's state)."""
    from step_costs import StepCosts

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, cpu_offload=cpu_offload, activation_checkpointing=checkpointing))
    torch.manual_seed(0)
    model = acc.prepare(build_model("llama"))
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.arange(64).remainder(96).view(2, 32)

    def step() -> None:
        acc.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    step()
    with StepCosts() as costs:
        step()
    return costs.syncs


def test_cpu_offload_and_the_activation_pool_add_no_host_sync():
    """FSDP2's CPU offload (the one-rank group resharded after forward) and activation offloading (its path; the
    copies through the host pool: tests/parallel/memory/test_offload.py) read no tensor value on the host that the
    same step without them does not.
    (Both steps read some: the CPU AdamW's step counts, 21 here, and with checkpointing one more in transformers'
    mask code -- plain PyTorch's loop reads the same.)"""
    def syncs(cpu_offload: bool, checkpointing: dict | bool) -> int:
        return run_ranks(_step_syncs, 1, cpu_offload, checkpointing)[0]

    assert syncs(True, False) == syncs(False, False)
    checkpointed = syncs(False, {"every": 1})
    assert syncs(False, {"every": 1, "offload": True}) == checkpointed
    assert syncs(True, {"every": 1, "offload": True}) == checkpointed
