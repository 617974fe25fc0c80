"""Exact resume and resharding: a run that stops after k steps and resumes from its checkpoint continues the loss
curve of the run that never stopped -- under the same layout, and under another one.

The script (scripts/checkpoint_train.py) shuffles 28 samples into global batches of 8 (epochs of 4 steps, the last
one short), saves after step 2 (mid-epoch) and trains to step 6 (across an epoch boundary); it registers a user
object for checkpointing, and, in the same-layout runs, uses attention dropout so the random states matter. Some
layouts load the data in worker processes as well (2 per rank, persistent or not) and resume from step 4 too.

Tolerances: the same layout resumes bit for bit (asserted within 1e-6, fp32). Another layout sums gradients in
another order (reduce-scatter over other groups, tensor-parallel matmuls split differently), so its losses follow
the saved layout's within the 1e-5 of tests/parallel/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not again in every forked rank
from transformers import LlamaForCausalLM  # noqa: F401 - likewise (transformers imports models lazily)

import checkpoint_train
from harness import run_ranks
from ndparallel.training.data import PreparedDataLoader
from torch.utils.data import DataLoader

SAVE_AT, STEPS = 2, 6

# (id, world size, flags)
LAYOUTS = {
    "single": (1, ["--no-fsdp-plugin"]),
    "ddp2": (2, ["--dp-replicate-size", "2", "--no-fsdp-plugin"]),
    "fsdp2": (2, ["--dp-shard-size", "2"]),
    "fsdp4": (4, ["--dp-shard-size", "4"]),
    "hsdp2x2_accum2": (4, ["--dp-replicate-size", "2", "--dp-shard-size", "2", "--accum", "2"]),
    "fsdp2_full_state": (2, ["--dp-shard-size", "2", "--full-state"]),
    "fsdp2xtp2": (4, ["--dp-shard-size", "2", "--tp-size", "2"]),
    "fsdp2xcp2": (4, ["--dp-shard-size", "2", "--cp-size", "2"]),
}


def run(name: str, *extra: str) -> dict:
    world, flags = LAYOUTS[name]
    results = run_ranks(checkpoint_train.main, world, [*flags, "--steps", str(STEPS), *extra])
    for res in results[1:]:  # every rank logged the same global losses and restored the same counters
        assert res["losses"] == results[0]["losses"] and res["counter"] == results[0]["counter"]
    return results[0]


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) for k in a)


# Data-loader worker processes (the DataLoader's num_workers; persistent or not) in some layouts: the resume is
# exact with them too, from mid-epoch and from the epoch's last step (EPOCH_END: the loop saves after the epoch's
# last batch, before the loader has ended its pass).
WORKERS = {"no_workers": [], "workers2": ["--workers", "2"],
           "persistent_workers2": ["--workers", "2", "--persistent-workers"]}
RESUMES = [(name, "no_workers") for name in ("single", "ddp2", "fsdp2", "hsdp2x2_accum2", "fsdp2_full_state",
                                             "fsdp2xtp2", "fsdp2xcp2")] + [
    ("single", "workers2"), ("fsdp2", "persistent_workers2"), ("hsdp2x2_accum2", "workers2"),
    ("fsdp2xcp2", "workers2")]
EPOCH_END = 4  # 28 samples in global batches of 8: epochs of 4 steps


@pytest.mark.slow
@pytest.mark.parametrize("name,workers", RESUMES, ids=[f"{n}-{w}" for n, w in RESUMES])
def test_resume_reproduces_the_uninterrupted_run(name, workers, tmp_path):
    dropout = [] if "cp" in name else ["--dropout", "0.1"]  # context-parallel attention is exact without dropout
    points = [SAVE_AT] if workers == "no_workers" else [SAVE_AT, EPOCH_END]
    flags = [*dropout, *WORKERS[workers]]
    full = run(name, *flags, "--save-at", *map(str, points), "--save-dir", str(tmp_path))
    assert full["epoch"] == 1  # the run crossed an epoch boundary (the loader's pass count)
    for point in points:
        resumed = run(name, *flags, "--load", str(tmp_path / f"step_{point}"))
        expected = {k: v for k, v in full["losses"].items() if k > point}
        assert max_diff(resumed["losses"], expected) <= 1e-6, f"{name} from {point}: {resumed['losses']} vs {expected}"
        assert resumed["counter"] == full["counter"] == STEPS  # the registered object came back and counted on
        assert resumed["lr"] == full["lr"] and resumed["epoch"] == full["epoch"]


@pytest.fixture(scope="module")
def fsdp4_checkpoint(tmp_path_factory):
    """A run on dp_shard 4 that saves after step 2 and trains on: the loss curve the resharded runs continue."""
    directory = tmp_path_factory.mktemp("fsdp4")
    full = run("fsdp4", "--save-at", str(SAVE_AT), "--save-dir", str(directory))
    return directory / f"step_{SAVE_AT}", full["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "single", "fsdp2xtp2", "fsdp2xcp2"])
def test_checkpoint_of_dp_shard_4_resumes_under_another_layout(name, fsdp4_checkpoint):
    checkpoint, losses = fsdp4_checkpoint
    resumed = run(name, "--load", str(checkpoint))
    expected = {k: v for k, v in losses.items() if k > SAVE_AT}
    assert max_diff(resumed["losses"], expected) <= 1e-5, f"{name}: {resumed['losses']} vs {expected}"
    assert resumed["counter"] == STEPS


@pytest.mark.slow
def test_resumed_training_ends_with_the_same_parameters(tmp_path):
    """Beyond the losses: after resuming (here from DDP into FSDP2) the final weights equal the uninterrupted run's."""
    full = run("ddp2", "--save-at", str(SAVE_AT), "--save-dir", str(tmp_path), "--return-params")
    resumed = run("fsdp2", "--load", str(tmp_path / f"step_{SAVE_AT}"), "--return-params")
    assert full["params"].keys() == resumed["params"].keys()
    diff = max((full["params"][k] - resumed["params"][k]).abs().max().item() for k in full["params"])
    assert diff <= 1e-6, diff


# ---- data-loader positions (no processes) ---------------------------------------------------------------------------
class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        return i


class IterIndices(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(30))


def loaders(num_shards: int, batch_size: int, iterable: bool = False) -> list[PreparedDataLoader]:
    """The `num_shards` ranks' prepared loaders of one shuffled loader (as prepare() builds them)."""
    out = []
    for shard in range(num_shards):
        base = DataLoader(IterIndices() if iterable else Indices(), batch_size=batch_size, shuffle=not iterable)
        out.append(PreparedDataLoader(base, num_shards=num_shards, shard_index=shard, seed=7,
                                      device=torch.device("cpu"), put_on_device=False, window=1, window_group=None))
    return out


def global_stream(ranks: list[PreparedDataLoader], steps: int | None = None) -> list[int]:
    """The samples of the global batches, in order: each step, rank 0's batch, then rank 1's..."""
    out: list[int] = []
    iterators = [iter(r) for r in ranks]
    while steps is None or len(out) < steps * sum(r.batch_size for r in ranks):  # no batch fetched past `steps`
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            break
        out += [int(i) for batch in batches for i in batch]
    return out


@pytest.mark.parametrize("saved,resumed", [((3, 2), (2, 3)), ((3, 2), (1, 4)), ((3, 2), (1, 5)), ((2, 3), (3, 2))],
                         ids=["to_2x3", "to_1x4", "to_1x5_rebatched", "to_3x2"])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_data_position_resumes_under_another_data_parallel_and_batch_size(saved, resumed, iterable):
    """Stop after 2 global batches under (ranks x batch size) `saved`, resume under `resumed`: the samples that follow
    are exactly those of the uninterrupted pass, and the next pass reshuffles as it would have."""
    uninterrupted = global_stream(loaders(*saved, iterable))
    before = loaders(*saved, iterable)
    consumed = global_stream(before, steps=2)
    state = before[0].state_dict()
    assert state["position"] == len(consumed) == 2 * saved[0] * saved[1] and state["unit"] == "samples"
    after = loaders(*resumed, iterable)
    for loader in after:
        loader.load_state_dict(state)
    rest = global_stream(after)
    assert consumed + rest == uninterrupted  # nothing repeated, nothing skipped
    assert after[0].epoch == 1 and after[0].state_dict()["position"] == 0
    second_pass = loaders(*resumed, iterable)
    for loader in second_pass:
        loader.set_epoch(1)
    assert global_stream(after) == global_stream(second_pass)  # the next pass is the saved run's next pass


def test_set_epoch_to_another_epoch_drops_the_restored_position():
    before = loaders(2, 3)
    global_stream(before, steps=1)
    after = loaders(2, 3)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
        loader.set_epoch(0)  # the restored epoch: keeps the position
    assert len(global_stream(after)) == 30 - 6
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
        loader.set_epoch(1)  # another epoch: a whole pass
    assert len(global_stream(after)) == 30
