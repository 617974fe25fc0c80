"""Accelerate's `prepare` surface and save/load-state hooks, as its ``tests/test_accelerator.py`` uses them:
objects `prepare` does not change come back as they are (``None`` for "no scheduler"), prepared objects carry
``_is_accelerate_prepared`` and are listed in ``_models`` / ``_optimizers`` / ``_schedulers`` / ``_dataloaders``,
`prepare_model` twice neither wraps twice nor lists twice, `unwrap_model` sees through ``torch.compile`` and
``DataParallel``, and ``register_save_state_pre_hook`` /
``register_load_state_pre_hook`` run on every rank with files committed inside the checkpoint."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks


def _components():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
    return model, optimizer, scheduler, loader


def _prepare_surface() -> dict:
    from ndparallel import Accelerator

    acc = Accelerator()
    objects = _components()
    marker = [1, 2, 3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        *prepared, none, same = acc.prepare(*objects, None, marker)
    out = {
        "passed_through": (none is None, same is marker, getattr(marker, "_is_accelerate_prepared", False)),
        "warned": [str(w.message) for w in caught if "prepare()" in str(w.message)],
        "marked": [getattr(p, "_is_accelerate_prepared", False) for p in prepared],
        "listed": [prepared[0] in acc._models, prepared[1] in acc._optimizers, prepared[2] in acc._schedulers,
                   prepared[3] in acc._dataloaders],
    }
    again = acc.prepare_model(prepared[0])
    out["prepare_model_twice"] = (again is prepared[0], len(acc._models))
    linear = acc.prepare_model(nn.Linear(2, 2))
    out["plain_twice"] = (acc.prepare_model(linear) is linear, len(acc._models))
    plain = nn.Linear(2, 2)
    out["unwrap_compiled"] = (acc.unwrap_model(torch.compile(nn.DataParallel(plain)), keep_torch_compile=False) is plain,
                              acc.unwrap_model(torch.compile(nn.DataParallel(plain)))._orig_mod is plain)
    acc.free_memory()
    out["freed"] = [len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
    acc.end_training()
    return out


def test_prepare_returns_what_it_does_not_change_and_marks_what_it_prepares():
    out = run_ranks(_prepare_surface, 1)[0]
    assert out["passed_through"] == (True, True, False)
    # None is how scripts say "no scheduler": silent; a list may be a mistake: one warning naming it
    assert len(out["warned"]) == 1 and "argument 5 is a builtins.list" in out["warned"][0], out["warned"]
    assert out["marked"] == [True] * 4
    assert out["listed"] == [True] * 4
    assert out["prepare_model_twice"] == (True, 1)
    assert out["plain_twice"] == (True, 2)
    assert out["freed"] == [0, 0, 0, 0]
    assert out["unwrap_compiled"] == (True, True)  # DataParallel inside torch.compile, compiled wrapper kept or not


def _hooks(directory: str, fail_on: int | None) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint import CheckpointError

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    torch.manual_seed(0)
    model, optimizer, scheduler, loader = acc.prepare(*_components())
    calls: list = []

    def save_config(models, weights, output_dir):
        calls.append(("save", len(models), list(weights), Path(output_dir).name))
        if fail_on == acc.process_index:
            raise RuntimeError("disk says no")
        if acc.is_main_process:
            (Path(output_dir) / "extra.json").write_text(json.dumps({"class_name": type(models[0]).__name__}))

    def load_config(models, input_dir):
        calls.append(("load", len(models), json.loads((Path(input_dir) / "extra.json").read_text())))

    save_handle = acc.register_save_state_pre_hook(save_config)
    load_handle = acc.register_load_state_pre_hook(load_config)
    out: dict = {}
    target = os.path.join(directory, "ckpt")
    try:
        acc.save_state(target)
        out["saved"] = sorted(os.listdir(target))
        acc.load_state(target)
    except CheckpointError as exc:
        out["error"] = str(exc)
        out["left"] = sorted(os.listdir(directory))
    save_handle.remove()
    load_handle.remove()
    out["calls"] = calls
    if fail_on is None:  # removed hooks are not called again
        acc.save_state(os.path.join(directory, "ckpt2"))
        acc.load_state(os.path.join(directory, "ckpt2"))
        out["calls_after_remove"] = len(calls)
    acc.end_training()
    return out


def test_state_hooks_run_on_every_rank_and_their_files_are_committed(tmp_path):
    results = run_ranks(_hooks, 2, str(tmp_path), None)
    for rank, out in enumerate(results):
        assert "extra.json" in out["saved"], out["saved"]
        save, load = out["calls"]
        # models as prepared, weights empty (every model is saved by save_state, as Accelerate under FSDP),
        # output_dir the staging directory that becomes the checkpoint
        assert save[:3] == ("save", 1, []) and save[3] != "ckpt", save
        assert load == ("load", 1, {"class_name": "FSDPSequential"}), load
        assert out["calls_after_remove"] == 2


def test_a_hook_raising_on_one_rank_raises_on_every_rank_and_commits_nothing(tmp_path):
    results = run_ranks(_hooks, 2, str(tmp_path), 1)
    for out in results:
        assert "a save_state pre-hook raised on rank 1: RuntimeError: disk says no" in out["error"], out
        assert out["left"] == [], out["left"]  # no checkpoint, no staging directory


if __name__ == "__main__":
    pytest.main([__file__, "-v"])
