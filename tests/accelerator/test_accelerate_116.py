"""What Accelerate 1.16 changed in its public surface, inside the project: `ParallelismConfig.to_json` returns a
dict, `accelerate.utils`' new accelerator-backend helpers (`get_torch_accelerator_backend`,
`get_distributed_backend`, `normalize_device`, `get_accelerator_free_memory`), and the remapping of an optimizer
built before its model's parameters were replaced (`Accelerator.parameters_by_name` /
`remap_optimizer_parameters`, Accelerate's private `_get_named_parameters` / `_remap_optimizer_parameters`, which
its ``tests/test_accelerator.py::test_remap_optimizer_parameters`` calls). The FSDP2 policy a name gives (no
``output_dtype`` since 1.16) is checked in ``tests/core/test_config.py``."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

from harness import run_ranks
from ndparallel.distributed import devices
from ndparallel.parallelism_config import ParallelismConfig
from ndparallel.utils import (
    get_accelerator_free_memory,
    get_distributed_backend,
    get_torch_accelerator_backend,
    normalize_device,
)


# ---- ParallelismConfig.to_json ----------------------------------------------------------------------------------
def test_to_json_is_a_dict_that_json_takes_and_from_dict_rebuilds():
    pc = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    out = pc.to_json()
    assert isinstance(out, dict)
    assert (out["dp_shard_size"], out["cp_size"], out["tp_size"], out["dp_replicate_size"]) == (2, 2, 2, 1)
    assert (out["cp_backend"], out["sp_backend"]) == ("torch", "ndparallel")
    assert out["cp_handler"]["cp_comm_strategy"] == pc.cp_handler.cp_comm_strategy == "allgather"
    back = ParallelismConfig.from_dict(json.loads(json.dumps(out)))
    assert back.to_json() == out
    assert pc.to_json() is not pc.to_json()  # a fresh dict each call: changing it changes no config
    out["tp_size"] = 4
    assert pc.tp_size == 2


# ---- accelerate.utils' accelerator-backend helpers (Accelerate 1.16) ----------------------------------------------
def _machine(monkeypatch, device_type: str | None, available: bool = True) -> None:
    """Make torch report `device_type` as its accelerator (None: a CPU-only build), available or not."""
    device = None if device_type is None else types.SimpleNamespace(type=device_type)  # what is read of it
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: device)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    for name in devices._LATE_PLUGINS:  # no HPU / Neuron plug-in on the machine, but the accelerator's own
        if name == device_type:
            monkeypatch.setattr(torch, name, types.SimpleNamespace(is_available=lambda: available), raising=False)
        else:
            monkeypatch.delattr(torch, name, raising=False)


def test_the_accelerator_backend_is_the_one_torch_reports(monkeypatch):
    _machine(monkeypatch, None)
    assert get_torch_accelerator_backend() == (None, None)
    assert get_torch_accelerator_backend(check_available=False) == (None, None)
    _machine(monkeypatch, "cuda")
    assert get_torch_accelerator_backend() == ("cuda", torch.cuda)
    _machine(monkeypatch, "cuda", available=False)  # a CUDA build on a machine without a GPU
    assert get_torch_accelerator_backend() == (None, None)
    assert get_torch_accelerator_backend(check_available=False) == ("cuda", torch.cuda)
    _machine(monkeypatch, "tpu")  # a backend without a module of its own answers through torch.accelerator
    assert get_torch_accelerator_backend() == ("tpu", torch.accelerator)


def test_a_late_plugin_is_found_by_name(monkeypatch):
    _machine(monkeypatch, None)
    hpu = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(torch, "hpu", hpu, raising=False)
    assert get_torch_accelerator_backend() == ("hpu", hpu)


@pytest.mark.parametrize("device_type", [None, "cuda", "tpu"])
@pytest.mark.parametrize("available", [True, False])
def test_the_accelerator_backend_agrees_with_accelerate(monkeypatch, device_type, available):
    accelerate_utils = pytest.importorskip("accelerate.utils")
    if not hasattr(accelerate_utils, "get_torch_accelerator_backend"):
        pytest.skip("Accelerate < 1.16 has no get_torch_accelerator_backend")
    _machine(monkeypatch, device_type, available)
    for check in (True, False):
        assert get_torch_accelerator_backend(check) == accelerate_utils.get_torch_accelerator_backend(check)


def test_the_distributed_backend_of_each_device(monkeypatch):
    assert [get_distributed_backend(t) for t in ("cuda", "npu", "hpu", "mlu", "cpu", "mps", None)] == \
        ["nccl", "hccl", "hccl", "cncl", None, None, None]
    monkeypatch.setattr(torch.distributed.distributed_c10d, "is_xccl_available", lambda: False)
    assert get_distributed_backend("xpu") is None
    monkeypatch.setattr(torch.distributed.distributed_c10d, "is_xccl_available", lambda: True)
    assert get_distributed_backend("xpu") == "xccl"


def test_normalize_device(monkeypatch):
    assert normalize_device("npu") == "npu:0"
    for device_type, expected in ((None, 1), ("cuda", 1), ("xpu", "xpu:1"), ("hpu", "hpu")):
        _machine(monkeypatch, device_type, available=False)  # asks for no device: the same when none is there
        assert normalize_device(1) == expected, device_type
        assert normalize_device("cuda:0") == "cuda:0"
        assert normalize_device(torch.device("cpu")) == torch.device("cpu")


def test_free_memory_through_the_module_given(monkeypatch):
    asked = []
    module = types.SimpleNamespace(mem_get_info=lambda i: (asked.append(i) or 1000 + i, 5000))
    assert get_accelerator_free_memory(module, 3) == 1003 and asked == [3]
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda i: (7 * i, 100), raising=False)
    assert get_accelerator_free_memory(torch.accelerator, 2) == 14


# ---- remapping an optimizer built before its model's parameters were replaced ----------------------------------
def _remap(dynamo_backend: str) -> dict:
    from ndparallel import Accelerator

    acc = Accelerator(mixed_precision="no", dynamo_backend=dynamo_backend)
    out = {"aliases": (Accelerator._get_named_parameters is Accelerator.parameters_by_name,
                       Accelerator._remap_optimizer_parameters is Accelerator.remap_optimizer_parameters)}
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # never prepared: prepare cannot remap it
    old = model.weight
    names = acc.parameters_by_name(model)
    out["names"] = list(names)
    out["drop_refs"] = acc.parameters_by_name(model, drop_refs=True) == {"weight": old.data_ptr()}
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # device placement makes new parameters
    try:
        model = acc.prepare_model(model)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    out["replaced"] = model.weight is not old
    out["stale_before"] = optimizer.param_groups[0]["params"][0] is old
    out["count"] = acc.remap_optimizer_parameters(names, model, optimizer)
    out["points_at_model"] = optimizer.param_groups[0]["params"][0] is model.weight
    out["count_again"] = acc.remap_optimizer_parameters(names, model, optimizer)
    before = model.weight.detach().clone()
    acc.backward(model(torch.ones(2, 2)).sum())
    optimizer.step()
    out["stepped"] = torch.equal(model.weight.detach(), before - 0.2)
    acc.end_training()
    return out


@pytest.mark.parametrize("dynamo_backend", ["no", "eager"])
def test_an_optimizer_prepare_did_not_see_follows_replaced_parameters(dynamo_backend):
    (out,) = run_ranks(_remap, 1, dynamo_backend)
    assert out == {"aliases": (True, True), "names": ["weight"], "drop_refs": True, "replaced": True,
                   "stale_before": True, "count": 1, "points_at_model": True, "count_again": 0, "stepped": True}


def _state_and_names() -> dict:
    from ndparallel import Accelerator

    acc = Accelerator()
    first, second = nn.Linear(2, 2), nn.Linear(2, 1, bias=False)
    out = {"names": list(acc.parameters_by_name(first, "not a model", second))}
    optimizer = torch.optim.Adam(list(first.parameters()) + list(second.parameters()), lr=0.1)
    first(torch.ones(1, 2)).sum().backward()
    second(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # state for every parameter
    names = acc.parameters_by_name(first, second)
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in names.items()}
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        first, second = first.to("cpu"), second.to("cpu")  # new parameter objects, same values and shapes
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    out["count"] = acc.remap_optimizer_parameters(names, first, second, optimizer)
    now = acc.parameters_by_name(first, second)
    out["state_moved"] = all(
        set(optimizer.state[p]) == set(state[name]) and all(torch.equal(optimizer.state[p][k], v)
                                                            for k, v in state[name].items())
        for name, p in now.items())
    out["old_state_gone"] = all(p not in optimizer.state for p in names.values())
    try:
        acc.remap_optimizer_parameters(names, second, optimizer)  # not the models the names were taken from
        out["wrong_models"] = "accepted"
    except ValueError as exc:
        out["wrong_models"] = str(exc)
    try:
        acc.remap_optimizer_parameters(acc.parameters_by_name(first, drop_refs=True), first, optimizer)
        out["keys"] = "accepted"
    except TypeError as exc:
        out["keys"] = str(exc)
    acc.end_training()
    return out


def test_remapping_moves_the_state_and_names_models_by_position():
    (out,) = run_ranks(_state_and_names, 1)
    assert out["names"] == ["0.weight", "0.bias", "1.weight"]
    assert (out["count"], out["state_moved"], out["old_state_gone"]) == (3, True, True)
    assert out["wrong_models"].startswith("remap_optimizer_parameters: the models given have no parameter named "
                                          "['0.weight', '0.bias', '1.weight'] (they have ['weight'] ...)")
    assert "maps to a int, not a parameter" in out["keys"]


def _sharded_after_a_step() -> str:
    from ndparallel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    names = acc.parameters_by_name(model)
    model = acc.prepare_model(model)  # FSDP2: DTensor shards replace the parameters
    try:
        acc.remap_optimizer_parameters(names, model, optimizer)
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    acc.end_training()
    return message


def test_state_that_does_not_fit_a_sharded_parameter_is_refused():
    for message in run_ranks(_sharded_after_a_step, 2):
        assert "does not fit the parameter that replaced it (DTensor of shape (4, 4))" in message
        assert "build the optimizer, prepare it with its model, then train" in message


# ---- clip_grad_norm_(norm_type=0): Accelerate 1.16 gives torch's meaning over sharded gradients ------------------
def _grads() -> list[torch.Tensor]:
    return [torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.zeros(2, 2), torch.tensor([[0.0, 0.0], [0.0, 3.0]]),
            torch.zeros(3)]


def test_the_zero_norm_counts_nonzero_gradients_as_torch_does():
    from ndparallel.training.clip import clip_grad_norm_

    ours, theirs = ([nn.Parameter(torch.ones_like(g)) for g in _grads()] for _ in range(2))
    for params in (ours, theirs):
        for p, g in zip(params, _grads()):
            p.grad = g
    norm = clip_grad_norm_(ours, 0.5, norm_type=0)
    assert norm.item() == torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=0).item() == 2.0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))  # scaled by 0.5 / 2 alike


def _zero_norm_sharded() -> tuple[float, list[float]]:
    from torch.distributed.tensor import distribute_tensor, Shard

    from ndparallel import Accelerator

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    mesh = acc.mesh["fsdp"]
    params = []
    for g in _grads()[:3]:  # row 0 on rank 0, row 1 on rank 1: the third gradient's nonzero is on rank 1 only
        p = nn.Parameter(distribute_tensor(torch.ones_like(g), mesh, [Shard(0)]))
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
        params.append(p)
    norm = acc.clip_grad_norm_(params, 0.5, norm_type=0)
    full = [p.grad.full_tensor().sum().item() for p in params]
    acc.end_training()
    return norm.item(), full


def test_the_zero_norm_adds_up_the_shards_before_counting():
    for norm, grad_sums in run_ranks(_zero_norm_sharded, 2):
        assert norm == 2.0  # torch on the full gradients says 2, not 3 (each shard counted) or 1 (rank 0's view)
        assert grad_sums == pytest.approx([3 * 0.25, 0.0, 3 * 0.25])
