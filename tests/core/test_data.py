"""Data-loader sharding along the mesh's `batch` view, checked from first principles.

A rank's batch coordinate is computed here independently of the library: the row-major unravel of the rank
over (dp_replicate, dp_shard, cp, sp, tp), then dp_replicate * dp_shard_size + dp_shard.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from harness import run_ranks


def batch_coordinate(rank: int, sizes: dict[str, int]) -> int:
    shape = [sizes.get(a, 1) for a in ("dp_replicate", "dp_shard", "cp", "sp", "tp")]
    coords = np.unravel_index(rank, shape)
    return int(coords[0]) * shape[1] + int(coords[1])


class Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _iterate(sizes: dict, n: int, batch_size: int, shuffle: bool, iterable: bool, epochs: int = 1,
             drop_last: bool = False, set_epoch: list[int] | None = None, num_workers: int = 0) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()}))
    dataset = Numbers(n) if iterable else list(range(n))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                        num_workers=num_workers)
    loader = acc.prepare(loader)
    passes, gathered = [], []
    for e in range(epochs):
        if set_epoch is not None:
            loader.set_epoch(set_epoch[e])
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            gathered.append(acc.gather_for_metrics(batch).tolist())
        passes.append(batches)
    return {"passes": passes, "gathered": gathered, "len": None if iterable else len(loader)}


@pytest.mark.slow
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
@pytest.mark.parametrize("sizes", [dict(dp_replicate=2, dp_shard=2, tp=2), dict(dp_shard=2, cp=2, sp=2)],
                         ids=["dp2x2_tp2", "dp2_cp2_sp2"])
def test_batch_ranks_get_distinct_samples_and_peers_the_same(sizes, iterable):
    world = int(np.prod(list(sizes.values())))
    n, b = 48, 3
    results = run_ranks(_iterate, world, sizes, n, b, not iterable, iterable)
    dp = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    by_coord: dict[int, list] = {}
    for rank, res in enumerate(results):
        batches = res["passes"][0]
        coord = batch_coordinate(rank, sizes)
        if coord in by_coord:
            assert batches == by_coord[coord], f"rank {rank} got other samples than its batch peers"
        by_coord[coord] = batches
    assert sorted(by_coord) == list(range(dp))
    steps = n // (dp * b)
    for step in range(steps):
        global_batch = list(itertools.chain.from_iterable(by_coord[c][step] for c in range(dp)))
        assert len(set(global_batch)) == dp * b  # distinct samples across batch ranks
        if iterable:  # iterable data arrives in order: step k holds samples [k*D*B, (k+1)*D*B)
            assert global_batch == list(range(step * dp * b, (step + 1) * dp * b))
    everything = sorted(x for c in by_coord.values() for batch in c for x in batch)
    assert everything == list(range(n))
    # gather_for_metrics returns the global batch, in rank order, without duplicates from tp/cp/sp peers
    assert results[0]["gathered"][0] == list(itertools.chain.from_iterable(by_coord[c][0] for c in range(dp)))


def test_shuffle_is_deterministic_and_set_epoch_reshuffles():
    results = run_ranks(_iterate, 2, {"dp_shard": 2}, 40, 4, True, False, 3, False, [0, 1, 0])
    first, second, again = results[0]["passes"]
    assert first != second  # a new epoch, a new order
    assert first == again  # set_epoch(0) repeats epoch 0's order
    auto = run_ranks(_iterate, 2, {"dp_shard": 2}, 40, 4, True, False, 2)
    assert auto[0]["passes"][1] != auto[0]["passes"][0]  # passes count epochs by themselves


@pytest.mark.parametrize("iterable,workers", [(False, 0), (True, 0), (True, 1)],
                         ids=["map", "iterable", "iterable_in_a_worker"])
def test_last_uneven_batch_is_padded_and_gather_for_metrics_drops_the_padding(iterable, workers):
    # 9 samples, batch 2, 2 ranks: steps [0..3], [4..7], then sample 8 alone -> rank 1 gets a repeat. In a worker
    # process the count of real samples comes back to the main process through shared memory.
    results = run_ranks(_iterate, 2, {"dp_shard": 2}, 9, 2, False, iterable, 1, False, None, workers)
    assert [len(r["passes"][0]) for r in results] == [3, 3]  # same number of steps on every rank
    assert results[0]["passes"][0][-1] == [8] and results[1]["passes"][0][-1] == [0]
    gathered = list(itertools.chain.from_iterable(results[0]["gathered"]))
    assert gathered == list(range(9))


def test_drop_last_drops_the_incomplete_global_batch():
    results = run_ranks(_iterate, 2, {"dp_shard": 2}, 9, 2, False, False, 1, True)
    assert [r["passes"][0] for r in results] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert results[0]["len"] == 2


def test_worker_processes_are_supported():
    results = run_ranks(_iterate, 2, {"dp_shard": 2}, 16, 2, True, False, 1, False, None, 1)
    seen = sorted(x for r in results for batch in r["passes"][0] for x in batch)
    assert seen == list(range(16))


def _accumulation_flags(n_batches: int, accum: int) -> list[bool]:
    from ndparallel import Accelerator

    acc = Accelerator(gradient_accumulation_steps=accum)
    model = torch.nn.Linear(2, 1)
    loader = acc.prepare(DataLoader([{"x": torch.ones(2)}] * n_batches, batch_size=1))
    model = acc.prepare(model)
    flags = []
    for _ in loader:
        with acc.accumulate(model):
            flags.append(acc.sync_gradients)
    return flags


def test_accumulation_windows_follow_the_data_loader_and_sync_at_its_end():
    assert run_ranks(_accumulation_flags, 1, 5, 2)[0] == [False, True, False, True, True]
    assert run_ranks(_accumulation_flags, 1, 3, 1)[0] == [True, True, True]


# ---- every random sampler of torch: one order shared by all ranks, whatever each rank's own torch seed --------
SAMPLERS = ("weighted", "subset", "num_samples", "replacement", "shuffle+generator")


def _sampled(sizes: dict, n: int, batch_size: int, seed: int, epochs: int = 2) -> dict[str, list]:
    """Per sampler kind, this rank's batches of `epochs` passes of a prepared DataLoader over ``range(n)``.

    Each rank seeds torch differently (rank 0 with `seed`), as independently launched processes may: a sampler
    drawing from its process's own RNG would then give each rank another order.
    """
    import os

    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    from ndparallel import Accelerator, ParallelismConfig

    torch.manual_seed(seed + 7919 * int(os.environ["RANK"]))
    acc = Accelerator(parallelism_config=ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()}))
    dataset = list(range(n))
    loaders = {
        "weighted": DataLoader(dataset, batch_size=batch_size, sampler=WeightedRandomSampler(
            [1.0 + i % 3 for i in range(n)], num_samples=n, replacement=False)),
        "subset": DataLoader(dataset, batch_size=batch_size, sampler=SubsetRandomSampler(range(0, n, 2))),
        "num_samples": DataLoader(dataset, batch_size=batch_size, sampler=RandomSampler(dataset, num_samples=n // 2)),
        "replacement": DataLoader(dataset, batch_size=batch_size, sampler=RandomSampler(dataset, replacement=True)),
        "shuffle+generator": DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                        generator=torch.Generator().manual_seed(seed + 1)),
    }
    out = {}
    for name, loader in loaders.items():
        loader = acc.prepare(loader)
        out[name] = [[batch.tolist() for batch in loader] for _ in range(epochs)]
    return out


@pytest.fixture(scope="module")
def sampled() -> dict[str, list]:
    """One process (the single sequence), two ranks, and the same two ranks again (reproducibility)."""
    n, b, seed = 32, 2, 1234
    return {
        "single": run_ranks(_sampled, 1, {}, n, b, seed)[0],
        "two": run_ranks(_sampled, 2, {"dp_shard": 2}, n, b, seed),
        "again": run_ranks(_sampled, 2, {"dp_shard": 2}, n, b, seed),
        "n": n,
    }


def _split_check(sampled: dict, name: str) -> None:
    """Step k of the two ranks holds batches 2k and 2k+1 of the one-process run: one order, split in two."""
    single, (rank0, rank1) = sampled["single"][name], sampled["two"]
    for epoch, batches in enumerate(single):
        assert len(batches) % 2 == 0
        steps = list(zip(rank0[name][epoch], rank1[name][epoch], strict=True))
        assert len(steps) == len(batches) // 2
        for k, (b0, b1) in enumerate(steps):
            assert [b0, b1] == batches[2 * k:2 * k + 2], f"{name}, epoch {epoch}, step {k}"
    assert single[0] != single[1], f"{name}: the second pass should reshuffle"


@pytest.mark.parametrize("name", [s for s in SAMPLERS if s != "replacement"])
def test_random_samplers_give_ranks_disjoint_samples_in_a_reproducible_order(sampled, name):
    """WeightedRandomSampler, SubsetRandomSampler, RandomSampler(num_samples=...) and a DataLoader generator: at
    world 2 the ranks' samples are disjoint within each step, a pass covers what the sampler draws, and a rerun
    gives every rank the same order again."""
    rank0, rank1 = (r[name] for r in sampled["two"])
    expected = {"subset": set(range(0, sampled["n"], 2)), "num_samples": None}.get(name, set(range(sampled["n"])))
    for epoch in range(2):
        for b0, b1 in zip(rank0[epoch], rank1[epoch], strict=True):
            assert not set(b0) & set(b1), f"{name}, epoch {epoch}: ranks share samples {set(b0) & set(b1)}"
        drawn = [x for batches in (rank0[epoch], rank1[epoch]) for batch in batches for x in batch]
        assert len(drawn) == len(set(drawn))  # no sample twice in a pass
        if expected is not None:
            assert set(drawn) == expected
        else:
            assert len(drawn) == sampled["n"] // 2
    assert [r[name] for r in sampled["again"]] == [rank0, rank1]
    _split_check(sampled, name)


def test_random_sampler_with_replacement_draws_one_shared_sequence(sampled):
    """RandomSampler(replacement=True) at world 2: the ranks get different batches, drawn from one sequence (the
    one-process sequence split in two), and the same ones on a rerun."""
    rank0, rank1 = (r["replacement"] for r in sampled["two"])
    assert rank0 != rank1
    assert [r["replacement"] for r in sampled["again"]] == [rank0, rank1]
    _split_check(sampled, "replacement")


def _per_batch_values(world: int, n: int, batch_size: int) -> list[list[float]]:
    """A per-batch value repeated to the loader's batch size (the Hugging Face Trainer's evaluation losses)."""
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=world) if world > 1 else None)
    loader = acc.prepare(DataLoader(list(range(n)), batch_size=batch_size))
    out = []
    for batch in loader:
        value = batch.float().mean()
        out.append(acc.gather_for_metrics(value.repeat(batch_size)).tolist())
    return out


@pytest.mark.parametrize("world,n", [(1, 10), (2, 11), (2, 13)], ids=["1rank-last2", "2ranks-last3", "2ranks-last5"])
def test_gather_for_metrics_keeps_the_real_samples_of_a_final_partial_batch(world, n):
    """As Accelerate: on the final batch, when it is not a whole global batch, the first `remainder` gathered rows
    (`remainder`: its real samples), whatever each rank's tensor holds; a whole final batch is kept whole. On one
    process that counts a per-batch value repeated to the batch size once per real sample of the short batch."""
    gathered = run_ranks(_per_batch_values, world, world, n, 4)[0]
    full, last = divmod(n, 4 * world)
    assert [len(g) for g in gathered] == [4 * world] * full + ([last] if last else [])
    # each rank's final batch: its share of the leftovers, topped up from the start of the pass (samples 0, 1, ...)
    leftovers = list(range(full * 4 * world, n))
    share = -(-len(leftovers) // world)
    padded = leftovers + list(range(share * world - len(leftovers)))
    means = [float(np.mean(padded[r * share:(r + 1) * share])) for r in range(world)]
    assert gathered[-1] == pytest.approx([m for m in means for _ in range(4)][:last])
    if world == 1:
        assert gathered[-1] == pytest.approx([float(np.mean(leftovers))] * last)


def _uneven_last_batch(sizes: dict[str, int]) -> str:
    from ndparallel import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()}),
                      dataloader_config=DataLoaderConfiguration(even_batches=False),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = acc.prepare(torch.nn.Linear(4, 4))
    loader = acc.prepare(DataLoader(torch.randn(10, 4), batch_size=2))  # 5 batches over 2 ranks: one left over
    try:
        for x in loader:
            acc.backward(model(x).sum())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_uneven_last_batch_is_refused_where_every_rank_must_run_every_step():
    """even_batches=False leaves one rank without a last batch; under FSDP2 the others would wait for it forever.
    Every rank raises, naming even_batches and why, before running the batch."""
    for message in run_ranks(_uneven_last_batch, 2, {"dp_shard": 2}, timeout=60):
        assert message.startswith("even_batches=False: the last batch of this pass goes to 1 of the 2 ranks with "
                                  "distinct samples, and the others have none, but FSDP2 all-gathers the sharded "
                                  "parameters in every forward"), message


def _stateful(stateful: bool) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ndparallel import Accelerator, DataLoaderConfiguration, ParallelismConfig
    from ndparallel.training.data import PreparedDataLoader

    def prepared() -> DataLoader:
        acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                          dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
        torch.manual_seed(0)
        return acc.prepare(DataLoader(list(range(24)), batch_size=2, shuffle=True))

    loader = prepared()
    first = [b.tolist() for _, b in zip(range(2), loader)]
    state = loader.state_dict()
    rest = [b.tolist() for b in loader]
    resumed = prepared()
    resumed.load_state_dict(state)
    return {"types": (isinstance(loader, StatefulDataLoader), isinstance(loader, PreparedDataLoader)),
            "batches": first + rest, "resumed": [b.tolist() for b in resumed], "rest": rest[2:]}


def test_use_stateful_dataloader_prepares_a_stateful_dataloader_that_behaves_as_the_others():
    """Accelerate's ``use_stateful_dataloader=True`` prepares torchdata's ``StatefulDataLoader``: so does ndparallel
    (its own loader, of that type too), with the same batches and the same resume as without the setting."""
    plain, stateful = run_ranks(_stateful, 2, False), run_ranks(_stateful, 2, True)
    for rank in range(2):
        assert plain[rank]["types"] == (False, True) and stateful[rank]["types"] == (True, True)
        assert stateful[rank]["batches"] == plain[rank]["batches"]
        # Resumed from the state after 2 of the pass's 6 batches: the pass's last 4 (the same order: `rest` is a new
        # pass of the same epoch, which the unfinished one did not end).
        assert stateful[rank]["resumed"] == stateful[rank]["rest"] == plain[rank]["resumed"]
        assert len(stateful[rank]["rest"]) == 4 and stateful[rank]["batches"][:2] == plain[rank]["batches"][:2]
