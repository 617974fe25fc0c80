"""Print what the agreement checks and the watched collectives cost, as ratios to one training step.

    python benchmarks/agreement.py [--repeats 40] [--prepare-repeats 24]

The README example's layout: examples/nd_parallel.py's Llama (hidden 64, 2 layers, seq 128) and corpus, batch 4
per data-parallel rank, HSDP (dp_replicate 2 x dp_shard 2) on 4 forked gloo ranks (`run_ranks`, one thread
each). In each of `--repeats` rounds every rank runs one step of the README loop (accumulate, backward, clip, step,
reduce_loss) and one of every figure below, each after a ``dist.barrier()``, in an order shuffled each round, so
load from other processes hits the step and the checks alike. Each figure is the median over the rounds, of the
slowest rank.

- the ``Accelerator(...)`` and ``prepare()`` checks as the Accelerator runs them: fingerprint, digest, one
  `monitored_barrier` carrying it; next to the check as it was before (the same digest, one all-gather of the
  backend, ``check_agreement(..., group=WORLD)``, after a monitored barrier at prepare), a bare monitored barrier,
  gloo's own barrier, and one request to the store;
- ``reduce`` and ``gather`` through the Accelerator (inside `ndparallel.distributed.agreement.watched`) and the same
through
  `ndparallel.distributed.gather_reduce` directly, and the local cost of ``watched`` alone (over 10,000 entries);
- then ``prepare(model, optimizer, data loader, scheduler)`` of fresh objects, `--prepare-repeats` times with the
  checks and as often with ``check_agreement`` replaced by a no-op, alternating: both medians, the paired
  differences (prepare() itself varies by +-10 ms here, more than the check costs), and the check's own time inside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

import torch.distributed.checkpoint  # noqa: E402,F401 - imported before forking
from ndparallel.test_utils import run_ranks  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402,F401 - imported once here, not in every rank

SEQ_LEN, BATCH = 128, 4


def _rank(repeats: int, prepare_repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from nd_parallel import build_dataset, build_model
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig, set_seed
    from ndparallel.distributed import agreement
    from ndparallel.distributed import gather_reduce as operations

    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    timeout = accelerator.state.runtime.timeout
    dataset = build_dataset(SEQ_LEN)

    def objects() -> list:
        set_seed(0)
        model = build_model({"seq_len": SEQ_LEN})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        return [model, optimizer, DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True),
                torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]

    plain = objects()  # the prepare() check fingerprints these; the copies below are trained
    model, optimizer, dataloader, scheduler = accelerator.prepare(*objects())
    s = accelerator._settings
    settings = agreement.accelerator_fingerprint(s.parallelism, s.fsdp_plugin, s.mixed_precision, s.accumulation_steps,
                                                 device=accelerator.device.type, dataloader=s.dataloader,
                                                 loss_weighting=s.loss_weighting)
    store = dist.distributed_c10d._get_default_store()
    store.set("bench/key", "x")
    loss_t, rows = torch.ones(2), torch.ones(BATCH, 8)

    def batches():
        epoch = 0
        while True:
            dataloader.set_epoch(epoch)
            yield from dataloader
            epoch += 1

    def step() -> None:  # the README loop, one optimizer step
        batch = next(batch_iter)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.reduce_loss(loss)

    ops = {
        "training step (README loop)": step,
        "Accelerator(...) check: barrier + digest": lambda: agreement.check_agreement(
            settings, "Accelerator(...)", timeout=timeout),
        "  its fingerprint + digest alone (local)": lambda: digest(settings),
        "prepare() check: barrier + digest": lambda: agreement.check_agreement(
            agreement.prepare_fingerprint(plain), "prepare()", timeout=timeout),
        "  its fingerprint + digest alone (local) ": lambda: digest(agreement.prepare_fingerprint(plain)),
        "before: prepare() check by all-gather": lambda: agreement.check_agreement(
            agreement.prepare_fingerprint(plain), "prepare()", group=dist.group.WORLD),
        "before: barrier + all-gather check": lambda: (agreement.monitored_barrier("prepare", timeout),
                                                       agreement.check_agreement(agreement.prepare_fingerprint(plain),
                                                                                 "prepare()", group=dist.group.WORLD)),
        "monitored_barrier": lambda: agreement.monitored_barrier("bench", timeout),
        "dist.barrier() (gloo), for reference": dist.barrier,
        "one store request (check)": lambda: store.check(["bench/key"]),
        "accelerator.reduce (watched)": lambda: accelerator.reduce(loss_t),
        "operations.reduce (not watched)": lambda: operations.reduce(loss_t, accelerator.mesh, "loss"),
        "accelerator.gather (watched)": lambda: accelerator.gather(rows),
        "operations.gather (not watched)": lambda: operations.gather(rows, accelerator.mesh, "batch"),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}

    def digest(fingerprint: dict) -> str:  # what check_agreement computes before its barrier
        return hashlib.sha1(json.dumps(agreement.jsonable(fingerprint), sort_keys=True).encode()).hexdigest()[:16]

    batch_iter = batches()
    for _ in range(3):  # warm-up
        step()
    for round_ in range(repeats):
        for name in random.Random(round_).sample(list(ops), len(ops)):  # the same order on every rank
            op = ops[name]
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)

    def ranks() -> list[int]:
        return accelerator.mesh.ranks("loss")

    start = time.perf_counter()
    for _ in range(10_000):
        with agreement.watched("reduce", ranks, timeout):
            pass
    times["watched() alone, no collective"] = [(time.perf_counter() - start) / 10_000]

    checked, kept, inside = agreement.check_agreement, [], []

    def timed_check(*args, **kwargs) -> None:
        start = time.perf_counter()
        checked(*args, **kwargs)
        inside.append(time.perf_counter() - start)

    times["prepare() with the checks"], times["prepare() without (no-op check)"] = [], []
    for i in range(2 * prepare_repeats):
        with_checks = (i % 2 == 0) == (i // 2 % 2 == 0)  # with, without, without, with, ...
        agreement.check_agreement = timed_check if with_checks else (lambda *args, **kwargs: None)
        fresh = objects()
        kept.append(fresh)  # alive, so no new object gets a prepared one's id (prepare refuses ids it has taken)
        dist.barrier()
        start = time.perf_counter()
        accelerator.prepare(*fresh)
        elapsed = time.perf_counter() - start
        agreement.check_agreement = checked
        times["prepare() with the checks" if with_checks else "prepare() without (no-op check)"].append(elapsed)
        accelerator.free_memory()
    times["the check inside prepare()"] = inside
    accelerator.end_training()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=40, help="rounds of one step and one of each check")
    p.add_argument("--prepare-repeats", type=int, default=24, help="prepare() calls with the checks, and without")
    args = p.parse_args()
    results = run_ranks(_rank, 4, args.repeats, args.prepare_repeats, timeout=1200)
    median = {name: max(statistics.median(r[name]) for r in results) for name in results[0]}
    step = median["training step (README loop)"]
    print(f"HSDP 2x2 on 4 gloo ranks, Llama hidden 64 x 2 layers, seq {SEQ_LEN}, batch {BATCH} per data rank; "
          f"{args.repeats} rounds; median of the slowest rank")
    print(f"{'':44s} {'ms':>9s} {'/ step':>8s}")
    for name, value in median.items():
        if name in ("prepare() with the checks", "prepare() without (no-op check)", "the check inside prepare()"):
            continue
        if name == "watched() alone, no collective":
            print(f"{name:44s} {value * 1e6:7.2f}us {value / step:8.5%}")
            continue
        print(f"{name:44s} {value * 1e3:9.3f} {value / step:8.2%}")
    with_checks, without = median["prepare() with the checks"], median["prepare() without (no-op check)"]
    paired = sorted(a - b for r in results for a, b in zip(r["prepare() with the checks"],
                                                           r["prepare() without (no-op check)"]))
    quartiles = statistics.quantiles(paired, n=4)
    print(f"\nprepare(model, optimizer, data loader, scheduler), {args.prepare_repeats} times with the checks and "
          "as often without, alternating:")
    print(f"  median with {with_checks * 1e3:.1f} ms, without {without * 1e3:.1f} ms (slowest rank): ratio "
          f"{with_checks / without:.3f}")
    print(f"  paired differences with - without, every rank: median {quartiles[1] * 1e3:+.2f} ms "
          f"({quartiles[1] / step:+.2%} of a step), quartiles {quartiles[0] * 1e3:+.2f} .. "
          f"{quartiles[2] * 1e3:+.2f} ms")
    inside = median["the check inside prepare()"]
    print(f"  the check inside those prepare() calls (slowest rank): median {inside * 1e3:.2f} ms, "
          f"{inside / with_checks:.2%} of prepare(), {inside / step:.2%} of a step")


if __name__ == "__main__":
    main()
