"""`checkpoint.state_dicts.sharded_state_dicts`: the dicts torch's `get_state_dict` makes, without asking it again once
its names have been checked -- and torch's own wherever its own way does not reproduce them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from ndparallel.checkpoint import state_dicts


def _flat(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) pairs in order, a tensor as (shape, dtype, address of its -- local -- data)."""
    if isinstance(state, dict):
        return [item for k, v in state.items() for item in _flat(v, f"{prefix}/{k}")]
    if isinstance(state, (list, tuple)):
        return [item for i, v in enumerate(state) for item in _flat(v, f"{prefix}/{i}")]
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return [(prefix, (tuple(state.shape), state.dtype, local.data_ptr(), type(state).__name__))]
    return [(prefix, state)]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return get_state_dict(*args, **kwargs)

    monkeypatch.setattr(state_dicts, "get_state_dict", counted)
    return calls


def _stepped(model: nn.Module, **groups: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **groups)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_after_the_first_call_the_same_dicts_come_without_torch(monkeypatch):
    """Wrapped submodules (compiled: ``_orig_mod``; activation checkpointing: ``_checkpoint_wrapped_module``) whose
    names torch shortens: every call gives torch's keys, order, tensors and values; torch is asked only the first
    time."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.compile(nn.Linear(4, 4)), checkpoint_wrapper(nn.Linear(4, 4)), nn.Linear(4, 2))
    model.register_buffer("scale", torch.ones(2))
    model.forward = lambda x: model[2](model[1](model[0]._orig_mod(x))) * model.scale  # no compilation needed here
    optimizer = _stepped(model)
    calls = _counting(monkeypatch)
    expected = _flat(get_state_dict(model, optimizer, options=StateDictOptions()))
    assert any("_orig_mod" in k for k in model.state_dict()) and not any("_orig_mod" in p for p, _ in expected)
    for _ in range(3):
        assert _flat(state_dicts.sharded_state_dicts(model, optimizer)) == expected
    assert len(calls) == 1
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5})  # no name: torch refuses too
    with pytest.raises(Exception) as theirs:
        get_state_dict(model, optimizer, options=StateDictOptions())
    with pytest.raises(type(theirs.value)):
        state_dicts.sharded_state_dicts(model, optimizer)


def test_a_model_whose_names_it_cannot_reproduce_is_left_to_torch(monkeypatch):
    """A submodule really called ``module`` (not a DDP wrapper): torch keeps the name, the shortening rule would drop
    it, the check sees the difference, and torch makes the dicts on every call."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(4, 2)

        def forward(self, x):
            return self.module(x)

    model = Outer()
    optimizer = _stepped(model)
    calls = _counting(monkeypatch)
    expected = _flat(get_state_dict(model, optimizer, options=StateDictOptions()))
    for _ in range(3):
        assert _flat(state_dicts.sharded_state_dicts(model, optimizer)) == expected
    assert len(calls) == 3  # torch asked on every call


def test_a_changed_model_or_optimizer_is_checked_again(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = _stepped(model)
    calls = _counting(monkeypatch)
    state_dicts.sharded_state_dicts(model, optimizer)
    state_dicts.sharded_state_dicts(model, optimizer)
    assert len(calls) == 1
    model[1] = nn.Linear(4, 2)  # new parameters: the optimizer's are no longer the model's
    optimizer = _stepped(model)
    got = state_dicts.sharded_state_dicts(model, optimizer)
    assert len(calls) == 2
    assert _flat(got) == _flat(get_state_dict(model, optimizer, options=StateDictOptions()))


def test_an_optimizer_without_state_is_left_to_torch(monkeypatch):
    """torch gives a fresh optimizer a state by stepping it (the caller deals with that): not reproduced here."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    calls = _counting(monkeypatch)
    state_dicts.sharded_state_dicts(model, optimizer)
    assert len(calls) == 1 and optimizer.state  # torch's call initialised it, as get_state_dict always does


def _fsdp2(_: None) -> list[bool]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = _stepped(model)
    same = []
    for _ in range(3):
        expected = _flat(get_state_dict(model, optimizer, options=StateDictOptions()))
        sharded = any(isinstance(v, tuple) and v[-1] == "DTensor" for _, v in expected)
        same.append(sharded and _flat(state_dicts.sharded_state_dicts(model, optimizer)) == expected)
        optimizer.step()
    return same


def test_under_fsdp2_the_dicts_hold_the_same_shards():
    for same in run_ranks(_fsdp2, 2, None):
        assert same == [True, True, True]
