"""The Accelerator's process and mesh surface, read from the mesh (checked against first principles)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from harness import run_ranks


def _surface() -> dict:
    from ndparallel import Accelerator, DistributedType, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, tp_size=2))
    model = torch.nn.Linear(3, 3)  # never prepared: only the process and mesh surface is read
    order = []
    with acc.main_process_first():
        order.append(time.monotonic())
    acc.wait_for_everyone()
    return {
        "rank": acc.process_index, "local": acc.local_process_index, "n": acc.num_processes,
        "main": acc.is_main_process, "local_main": acc.is_local_main_process,
        "axes": {a: (getattr(acc, f"{a}_rank"), getattr(acc, f"{a}_size"))
                 for a in ("dp_replicate", "dp_shard", "cp", "sp", "tp")},
        "data": (acc.data_parallel_rank, acc.data_parallel_size),
        # DDP x TP replicates through FSDP2 (DDP takes no DTensor parameters), so it reports FSDP.
        "type": acc.distributed_type == DistributedType.FSDP,
        "unwrapped": type(acc.unwrap_model(model)).__name__,
        "mesh_dims": acc.torch_device_mesh.mesh_dim_names,
        "dp_view": acc.mesh["dp"].mesh.tolist(),
        "torch_dp_replicate": acc.torch_device_mesh["dp_replicate"].mesh.tolist(),
        "entered": order[0],
    }


def test_rank_and_size_properties_come_from_the_mesh():
    out = run_ranks(_surface, 4)
    for rank, res in enumerate(out):
        dp, tp = np.unravel_index(rank, (2, 2))
        assert res["rank"] == res["local"] == rank and res["n"] == 4
        assert res["main"] == res["local_main"] == (rank == 0)
        assert res["axes"] == {"dp_replicate": (dp, 2), "dp_shard": (0, 1), "cp": (0, 1), "sp": (0, 1), "tp": (tp, 2)}
        assert res["data"] == (dp, 2)
        assert res["type"] and res["unwrapped"] == "Linear"
        # Axes of one rank get no dimension (nor groups), but dp_shard: FSDP2 replicates beside TP over (dp_replicate,
        # dp_shard), which must share the world mesh with tp.
        assert res["mesh_dims"] == ("dp_replicate", "dp_shard", "tp")
        assert res["dp_view"] == res["torch_dp_replicate"] == [tp, tp + 2]
    # main_process_first: rank 0 entered its block before every other rank entered theirs
    assert all(out[0]["entered"] <= r["entered"] for r in out[1:])


def _default_is_ddp_over_everyone() -> tuple:
    from torch.nn.parallel import DistributedDataParallel

    from ndparallel import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 2))
    return acc.parallelism_config.dp_replicate_size, isinstance(model, DistributedDataParallel)


def test_without_a_config_the_accelerator_runs_ddp_over_all_processes():
    assert run_ranks(_default_is_ddp_over_everyone, 2) == [(2, True), (2, True)]


def _launch_env_sizes() -> int:
    from ndparallel import Accelerator

    return Accelerator().parallelism_config.dp_shard_size


def test_without_a_config_the_launch_sizes_are_used():
    assert run_ranks(_launch_env_sizes, 2, env={"NDPARALLEL_DP_SHARD_SIZE": "2"}) == [2, 2]


def _optimizer_follows_the_sharded_parameters() -> bool:
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    return all(isinstance(p, DTensor) for p in params) and {id(p) for p in params} == {id(p) for p in model.parameters()}


def test_an_optimizer_built_before_prepare_is_remapped_to_the_sharded_parameters():
    assert run_ranks(_optimizer_follows_the_sharded_parameters, 2) == [True, True]


def _prepare_after_free_memory() -> tuple[str, int]:
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = DataLoader(list(range(4)), batch_size=2)
    accelerator.prepare(loader)
    try:
        accelerator.prepare(loader)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    taken = 0
    for _ in range(50):
        accelerator.free_memory()
        loader = DataLoader(list(range(4)), batch_size=2)
        accelerator.prepare(loader)
        taken += 1
    return refused, taken


@pytest.mark.slow
def test_an_object_is_refused_only_while_it_was_prepared_already():
    """prepare() refuses a plain object it took before; after free_memory, new objects (which CPython may place at a
    freed object's address, so with the same id) are taken again."""
    for refused, taken in run_ranks(_prepare_after_free_memory, 1):
        assert "argument 0 (a DataLoader) is already prepared" in refused
        assert taken == 50


def _one_rank_with_a_plugin(offload: bool) -> dict:
    from torch.distributed._composable import checkpoint
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, DistributedType, FullyShardedDataParallelPlugin, MemoryKwargs
    from tiny_models import build_model

    # The loss is compared bit for bit with the plain model's: its own loss, not the chunked one (which rounds
    # differently; tests/parallel/memory/test_chunked_loss.py).
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(
        activation_checkpointing=True, cpu_offload=offload), kwargs_handlers=[MemoryKwargs(chunked_loss=False)])
    torch.manual_seed(0)
    model = build_model("llama", num_hidden_layers=2)
    reference = build_model("llama", num_hidden_layers=2)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.arange(16).unsqueeze(0)
    if not offload:  # a step before prepare: harmless where prepare keeps the parameters (FSDP2 refuses it)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        reference.load_state_dict(model.state_dict())
        optimizer.zero_grad()
    model, optimizer = acc.prepare(model, optimizer)
    sharded = isinstance(next(model.parameters()), DTensor)  # (FSDP2's root keeps them gathered after a forward)
    loss = model(input_ids=ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(input_ids=ids, labels=ids).loss
    return {"fsdp": acc.distributed_type == DistributedType.FSDP,
            "dtensor": sharded,
            "checkpointed": [checkpoint.state(layer) is not None for layer in model.model.layers],
            "loss_dtype": str(loss.dtype), "loss": loss.item(), "expected": expected.item()}


def test_one_rank_with_an_fsdp_plugin_wraps_only_for_what_fsdp_does_there():
    """One process: nothing to shard or reduce, so a plugin's model is not wrapped in FSDP2 (its hooks and copies cost
    11% of a step on an H100, docs/gpu.md) -- its activation checkpointing and bf16 autocast still apply, and the
    loss is the plain model's under autocast. CPU offload is something FSDP2 does on one rank: then it wraps."""
    plain = run_ranks(_one_rank_with_a_plugin, 1, False)[0]
    assert not plain["fsdp"] and not plain["dtensor"] and plain["checkpointed"] == [True, True]
    assert plain["loss"] == plain["expected"], plain
    offloaded = run_ranks(_one_rank_with_a_plugin, 1, True)[0]
    assert offloaded["fsdp"] and offloaded["dtensor"] and offloaded["checkpointed"] == [True, True]
    assert abs(offloaded["loss"] - offloaded["expected"]) < 5e-2, offloaded  # FSDP2 casts parameters, not ops


def _backward_outside_accumulate(inside: bool) -> list[str]:
    import warnings

    from ndparallel import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(torch.nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = model(torch.ones(2, 4)).sum()
            if inside:
                with acc.accumulate(model):
                    acc.backward(loss)
            else:
                acc.backward(loss)
    return [str(w.message) for w in caught if "accumulate" in str(w.message)]


def test_backward_outside_accumulate_with_accumulation_steps_warns_once():
    """With gradient_accumulation_steps > 1, a loop that never enters accumulate() steps on every micro-batch (as in
    Accelerate): said once, not silently, and not at all inside accumulate()."""
    outside = run_ranks(_backward_outside_accumulate, 1, False)[0]
    assert len(outside) == 1 and "gradient_accumulation_steps=2, but backward() runs outside" in outside[0]
    assert run_ranks(_backward_outside_accumulate, 1, True)[0] == []


def _after_reset() -> dict:
    from ndparallel.state import PartialState

    state = PartialState()
    out = {"before": state.num_processes}
    try:
        state.no_such_thing
    except AttributeError as exc:
        out["unknown"] = str(exc)
    PartialState._reset_state()
    try:
        state.num_processes
    except AttributeError as exc:
        out["reset"] = str(exc)
    state.mine = "kept"  # a script's own attribute on the reset state
    again = PartialState()
    out.update(again=again.num_processes, mine=again.mine, initialized=again.initialized)
    return out


def test_a_reset_state_says_so_and_the_next_one_starts_anew():
    """After `PartialState._reset_state()` an old state object names the reset (Accelerate's message) for what it
    had, an unknown name gets Python's own message, and the next `PartialState()` starts anew even when a script
    set an attribute on the reset state meanwhile (it used to find that attribute and skip starting)."""
    out = run_ranks(_after_reset, 1)[0]
    assert out["before"] == 1 and out["again"] == 1 and out["mine"] == "kept" and out["initialized"]
    assert out["unknown"] == "'PartialState' object has no attribute 'no_such_thing'"
    assert out["reset"].startswith("`PartialState` object has no attribute `num_processes`. This happens if "
                                   "`PartialState._reset_state()` was called")
