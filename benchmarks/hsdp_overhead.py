"""What one optimizer step of the library's Accelerate-style loop costs beyond hand-written FSDP2 / HSDP (issue 33).

    python benchmarks/hsdp_overhead.py count [--layouts fsdp2 hsdp] [--accum 1 2] [--profile-steps 20]
    python benchmarks/hsdp_overhead.py time  [--layouts fsdp2 hsdp] [--accum 1] [--log reduce]
                                             [--rounds 9] [--steps 30] [--warmup 5]

The workload is issue 33's: a tiny Llama (2 layers, hidden 64), 2 samples x 32 tokens per rank, AdamW, gradient-norm
clipping, the loss logged every micro-step. Layouts: ``fsdp2`` (dp_shard 2, 2 ranks) and ``hsdp`` (dp_replicate 2 x
dp_shard 2, 4 ranks), forked gloo ranks on the CPU (ndparallel.test_utils.run_ranks), one thread each.

- library: ``Accelerator(parallelism_config=..., fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``,
  ``prepare``, then per micro-step ``with accelerator.accumulate(model):`` forward, ``accelerator.backward``,
  ``accelerator.clip_grad_norm_`` when ``sync_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``; logged
  with ``accelerator.reduce(loss, "mean")`` or ``accelerator.reduce_loss(loss)`` (``--log``), then ``.item()``.
- plain: ``fully_shard`` per decoder layer and the root over a 1-D mesh (a 2-D (dp_replicate, dp_shard) mesh for
  HSDP), a ``DistributedSampler``, the loss divided by the accumulation steps, ``set_requires_gradient_sync(False)``
  on all but the last micro-step, torchtitan's clipping (``get_total_norm``, ``full_tensor``,
  ``clip_grads_with_norm_``), ``dist.all_reduce`` of the loss and ``.item()`` when logging.

``count`` runs a few steps of each, then counts one optimizer step: collectives by kind and group size
(CollectiveCounter), c10d store operations from Python (StoreCounter), host syncs (``item()``,
``int()``, ``float()``, ``bool()`` of a tensor), and Python time per optimizer step from cProfile over
``--profile-steps`` steps (rank 0, CPU time; the library's own functions by self time). Deterministic except the
times.

``time`` alternates blocks of ``--steps`` optimizer steps of the library and plain loops in the same ranks,
``--rounds`` times (the order flips every round, after a barrier), after ``--warmup`` steps of each. Each round's
ratio is the ratio of the two blocks' per-step medians (rank 0's wall clock; every step ends in collectives, so the
ranks run in step); printed: the median over rounds and the spread (min..max of the rounds' ratios), also for CPU time,
and the ratio of the per-step medians with every step pooled, with its 95% bootstrap interval over rounds. On a
shared machine many short rounds (``--steps 1 --rounds 600``: the two loops alternate step by step) pair the two best:
load that drifts hits both alike, and the interval says how far the ratio can be trusted.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

torch.set_num_threads(1)  # forked ranks share the cores

from common import LAYOUTS as ALL_LAYOUTS  # noqa: E402
from common import llama  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

LAYOUTS = {name: ALL_LAYOUTS[name] for name in ("fsdp2", "hsdp")}
LOGS = ("none", "reduce", "reduce_loss")


def build_model(args: Any):
    return llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers, intermediate=2 * args.hidden, heads=4,
                 kv_heads=2, max_positions=64)


def samples(args: Any, ranks: int, accum: int, steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch * ranks * accum * steps, args.seq), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class Cycle:
    """Batches of `loader` forever, a new pass when one ends."""

    def __init__(self, loader) -> None:
        self.loader, self.it = loader, iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


class Library:
    def __init__(self, layout: str, accum: int, args: Any, data) -> None:
        from torch.utils.data import DataLoader

        from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

        replicate, shard = LAYOUTS[layout].dp_replicate, LAYOUTS[layout].dp_shard
        self.accelerator = Accelerator(
            parallelism_config=ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard),
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), gradient_accumulation_steps=accum, cpu=True)
        model = build_model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=args.batch)
        self.model, self.optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        self.batches, self.accum = Cycle(loader), accum

    def step(self, log: str) -> float | None:
        """One optimizer step (its micro-steps); the last logged value."""
        acc, logged = self.accelerator, None
        for _ in range(self.accum):
            batch = self.batches.next()
            with acc.accumulate(self.model):
                loss = self.model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad()
            if log == "reduce":
                logged = acc.reduce(loss.detach(), "mean").item()
            elif log == "reduce_loss":
                logged = acc.reduce_loss(loss).item()
        return logged


class Plain:
    def __init__(self, layout: str, accum: int, args: Any, data) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        replicate, shard = LAYOUTS[layout].dp_replicate, LAYOUTS[layout].dp_shard
        if replicate > 1:  # HSDP: replicate outer, shard inner
            mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (shard,), mesh_dim_names=("dp_shard",))
        model = build_model(args)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
        self.batches = Cycle(DataLoader(data, batch_size=args.batch, sampler=sampler))
        self.accum, self.world = accum, dist.get_world_size()

    def step(self, log: str) -> float | None:
        import torch.distributed as dist

        logged = None
        for i in range(self.accum):
            batch = self.batches.next()
            if self.accum > 1:
                self.model.set_requires_gradient_sync(i == self.accum - 1)
            loss = self.model(**batch).loss
            (loss / self.accum).backward()
            if log != "none":
                value = loss.detach().clone()
                dist.all_reduce(value)
                logged = (value / self.world).item()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), 1.0, norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return logged


def _runs(layout: str, accum: int, args: Any, steps: int) -> tuple[Library, Plain]:
    replicate, shard = LAYOUTS[layout].dp_replicate, LAYOUTS[layout].dp_shard
    data = samples(args, replicate * shard, accum, steps)
    return Library(layout, accum, args, data), Plain(layout, accum, args, data)


# ---- counting -----------------------------------------------------------------------------------------------------
def _profile(run, log: str, steps: int) -> dict[str, Any]:
    # CPU time, not the wall clock: on a shared machine the wall clock mostly measures the other processes.
    profile = cProfile.Profile(time.process_time)
    start = time.process_time()
    profile.enable()
    for _ in range(steps):
        run.step(log)
    profile.disable()
    cpu = time.process_time() - start
    stats = pstats.Stats(profile, stream=io.StringIO())
    own = [(tt / steps, f"{Path(f).name}:{line}({fn})") for (f, line, fn), (_, _, tt, _, _) in stats.stats.items()
           if "/ndparallel/" in f]
    own.sort(reverse=True)
    return {"cpu_ms": 1e3 * cpu / steps, "own_ms": 1e3 * sum(t for t, _ in own),
            "own_calls": sum(stats.stats[k][1] for k in stats.stats if "/ndparallel/" in k[0]) / steps,
            "top": [(1e3 * t, name) for t, name in own[:8]]}


def count_rank(layout: str, accum: int, args: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from ndparallel.test_utils.collectives import CollectiveCounter, StoreCounter

    total = 2 + len(LOGS) * (2 + args.profile_steps)
    lib, plain = _runs(layout, accum, args, total)
    out: dict[str, Any] = {}
    for log in LOGS:
        for name, run in (("library", lib), ("plain", plain)):
            run.step(log), run.step(log)  # warm: the first steps build optimizer state and caches
            dist.barrier()
            with StoreCounter() as store, CollectiveCounter(sites=True) as counter:
                value = run.step(log)
            dist.barrier()
            out[(log, name)] = {"collectives": dict(counter.by_group), "sites": dict(counter.collective_sites),
                                "store": dict(store.calls), "store_sites": dict(store.sites), "syncs": counter.syncs,
                                "sync_sites": dict(counter.sync_sites), "logged": value,
                                "profile": _profile(run, log, args.profile_steps)}
    return out


def _fmt(d: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def count(args: Any) -> None:
    print(f"per optimizer step, rank 0 (tiny Llama hidden {args.hidden}, {args.layers} layers, {args.batch} x "
          f"{args.seq} tokens per rank); Python: cProfile over {args.profile_steps} steps")
    header = ("| layout | accum | log | run | collectives (kind/group size: calls) | store ops | host syncs "
              "| CPU ms/step (profiled) | library self CPU ms/step (calls) |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    details = []
    for layout in args.layouts:
        replicate, shard = LAYOUTS[layout].dp_replicate, LAYOUTS[layout].dp_shard
        for accum in args.accum:
            ranks = run_ranks(count_rank, replicate * shard, layout, accum, args, timeout=args.timeout)
            r0 = ranks[0]
            for log in LOGS:
                for name in ("library", "plain"):
                    c = r0[(log, name)]
                    p = c["profile"]
                    own = f"{p['own_ms']:.2f} ({p['own_calls']:.0f})" if name == "library" else "-"
                    print(f"| {layout} | {accum} | {log} | {name} | {_fmt(c['collectives'])} | "
                          f"{sum(c['store'].values())} | {c['syncs']} | {p['cpu_ms']:.1f} | {own} |", flush=True)
                    details.append((layout, accum, log, name, c))
                # The same quantity on both sides: the global mean of the micro-step's loss (reduce_loss gives the
                # window's mean so far, which is that only without accumulation).
                gap = [abs(rk[(log, 'library')]['logged'] - rk[(log, 'plain')]['logged']) for rk in ranks
                       if rk[(log, 'library')]['logged'] is not None]
                if gap and (log == "reduce" or accum == 1):
                    print(f"|  |  |  | logged loss, max \\|library - plain\\| over ranks: {max(gap):.1e} |", flush=True)
    print("\nwho made them (rank 0, counted step):")
    for layout, accum, log, name, c in details:
        print(f"- {layout} accum {accum} log {log} {name}: collectives {_fmt(c['sites'])}; syncs "
              f"{_fmt(c['sync_sites'])}; store {_fmt(c['store_sites'])}")
        if name == "library":
            print("    top library self time (ms/step): " + ", ".join(f"{n} {t:.3f}" for t, n in c["profile"]["top"]))


# ---- timing -------------------------------------------------------------------------------------------------------
def time_rank(layout: str, accum: int, args: Any) -> dict[str, Any]:
    import torch.distributed as dist

    lib, plain = _runs(layout, accum, args, args.warmup + args.rounds * args.steps + 2)
    for run in (lib, plain):
        for _ in range(args.warmup):
            run.step(args.log)
    wall: dict[str, list[list[float]]] = {"library": [], "plain": []}
    cpu: dict[str, list[list[float]]] = {"library": [], "plain": []}
    for r in range(args.rounds):
        order = [("library", lib), ("plain", plain)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            block_wall, block_cpu = [], []
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                run.step(args.log)
                block_wall.append(time.perf_counter() - start)
                block_cpu.append(time.process_time() - start_cpu)
            wall[name].append(block_wall)
            cpu[name].append(block_cpu)
    return {"wall": wall, "cpu": cpu}


def _ratios(times: dict[str, list[list[float]]]) -> list[float]:
    return [statistics.median(a) / statistics.median(b) for a, b in zip(times["library"], times["plain"])]


def _pooled(times: dict[str, list[list[float]]], rounds: list[int] | None = None) -> float:
    """Median per-step time of the library over that of plain, every step of the given rounds pooled."""
    rounds = range(len(times["library"])) if rounds is None else rounds
    lib = statistics.median(t for r in rounds for t in times["library"][r])
    plain = statistics.median(t for r in rounds for t in times["plain"][r])
    return lib / plain


def _interval(times: dict[str, list[list[float]]], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of `_pooled`, resampling whole rounds (a round's two blocks ran back to back, so a
    resample keeps them paired)."""
    import random

    rng, n = random.Random(0), len(times["library"])
    values = sorted(_pooled(times, [rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def timing(args: Any) -> None:
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"{args.rounds} rounds x {args.steps} optimizer steps of each, after {args.warmup} warm-up; log={args.log}")
    print("| layout | accum | library ms/step | plain ms/step | library / plain (median of rounds) | spread (min..max) "
          "| pooled ratio [95% interval] | CPU-time ratio (spread) |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        replicate, shard = LAYOUTS[layout].dp_replicate, LAYOUTS[layout].dp_shard
        for accum in args.accum:
            r0 = run_ranks(time_rank, replicate * shard, layout, accum, args, timeout=args.timeout)[0]
            ratios, cpu_ratios = _ratios(r0["wall"]), _ratios(r0["cpu"])
            lib = statistics.median(t for block in r0["wall"]["library"] for t in block)
            plain = statistics.median(t for block in r0["wall"]["plain"] for t in block)
            print(f"| {layout} | {accum} | {1e3 * lib:.2f} | {1e3 * plain:.2f} | **{statistics.median(ratios):.3f}** "
                  f"| {min(ratios):.3f}..{max(ratios):.3f} | {_pooled(r0['wall']):.3f} "
                  f"[{_interval(r0['wall'])[0]:.3f}..{_interval(r0['wall'])[1]:.3f}] "
                  f"| {statistics.median(cpu_ratios):.3f} "
                  f"({min(cpu_ratios):.3f}..{max(cpu_ratios):.3f}) |", flush=True)
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("count", "time"))
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--accum", nargs="*", type=int, default=None, help="accumulation steps (count: 1 2; time: 1)")
    p.add_argument("--log", choices=LOGS, default="reduce", help="time: how the loss is logged every micro-step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="samples per rank per micro-step")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    if args.accum is None:
        args.accum = [1, 2] if args.mode == "count" else [1]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    count(args) if args.mode == "count" else timing(args)


if __name__ == "__main__":
    main()
