"""Issue 40, on 2 forked gloo ranks: Accelerate's data-loading names as Accelerate's own tests reach them.

- Prepared loaders are instances of `ndparallel.data_loader.DataLoaderShard` (``dispatch_batches=True``:
  `DataLoaderDispatcher`), torch ``DataLoader`` subclasses (torchdata ``StatefulDataLoader`` ones with
  ``use_stateful_dataloader=True``), unpickle as the same class, and yield the same batches whatever their class.
- `prepare_data_loader` (without an Accelerator) shards as `prepare` does; with ``use_seedable_sampler=True`` its
  sampler is a `SeedableRandomSampler`, and ranks seeded differently still draw rank 0's order -- also from a
  `SeedableRandomSampler` each rank made itself from its own seed: each step's gathered batch is the single-process
  loader's next global batch, every epoch.
- `synchronize_rng_states` gives every rank rank 0's generator states.
- Debug mode (``state.debug = True``): a reduce, broadcast or gather of other shapes, or a pad of tensors of another
  number of dimensions, raises the same `DistributedOperationException` on every rank instead of running.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _loader_classes() -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ndparallel import Accelerator
    from ndparallel.data_loader import DataLoaderDispatcher, DataLoaderShard
    from ndparallel.utils import DataLoaderConfiguration

    out: dict = {"batches": {}}
    for dispatch in (False, True):
        for stateful in (False, True):
            acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch,
                                                                         use_stateful_dataloader=stateful))
            loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True,
                                            generator=torch.Generator().manual_seed(3)))
            again = pickle.loads(pickle.dumps(loader))
            key = f"dispatch={dispatch},stateful={stateful}"
            out[key] = (isinstance(loader, DataLoaderDispatcher if dispatch else DataLoaderShard),
                        isinstance(loader, DataLoaderShard if dispatch else DataLoaderDispatcher),
                        isinstance(loader, DataLoader), isinstance(loader, StatefulDataLoader) == stateful,
                        type(again) is type(loader))
            batches = [b[0].tolist() for b in loader]
            out["batches"][key] = batches
            out[key + ",unpickled"] = [b[0].tolist() for b in again] == batches
    return out


def test_prepared_loaders_are_accelerates_classes_and_torch_loaders_with_unchanged_batches():
    out = run_ranks(_loader_classes, 2)
    for rank in out:
        for key, found in rank.items():
            if key.endswith(",unpickled"):
                assert found is True, key  # the unpickled loader yields the same batches
            elif key != "batches":  # its class, not the other; a torch (stateful) DataLoader; unpickled as itself
                assert found == (True, False, True, True, True), (key, found)
        assert len({str(b) for b in rank["batches"].values()}) == 1, rank["batches"]  # the class changes no batch
    shares = [sorted(i for b in r["batches"]["dispatch=True,stateful=False"] for i in b) for r in out]
    assert sorted(shares[0] + shares[1]) == list(range(12))  # each rank its own share of one order


def _prepare_data_loader_alone() -> dict:
    from ndparallel import PartialState
    from ndparallel.data_loader import SeedableRandomSampler, prepare_data_loader
    from ndparallel.utils import set_seed, synchronize_rng_states

    rank = PartialState().process_index
    set_seed(100 + rank)  # ranks seeded differently: the loader must still draw one order, rank 0's
    dataset = list(range(16))
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2, shuffle=True), put_on_device=True,
                                 use_seedable_sampler=True)
    sampler = loader.batch_sampler.batch_sampler.sampler
    out = {"seedable": isinstance(sampler, SeedableRandomSampler), "steps": [], "class": type(loader).__name__}
    for _ in range(2):  # two epochs: each step's global batch, gathered in rank order
        out["steps"].append([torch.cat(_gathered(b)).tolist() for b in loader])
    # the script's own sampler, made on each rank from its own torch seed (100 + rank): still rank 0's order
    own = prepare_data_loader(DataLoader(dataset, batch_size=2, sampler=SeedableRandomSampler(dataset)),
                              put_on_device=True)
    out["own_sampler_steps"] = [[torch.cat(_gathered(b)).tolist() for b in own] for _ in range(2)]
    # the single-process order of the same sampler seed (rank 0's initial seed), in global batches of 2 x 2
    reference = SeedableRandomSampler(dataset, data_seed=100)
    out["reference"] = [list(reference) for _ in range(2)]
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(rank)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    states = [_gathered(torch.get_rng_state()), _gathered(generator.get_state())]
    out["rng_same"] = tuple(all(torch.equal(s, both[0]) for s in both) for both in states)
    return out


def test_prepare_data_loader_with_a_seedable_sampler_draws_rank_0s_order_as_one_process_would():
    out = run_ranks(_prepare_data_loader_alone, 2)
    for rank in out:
        assert rank["seedable"] and rank["class"] == "DataLoaderShard"
        assert rank["rng_same"] == (True, True)
        for epoch in range(2):
            for steps in (rank["steps"][epoch], rank["own_sampler_steps"][epoch]):
                assert [i for step in steps for i in step] == rank["reference"][epoch], (epoch, steps)
        assert rank["reference"][0] != rank["reference"][1]  # each epoch reshuffles
    assert out[0]["steps"] == out[1]["steps"]


def _debug_mode() -> dict:
    from ndparallel import PartialState
    from ndparallel.utils import DistributedOperationException, broadcast, gather, pad_across_processes, reduce

    state = PartialState()
    rank = state.process_index
    out = {"default": state.debug}
    state.debug = True
    same = torch.ones(2, 3)
    other = torch.ones(2, 3) if rank == 0 else torch.ones(3, 2)
    out["same"] = (reduce(same, "sum").tolist(), broadcast(same.clone()).tolist(), gather(same).shape[0])
    for name, call in (("reduce", lambda: reduce(other)), ("broadcast", lambda: broadcast(other)),
                       ("gather", lambda: gather(other)),
                       ("pad", lambda: pad_across_processes(torch.ones(2, 3) if rank == 0 else torch.ones(1, 2, 3)))):
        try:
            call()
            out[name] = "ran"
        except DistributedOperationException as exc:
            out[name] = str(exc)
    out["pad_uneven"] = pad_across_processes(torch.ones(2 + rank, 3)).shape[0]  # a pad's own job: allowed
    state.debug = False
    return out


def test_debug_mode_refuses_collectives_of_other_shapes_on_every_rank():
    out = run_ranks(_debug_mode, 2, env={"ACCELERATE_DEBUG_MODE": "0"})
    assert out[0] == out[1]
    rank = out[0]
    assert rank["default"] is False
    assert rank["same"] == ([[2.0] * 3] * 2, [[1.0] * 3] * 2, 4) and rank["pad_uneven"] == 3
    for name in ("reduce", "broadcast", "gather"):
        assert rank[name].startswith(f"cannot run {name}: the processes passed tensors of other shapes"), rank[name]
        assert "process 0: (2, 3)" in rank[name] and "process 1: (3, 2)" in rank[name]
    assert rank["pad"].startswith("cannot run pad_across_processes: the processes passed tensors of other numbers "
                                  "of dimensions") and "process 1: 3" in rank["pad"]


def _debug_from_environment() -> bool:
    from ndparallel import PartialState

    return PartialState().debug


@pytest.mark.parametrize("variable", ["ACCELERATE_DEBUG_MODE", "NDPARALLEL_DEBUG_MODE"])
def test_debug_mode_starts_from_the_environment(variable):
    assert run_ranks(_debug_from_environment, 1, env={variable: "1"}) == [True]
