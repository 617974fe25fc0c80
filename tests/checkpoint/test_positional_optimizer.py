"""Optimizers of no single prepared model (`ndparallel.checkpoint.positional`): saved by position, each rank its own,
as Accelerate saves them, and loaded only under the layout they were saved under.

Accelerate's own tests prepare a model together with an optimizer built for *another* model and expect ``save_state``
/ ``load_state`` to work. Each rank of a 2-rank FSDP2 run (``dp_shard_size=2``) here trains two optimizers that no
single prepared model owns -- one over a model that was never prepared (plain tensors, different on each rank: its
gradients are not reduced), one over the sharded parameters of two prepared models (DTensors) -- saves in the
background, trains two more steps, loads and trains the same two steps again: the prepared models' parameters and the
sharded optimizer's states equal the uninterrupted run's exactly (the same rank, the same reductions), and the other
optimizer's state after the load is, on each rank, the one it had at the save (the never-prepared model itself is no
part of the checkpoint, as in Accelerate). The checkpoint is then refused, before anything is loaded, in a world of
one process and under another ``ParallelismConfig`` of two; and an optimizer saved under a model's parameter names is
refused when it no longer updates that model.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank

from harness import run_ranks


def _models() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)


def _step(acc, prepared_a, prepared_c, loose, optimizers, rank: int, step: int) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = prepared_c(prepared_a(x)).square().mean() + loose(x).square().mean()
    acc.backward(loss)
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _snapshot(*objects) -> list[torch.Tensor]:
    """Every parameter and optimizer state tensor, as this rank holds it (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    out = []
    for obj in objects:
        tensors = (list(obj.parameters()) if isinstance(obj, torch.nn.Module)
                   else [v for s in obj.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        out += [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]
    return out


def _train_save_resume(directory: str) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    a, c, loose = _models()  # `loose` is never prepared
    prepared_a, prepared_c = acc.prepare(a), acc.prepare(c)
    across = acc.prepare(torch.optim.AdamW(list(prepared_a.parameters()) + list(prepared_c.parameters()), lr=0.1))
    of_loose = acc.prepare(torch.optim.SGD(loose.parameters(), lr=0.1, momentum=0.9))
    optimizers = (across, of_loose)
    rank = acc.process_index
    for step in range(2):
        _step(acc, prepared_a, prepared_c, loose, optimizers, rank, step)
    acc.save_state(directory, async_save=True)  # written while the next steps run: the states are copied first
    at_save = _snapshot(of_loose)
    for step in range(2, 4):
        _step(acc, prepared_a, prepared_c, loose, optimizers, rank, step)
    uninterrupted = _snapshot(prepared_a, prepared_c, across)
    acc.load_state(directory)
    loaded = _snapshot(of_loose)
    for step in range(2, 4):
        _step(acc, prepared_a, prepared_c, loose, optimizers, rank, step)
    resumed = _snapshot(prepared_a, prepared_c, across)
    return {"resumed": [torch.equal(x, y) for x, y in zip(uninterrupted, resumed)], "count": len(resumed),
            "loaded": [torch.equal(x, y) for x, y in zip(at_save, loaded)], "momentum": at_save}


def _load_elsewhere(directory: str, config: dict) -> str:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**config))
    a, c, loose = _models()
    prepared_a, prepared_c = acc.prepare(a), acc.prepare(c)
    acc.prepare(torch.optim.AdamW(list(prepared_a.parameters()) + list(prepared_c.parameters()), lr=0.1))
    acc.prepare(torch.optim.SGD(loose.parameters(), lr=0.1, momentum=0.9))
    before = [p.detach().clone() for p in loose.parameters()]
    try:
        acc.load_state(directory)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}" + ("" if all(torch.equal(x, y) for x, y in zip(
            before, loose.parameters())) else " [the run was touched]")
    return "loaded"


def _named_then_loose(directory: str) -> str:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint import CheckpointError

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=1))
    a, _, loose = _models()
    model, optimizer = acc.prepare(a, torch.optim.AdamW(a.parameters(), lr=0.1))
    acc.save_state(directory)  # optimizer 0 under model 0's parameter names
    acc2 = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=1))
    acc2.prepare(_models()[0], torch.optim.AdamW(loose.parameters(), lr=0.1))
    try:
        acc2.load_state(directory)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_optimizer_of_no_prepared_model_resumes_exactly_under_its_layout_and_is_refused_under_another(tmp_path):
    directory = str(tmp_path / "ckpt")
    out = run_ranks(_train_save_resume, 2, directory)
    for rank in out:
        # a, c: weight and bias each, their local shards; AdamW: step, exp_avg, exp_avg_sq of each of the 4
        assert rank["count"] == 4 + 12 and all(rank["resumed"]), rank["resumed"]
        # the never-prepared model is not in the checkpoint (nor in Accelerate's): its optimizer's state is
        assert len(rank["loaded"]) == 2 and all(rank["loaded"]), rank["loaded"]
    # each rank trained its own copy of the loose model: a state saved by rank 0 alone would be wrong for rank 1
    assert not torch.equal(out[0]["momentum"][0], out[1]["momentum"][0])

    positional = r"optimizer\(s\) \[0, 1\] update parameters of no single prepared model, so their state was saved"
    one = run_ranks(_load_elsewhere, 1, directory, {"dp_shard_size": 1})[0]
    assert one.startswith("CheckpointError") and "[the run was touched]" not in one, one
    assert re.search(positional + r".*under 2 process\(es\).*this run is under 1 process", one), one
    other = run_ranks(_load_elsewhere, 2, directory, {"dp_replicate_size": 2})
    assert other[0] == other[1] and other[0].startswith("CheckpointError"), other
    assert "this run is under 2 process(es), ParallelismConfig(dp_replicate_size=2, dp_shard_size=1)" in other[0]
    assert "[the run was touched]" not in other[0], other[0]


def test_optimizer_saved_by_name_is_refused_when_it_no_longer_updates_its_model(tmp_path):
    message = run_ranks(_named_then_loose, 1, str(tmp_path / "ckpt"))[0]
    assert "optimizer 0 was saved with the parameter names of model 0 (Linear), but this optimizer updates " \
           "parameters of no single prepared model" in message, message
