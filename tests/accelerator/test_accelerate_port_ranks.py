"""Issue 25, on 2 forked gloo ranks: the behaviours Accelerate's torchrun scripts (test_sync.py,
test_distributed_data_loop.py) expect, in our own tests: gradient synchronisation with no_sync /
trigger_sync_in_backward and accumulation, the LR schedule, data loaders built on batch samplers, join_uneven_inputs'
even_batches override, an assignable distributed type, a picklable Accelerator, and checkpoints of a loader stopped
mid-epoch. Each rank function checks several things so that few processes are started.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset

from harness import run_ranks


def _all_equal(t: torch.Tensor) -> bool:
    """Whether every rank holds the same `t`."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


# ---- gradient synchronisation -----------------------------------------------------------------------------------
def _sync_and_accumulation() -> dict:
    from ndparallel import Accelerator
    from ndparallel.utils import GradientAccumulationPlugin

    out = {}
    acc = Accelerator()
    rank, world = acc.process_index, acc.num_processes
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    model = acc.prepare(copy.deepcopy(reference))
    inputs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    # Three forwards under no_sync, then their backwards: only the last, inside trigger_sync_in_backward, reduces.
    losses = []
    for x in inputs:
        with acc.no_sync(model):
            losses.append(model(x).pow(2).mean())
    in_sync = []
    for i, loss in enumerate(losses):
        if i < 2:
            acc.backward(loss)
        else:
            with acc.trigger_sync_in_backward(model):
                acc.backward(loss)
        in_sync.append(_all_equal(model.module.weight.grad))
    out["in_sync_after_each_backward"] = in_sync
    # What DDP must hold then: the mean over ranks of each rank's gradient summed over its three micro-batches.
    everyone = [[torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(3)]
                for r in range(world)]
    sum(reference(x).pow(2).mean() for xs in everyone for x in xs).div(world).backward()
    out["equals_reference"] = torch.allclose(model.module.weight.grad, reference.weight.grad, atol=1e-6)

    # Accumulation over 2 micro-steps of a loader whose last window is short: the loss of a model without token
    # counts is divided by the accumulation steps in every window, as Accelerate's backward divides it.
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    torch.manual_seed(0)
    reference = torch.nn.Linear(1, 1)
    model = acc.prepare(copy.deepcopy(reference))
    data = torch.arange(12, dtype=torch.float32).unsqueeze(-1)  # 3 batches of 2 per rank: windows of 2, then 1
    loader = acc.prepare(DataLoader(TensorDataset(data, 2 * data + 1), batch_size=2))
    syncs, matches = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
        everyone = [torch.empty_like(x) for _ in range(world)]
        targets = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(everyone, x)
        dist.all_gather(targets, y)
        (F.mse_loss(reference(torch.cat(everyone)), torch.cat(targets)) / 2).backward()
        syncs.append(acc.sync_gradients)
        if acc.sync_gradients:  # in step with one process on the gathered batches, loss / accumulation steps
            matches.append(torch.allclose(model.module.weight.grad, reference.weight.grad, atol=1e-5))
    out["syncs"], out["matches"] = syncs, matches
    acc.end_training()
    return out


def test_no_sync_forwards_then_trigger_sync_in_backward_and_a_short_last_window():
    for res in run_ranks(_sync_and_accumulation, 2):
        assert res["in_sync_after_each_backward"] == [False, False, True]
        assert res["equals_reference"]
        assert res["syncs"] == [False, True, True] and res["matches"] == [True, True]


def _schedules() -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    out = {}
    for name, kwargs in {"default": {}, "split": {"split_batches": True},
                         "tp": {"parallelism_config": ParallelismConfig(tp_size=2)}}.items():
        acc = Accelerator(gradient_accumulation_steps=2, **kwargs)
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        optimizer, scheduler = acc.prepare(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s))
        lrs = []
        for _ in range(4):  # two optimizer steps of two micro-steps
            with acc.accumulate():
                optimizer.step()
                scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
        out[name] = lrs
    acc.end_training()  # once: later Accelerators of a process share its process group, as in Accelerate
    return out


def test_the_schedule_moves_once_per_data_parallel_rank_and_optimizer_step():
    """Accelerate's: each of the D ranks with distinct samples took a loader batch (tensor-parallel peers share theirs:
    D = 1 under tp=2); with split_batches the loader's batch is the global one."""
    for res in run_ranks(_schedules, 2):
        assert res["default"] == [1.0, 0.25, 0.25, 0.0625]
        assert res["split"] == res["tp"] == [1.0, 0.5, 0.5, 0.25]


# ---- data loaders -----------------------------------------------------------------------------------------------
class Rows(torch.utils.data.Dataset):
    """Rows of a dict; a list of indices fetches a batch (as Accelerate's script's dataset does)."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, index):
        if isinstance(index, list):
            return [{"index": i} for i in index]
        return {"index": index}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


def _samplers() -> dict:
    from ndparallel import Accelerator

    acc = Accelerator()
    seen = {}
    torch.manual_seed(acc.process_index)  # ranks seeded differently: the shards must still not overlap
    loaders = {
        "batch_sampler": DataLoader(Rows(), batch_sampler=BatchSampler(RandomSampler(Rows()), 4, False),
                                    num_workers=2),
        "sampler_is_batch_sampler": DataLoader(Rows(), sampler=BatchSampler(RandomSampler(Rows()), 4, False),
                                               batch_size=None, collate_fn=torch.utils.data.default_collate),
    }
    for name, loader in loaders.items():
        prepared = acc.prepare(loader)
        indices = torch.cat([acc.gather_for_metrics(batch["index"]) for batch in prepared])
        seen[name] = sorted(indices.tolist())
    acc.end_training()
    return seen


def test_loaders_built_on_batch_samplers_give_every_sample_once():
    for res in run_ranks(_samplers, 2):
        assert res == {"batch_sampler": list(range(22)), "sampler_is_batch_sampler": list(range(22))}


def _joins() -> dict:
    from ndparallel import Accelerator
    from ndparallel.state import DistributedType

    out = {}
    acc = Accelerator()  # even batches by default
    model = acc.prepare(torch.nn.Linear(1, 1))
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(3.0)), batch_size=1))
    acc.prepare(DataLoader(Stream(), batch_size=1))  # an iterable one keeps its own setting
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = []
        with acc.join_uneven_inputs([model], even_batches=False):
            out["inside"] = (loader.batch_sampler.even_batches, loader.even_batches)
            for i, (x,) in enumerate(loader):
                model(x.unsqueeze(-1)).sum().backward()  # rank 1 runs out first: Join shadows its collectives
                steps.append(i)
    out["steps"], out["after"] = steps, loader.batch_sampler.even_batches
    out["warned"] = [str(w.message) for w in caught]
    acc.state.distributed_type = DistributedType.FSDP  # as Accelerate's script does, to check the warning
    out["type"] = acc.distributed_type.value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.join_uneven_inputs([model]):
            pass
    out["fsdp_warned"] = [str(w.message) for w in caught]
    try:
        acc.state.distributed_type = "MULTI_TPU"
    except ValueError as exc:
        out["bad_type"] = str(exc)
    acc.end_training()
    return out


def test_join_uneven_inputs_overrides_even_batches_and_warns_where_it_cannot():
    res = run_ranks(_joins, 2)
    assert [r["steps"] for r in res] == [[0, 1], [0]]
    for r in res:
        assert r["inside"] == (False, False) and r["after"] is True
        assert ("Overriding even_batches is only supported for map-style datasets, yet some dataloaders given were "
                "iterable") in r["warned"]
        assert r["type"] == "FSDP"
        assert len(r["fsdp_warned"]) == 1 and "only supported for multi-GPU (and multi-CPU) DDP training, not FSDP" \
            in r["fsdp_warned"][0]
        assert r["bad_type"].startswith("distributed_type must be one of ['NO', 'MULTI_CPU'") and "'MULTI_TPU'" in \
            r["bad_type"]


def _pickle_and_checkpoints(tmp: str) -> dict:
    from ndparallel import Accelerator
    from ndparallel.utils import DataLoaderConfiguration

    out = {}
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    # worker processes: the saved position must reach a pass whose batch sampler torch iterates twice
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(32)), batch_size=2, shuffle=True, num_workers=2))
    copy_ = pickle.loads(pickle.dumps(acc))
    out["state_equal"] = copy_.state.__dict__ == acc.state.__dict__
    from ndparallel.state import AcceleratorState, GradientState

    # Accelerate's singletons, called with no arguments: this Accelerator's (an unpickled copy has its own objects)
    out["singletons"] = (AcceleratorState() is acc.state, GradientState() is acc.gradient_state,
                         copy_.state is not acc.state, copy_.gradient_state is not acc.gradient_state)
    out["max"] = acc.reduce(torch.tensor([float(acc.process_index), -float(acc.process_index)]), "max").tolist()
    out["same_group"] = copy_.prepared.dataloaders[0].window_group is loader.window_group is not None
    # save mid-epoch into one directory, read on: load_state comes back to the batches after the save
    rest, resumed = [], []
    for step, (x,) in enumerate(loader):
        if step == 2:
            acc.save_state(f"{tmp}/ckpt")
        elif step > 2:
            rest.append(x.tolist())
    acc.load_state(f"{tmp}/ckpt")
    resumed = [x.tolist() for (x,) in loader]
    out["resumed"] = resumed == rest and len(rest) == 5
    try:  # a directory made on each rank: refused on every rank, before anything is written
        acc.save_state(f"{tmp}/rank{acc.process_index}")
    except ValueError as exc:
        out["different_dirs"] = str(exc)
    out["iterable_dispatch"] = None
    acc.dataloader_config = DataLoaderConfiguration(dispatch_batches=True)
    dispatched = acc.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    out["dispatched"] = [x.tolist() for (x,) in dispatched]
    try:
        acc.prepare(DataLoader(Stream(), batch_size=1))
    except ValueError as exc:
        out["iterable_dispatch"] = str(exc)
    acc.end_training()
    return out


def test_pickling_checkpoint_directories_and_dispatch_batches(tmp_path):
    res = run_ranks(_pickle_and_checkpoints, 2, str(tmp_path))
    for rank, r in enumerate(res):
        assert r["state_equal"] and r["same_group"] and r["resumed"]
        assert r["singletons"] == (True, True, True, True) and r["max"] == [1.0, 0.0]
        assert r["different_dirs"].startswith("save_state: the ranks disagree on 1 setting(s)")
        assert "directory (a checkpoint is one directory that every rank writes into: pass the same path on every " \
               "rank): rank 0: " in r["different_dirs"]
        assert "rank0" in r["different_dirs"] and "rank1" in r["different_dirs"]
        # dispatching rank 0's batches or reading them on each rank: the same batches
        assert r["dispatched"] == [[0, 1], [4, 5]] if rank == 0 else r["dispatched"] == [[2, 3], [6, 7]]
        assert r["iterable_dispatch"].startswith("prepare(): dispatch_batches=True with an iterable dataset is not "
                                                 "supported: every rank reads its own share")
    assert not (tmp_path / "rank0").exists() and not (tmp_path / "rank1").exists()


def _fsdp_ignored_params() -> list:
    from ndparallel import Accelerator
    from ndparallel.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(ignored_modules=r"^1$"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].requires_grad_(False)
    model = acc.prepare(model)
    ignored = sorted(name for name, p in model.named_parameters() if p in model._ignored_params)
    acc.end_training()
    return ignored


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_fsdp_wrapped_model_names_its_ignored_parameters(world_size):
    """Two ranks: what FSDP2 left alone. One: no FSDP2 wrap (nothing to shard), the parameters the plugin's
    ignored_modules name all the same, as Accelerate, which wraps one process too."""
    assert run_ranks(_fsdp_ignored_params, world_size) == [["1.bias", "1.weight"]] * world_size


def _saved_before_the_first_step(tmp: str) -> dict:
    from ndparallel import Accelerator

    def run(save: bool) -> tuple[torch.Tensor, dict]:
        acc = Accelerator()
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        model, optimizer = acc.prepare(model, optimizer)
        if save:  # before any step: the optimizer has no state, and must keep none
            acc.save_state(f"{tmp}/fresh")
            acc.load_state(f"{tmp}/fresh")
        stateless = not optimizer.state
        for _ in range(3):
            acc.backward(model(torch.ones(4, 2)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        return model.weight.detach().clone(), stateless

    (plain, _), (saved, stateless) = run(False), run(True)
    out = {"same_training": torch.equal(plain, saved), "stateless": stateless}
    acc = Accelerator()
    try:
        acc.register_for_checkpointing(torch.nn.Linear(1, 1), [1], torch.ones(1))
    except ValueError as exc:
        out["registration"] = str(exc)
    acc.end_training()
    return out


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_fresh(tmp_path):
    """torch's optimizer state dict steps a fresh optimizer to give it state (Adam's step count 1, which shifts its
    bias correction): saving and loading then must not change the training that follows."""
    (res,) = run_ranks(_saved_before_the_first_step, 1, str(tmp_path))
    assert res["same_training"] and res["stateless"]
    assert res["registration"] == ("register_for_checkpointing takes objects with state_dict and load_state_dict "
                                   "methods; these have not: Item at index 1 (list), Item at index 2 (Tensor)")
