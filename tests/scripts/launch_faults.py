"""Launched by tests/launch/test_launch_faults.py under `ndparallel launch`: ranks that run on, or stall.

``loop --pid-dir D``: each rank writes its pid to ``D/rank_<RANK>.pid``, then prints a step every 0.1 s, forever.
``stall``: the ranks start a gloo process group and make library calls (heartbeats) for a moment; then rank 1
sleeps without a call (a rank stuck in user code) while rank 0 waits for it in a barrier.
``stall-late``: the same, but rank 1 makes its last library call after rank 0 has gone into the barrier, so the rank
stuck in its own code is not the one heard from longest ago.
``save-on-one --out DIR``: FSDP2 over the ranks; after two steps rank 0 alone calls save_state (under
``if accelerator.is_main_process:``) while rank 1 trains on.
"""

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("loop", "stall", "stall-late", "save-on-one"))
parser.add_argument("--out", type=Path, default=None)
parser.add_argument("--pid-dir", type=Path, default=None)
args = parser.parse_args()
rank = int(os.environ["RANK"])

if args.mode == "loop":
    (args.pid_dir / f"rank_{rank}.pid").write_text(str(os.getpid()))
    step = 0
    while True:
        step += 1
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.1)
elif args.mode == "save-on-one":
    import torch

    from ndparallel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2),
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for step in range(6):
        acc.backward(model(torch.ones(2, 8)).sum())
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 and acc.is_main_process:
            acc.save_state(args.out)  # a collective call on one rank only
else:
    import torch.distributed as dist

    from ndparallel.distributed.runtime import heartbeat, init_runtime

    init_runtime(cpu=True)
    for _ in range(5):
        heartbeat("training step")
        time.sleep(0.1)
    if rank == 1:
        if args.mode == "stall-late":
            time.sleep(1.5)  # rank 0 is in the barrier by now
            heartbeat("backward")
        time.sleep(600)  # stuck: no library call any more
    heartbeat("barrier")
    dist.barrier()  # rank 0 waits here for rank 1
