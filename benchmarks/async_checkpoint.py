"""How long a checkpoint stops training: ``save_state`` against ``save_state(async_save=True)``, in one run.

    python benchmarks/async_checkpoint.py [--rounds 3] [--world 2] [--dir /tmp]

Two models, each trained with AdamW under FSDP2 (dp_shard over `--world` forked gloo ranks, `run_ranks`): the
README example's Llama (hidden 64, 2 layers, byte vocabulary) and a Llama of about 100M parameters (hidden 768, 12
layers, vocabulary 16k). After a few steps each rank times the call to ``save_state`` -- the stall: how long
training waits -- for a blocking save and a background one (alternating, `--rounds` of each), then waits for the
background write to commit and times that too. Printed per model: the median stall of each, their ratio (target:
background <= 10% of blocking), the first background save's stall (it allocates the host copies the next ones
reuse), the background write's own time, and the checkpoint's size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

torch.set_num_threads(1)

from common import llama  # noqa: E402

from ndparallel.test_utils import run_ranks  # noqa: E402

MODELS = {"README example": dict(vocab=259, hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2),
          "100M": dict(vocab=16384, hidden=768, intermediate=3072, layers=12, heads=12, kv_heads=4)}


def job(config: dict, rounds: int, directory: str, world: int) -> dict:

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=world),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = llama(**config, max_positions=64)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    ids = torch.randint(0, config["vocab"], (2, 64), generator=torch.Generator().manual_seed(acc.process_index))

    def step() -> None:
        acc.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    stalls: dict[str, list[float]] = {"blocking": [], "background": []}
    writes = []
    for i in range(rounds):
        for kind in ("blocking", "background") if i % 2 == 0 else ("background", "blocking"):
            acc.wait_for_everyone()
            started = time.perf_counter()
            acc.save_state(f"{directory}/{kind}_{i}", async_save=kind == "background")
            stalls[kind].append(time.perf_counter() - started)
            step()  # training goes on while a background save writes
            if kind == "background":
                acc.wait_for_checkpoint()
                writes.append(time.perf_counter() - started)  # from the call until the commit
    size = sum(f.stat().st_size for f in Path(f"{directory}/blocking_0").rglob("*") if f.is_file())
    acc.end_training()
    return {"params": params, "stalls": stalls, "writes": writes, "bytes": size}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = p.parse_args(argv)
    print(f"FSDP2 over {args.world} CPU ranks, AdamW; the time save_state holds up training (median of "
          f"{args.rounds}), on the slowest rank")
    print(f"{'model':16s} {'parameters':>11s} {'checkpoint':>11s} {'blocking s':>11s} {'background s':>13s} "
          f"{'ratio':>6s} {'first bg s':>15s} {'background write s':>19s}")
    for name, config in MODELS.items():
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            results = run_ranks(job, args.world, config, args.rounds, directory, args.world, timeout=3600)
        blocking = max(statistics.median(r["stalls"]["blocking"]) for r in results)
        background = max(statistics.median(r["stalls"]["background"]) for r in results)
        first = max(r["stalls"]["background"][0] for r in results)
        write = max(statistics.median(r["writes"]) for r in results)
        print(f"{name:16s} {results[0]['params']:11,d} {results[0]['bytes'] / 2**20:9.1f}MB {blocking:11.3f} "
              f"{background:13.3f} {background / blocking:6.3f} {first:15.3f} {write:19.3f}")
    print("ratio: background stall / blocking stall (target <= 0.10); first bg: the first background save, which also "
          "allocates the host copies kept for the next ones; background write: from the call until the checkpoint is "
          "committed (training steps run meanwhile)")


if __name__ == "__main__":
    main()
